"""What a language model keeps on the GPU between steps: the frozen weights
(uploaded once, in the storage dtype) and the LoRA adapters of its targeted
Linear layers with their f32 masters, gradients and optimizer.

Module names are transformers' (``model.layers.0.self_attn.q_proj``), which
are peft's too, so adapters go to and from peft's files by name (the names
and shapes come from lora.models.config.linear_modules).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core import reference as R
from ..core.weight import Weight
from ..training.adapter_io import LoraLayer
from ..training.trainer import _masters
from .config import linear_modules
from .weights import EMBEDDING, HEAD


@dataclass
class Adapter:
    """One module's LoRA on the device: ``weight`` (A and B as the kernels read
    them, in the storage dtype), ``masters`` (the f32 A and B the optimizer
    updates: the weight's own buffers in f32), ``grads`` (f32 dA and dB),
    ``to_f16`` (the plan writing the masters' rounding into an f16 weight, or
    None), and ``layer``: the LoraLayer it was made from (its alpha, rsLoRA
    flag and so its scale, as peft's config says them)."""

    weight: Weight
    masters: tuple
    grads: tuple
    to_f16: object
    layer: LoraLayer

    @property
    def rank(self) -> int:
        return self.weight.rank

    @property
    def scale(self) -> float:
        return self.layer.scale


def upload_adapter(device, name: str, layer: LoraLayer, dtype) -> Adapter:
    """An Adapter on ``device`` from a LoraLayer (A and B of any float dtype)."""
    weight = Weight.from_numpy(device, layer.a, layer.b, dtype=dtype, name=name)
    masters, to_f16 = _masters(device, weight)
    grads = (device.empty(weight.a.shape, np.float32, name=f"{name}.dA"),
             device.empty(weight.b.shape, np.float32, name=f"{name}.dB"))
    return Adapter(weight, masters, grads, to_f16, layer)


def fresh_layer(in_dim: int, out_dim: int, rank: int, alpha: float, use_rslora: bool,
                seed: int) -> LoraLayer:
    """A new adapter as peft initialises one: A Kaiming-uniform, B = 0."""
    a, b = R.init_lora(in_dim, out_dim, rank, seed=seed)
    return LoraLayer(a, b, float(alpha), bool(use_rslora))


class Frozen:
    """The base model on ``device``: every weight in ``dtype`` (norm weights
    in f32, as autocast keeps them), the embedding split by rows into chunks
    that each fit a buffer and a binding (``embed``: [(first row, buffer)],
    as memory_check splits it), the LM head likewise (the same chunks when
    tied), RoPE's tables (f32 cos and sin [max_positions, head_dim / 2]), and
    ``linears``: {module name: (W, bias or None)} of every decoder Linear.
    Each weight is read from ``weights`` (an LMWeights), uploaded and dropped
    before the next, so the host holds one at a time."""

    def __init__(self, device, weights, dtype, splits: dict, cos: np.ndarray, sin: np.ndarray):
        config = weights.config
        self.device, self.config, self.dtype = device, config, np.dtype(dtype)
        self.embed = self._chunks(weights, EMBEDDING, splits[EMBEDDING].rows_per_chunk)
        self.head = self.embed if weights.tied else \
            self._chunks(weights, HEAD, splits[HEAD].rows_per_chunk)
        self.norm = self._put(weights, "model.norm.weight", np.float32)
        self.layers = [{norm: self._put(weights, f"model.layers.{i}.{norm}.weight", np.float32)
                        for norm in ("input_layernorm", "post_attention_layernorm")}
                       for i in range(config.num_hidden_layers)]
        self.linears = {name: (self._put(weights, f"{name}.weight"),
                               self._put(weights, f"{name}.bias") if bias else None)
                        for name, (_, _, bias) in linear_modules(config).items()
                        if name != "lm_head"}
        self.max_positions = cos.shape[0]
        self.cos = device.buffer(np.ascontiguousarray(cos, np.float32), name="rope.cos")
        self.sin = device.buffer(np.ascontiguousarray(sin, np.float32), name="rope.sin")

    def _put(self, weights, name: str, dtype=None):
        return self.device.buffer(np.ascontiguousarray(weights[name], dtype or self.dtype),
                                  name=name)

    def _chunks(self, weights, name: str, rows: int) -> list:
        """[(first row, buffer)] of the matrix ``name`` in chunks of ``rows`` rows."""
        matrix = weights[name]
        return [(first, self.device.buffer(np.ascontiguousarray(matrix[first:first + rows],
                                                                self.dtype),
                                           name=f"{name}[{first}:]"))
                for first in range(0, matrix.shape[0], rows)]

    def shape_of(self, name: str) -> tuple[int, int]:
        """(in, out) of the decoder Linear ``name``."""
        w, _ = self.linears[name]
        return w.shape[1], w.shape[0]
