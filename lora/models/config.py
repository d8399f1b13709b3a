"""A causal LM's config: transformers' LlamaConfig or Qwen2Config, read from a
config.json's dict or from a transformers config, checked, with transformers' own
defaults (5.17's configuration_llama.py and configuration_qwen2.py); the weights it
implies, by transformers' names and shapes; and what of them a device can hold.

    config = LMConfig.from_dict(json.loads(text), source="model/config.json")
    shapes = weight_shapes(config)          # {"model.embed_tokens.weight": (vocab, hidden), ...}
    plan = memory_check(config, device.limits, np.float16)   # {name: WeightSplit}
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import DTypeLike

from ..training.adapter_io import json_kind
from .checks import ModelError, boolean, integer, number, text
from .rope import MAX_POSITIONS, RopeConfig, rope_from_dict

# model_type -> the transformers class whose weights and forward lora runs
SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# transformers 5.17's class defaults for what a config.json may leave out
DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None},
}
MAX_LAYERS, MAX_HEADS, MAX_VOCAB = 1024, 65536, 2**24


@dataclass(frozen=True)
class LMConfig:
    """What lora needs of a Llama or Qwen2 causal LM's config, checked.

    ``qkv_bias`` / ``o_bias``: whether q, k, v_proj / o_proj have biases (Llama:
    ``attention_bias`` for all four; Qwen2: q, k, v yes, o no); ``mlp_bias``: gate, up
    and down_proj (Llama's ``mlp_bias``; Qwen2 none). ``eos_token_ids``: the config's
    ``eos_token_id`` as a tuple (Llama 3 lists several). ``dtype``: the weights' dtype
    the file names (``torch_dtype`` or ``dtype``), or None. ``attention_dropout`` is
    recorded, not applied (a warning says so where it is not 0)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    attention_dropout: float = 0.0
    dtype: str | None = None
    source: str = field(default="", compare=False)

    @property
    def architecture(self) -> str:
        """transformers' class: LlamaForCausalLM or Qwen2ForCausalLM."""
        return SUPPORTED[self.model_type]

    @property
    def q_dim(self) -> int:
        """q_proj's outputs and o_proj's inputs: heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """k_proj's and v_proj's outputs: kv heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "LMConfig":
        """The config of a config.json's dict (``source``: what the messages call it),
        each value checked by its key; ModelError naming what is wrong."""
        where = str(source)
        if not isinstance(d, dict):
            raise ModelError(f"{where}: expected a JSON object, got {json_kind(d)}")
        model_type = _model_type(d, where)
        _check_supported(d, where, model_type)
        sizes = _sizes(d, where, DEFAULTS[model_type], model_type)
        _check_sliding_window(d, where, model_type, sizes)
        biases = (("qkv_bias", True), ("o_bias", False), ("mlp_bias", False))
        if model_type == "llama":
            attention = boolean(d, "attention_bias", False, where)
            biases = (("qkv_bias", attention), ("o_bias", attention),
                      ("mlp_bias", boolean(d, "mlp_bias", False, where)))
        return cls(model_type=model_type, **sizes, **dict(biases),
                   rms_norm_eps=number(d, "rms_norm_eps", 1e-6, where, low=0.0),
                   tie_word_embeddings=boolean(d, "tie_word_embeddings", False, where),
                   rope=rope_from_dict(d, where, sizes["max_position_embeddings"]),
                   **_token_ids(d, where, DEFAULTS[model_type]),
                   attention_dropout=_attention_dropout(d, where),
                   dtype=_file_dtype(d, where), source=where)

    @classmethod
    def from_transformers(cls, config) -> "LMConfig":
        """The config of a transformers config (``model.config``), read through its
        ``to_dict()`` as a config.json is."""
        if not hasattr(config, "to_dict") or hasattr(config, "state_dict"):
            raise ModelError(f"LMConfig.from_transformers: expected a transformers config "
                             f"(model.config), got {type(config).__name__}")
        return cls.from_dict(config.to_dict(), source=type(config).__name__)


def _model_type(d: dict, where: str) -> str:
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        shown = ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED.items())
        raise ModelError(f"{where}: model_type {model_type!r} is not supported; lora runs "
                         f"{shown}")
    return model_type


def _check_supported(d: dict, where: str, model_type: str) -> None:
    """The architecture, activation and weight format lora runs."""
    architectures = d.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or SUPPORTED[model_type] not in architectures):
        raise ModelError(f"{where}: architectures {architectures!r}: lora runs "
                         f"{SUPPORTED[model_type]} for model_type {model_type!r} (a causal "
                         f"LM's head, not another task's)")
    text(d, "hidden_act", "silu", where, ("silu",))
    quantization = d.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ModelError(f"{where}: quantization_config ({method or quantization!r}): "
                         f"quantized weights are not supported; give f32, f16 or bf16 weights")


def _sizes(d: dict, where: str, defaults: dict, model_type: str) -> dict:
    """The sizes, each an int in its bounds; head_dim derived as transformers does."""
    sizes = {key: integer(d, key, defaults[key], where, high=high) for key, high in (
        ("vocab_size", MAX_VOCAB), ("hidden_size", 2**31 - 1), ("intermediate_size", 2**31 - 1),
        ("num_hidden_layers", MAX_LAYERS), ("num_attention_heads", MAX_HEADS),
        ("max_position_embeddings", MAX_POSITIONS))}
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv = integer(d, "num_key_value_heads", defaults["num_key_value_heads"] or heads, where,
                 high=MAX_HEADS, nullable=True)
    if d.get("head_dim") is None or model_type == "llama":  # Llama checks it either way
        if hidden % heads:
            raise ModelError(f"{where}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}")
    head_dim = integer(d, "head_dim", hidden // heads, where, nullable=True)
    if head_dim % 2:
        raise ModelError(f"{where}: head_dim {head_dim} is odd; rotary embeddings rotate "
                         f"pairs (the head's two halves)")
    if heads % kv:
        raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv} (each kv head serves a group of heads)")
    return {**sizes, "num_key_value_heads": kv, "head_dim": head_dim}


def _check_sliding_window(d: dict, where: str, model_type: str, sizes: dict) -> None:
    """Qwen2's use_sliding_window: refused where a layer would attend to fewer tokens
    than max_position_embeddings (transformers' layer_types rule)."""
    if model_type != "qwen2" or not boolean(d, "use_sliding_window", False, where):
        return
    window = integer(d, "sliding_window", 4096, where, nullable=True)
    first = integer(d, "max_window_layers", 28, where, low=0)
    sliding = [i for i in range(sizes["num_hidden_layers"]) if i >= first]
    if isinstance(d.get("layer_types"), list):
        sliding = [i for i, kind in enumerate(d["layer_types"]) if kind == "sliding_attention"]
    if d.get("sliding_window") is not None and sliding and \
            window < sizes["max_position_embeddings"]:
        layers = f"layers {sliding[0]} to {sliding[-1]} attend" if len(sliding) > 1 else \
            f"layer {sliding[0]} attends"
        raise ModelError(f"{where}: use_sliding_window is true: {layers} only to the "
                         f"last {window} tokens (sliding-window attention), which lora's "
                         f"attention does not do; every layer sees every earlier token")


def _token_id(d: dict, key: str, default, where: str) -> int | None:
    value = d.get(key, default)
    return None if value is None else integer({key: value}, key, None, where, low=0)


def _token_ids(d: dict, where: str, defaults: dict) -> dict:
    """bos, eos (one id or a list) and pad ids: ints >= 0 or null."""
    eos = d.get("eos_token_id", defaults["eos_token_id"])
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    return {"bos_token_id": _token_id(d, "bos_token_id", defaults["bos_token_id"], where),
            "pad_token_id": _token_id(d, "pad_token_id", None, where),
            "eos_token_ids": tuple(_token_id({"eos_token_id": e}, "eos_token_id", None, where)
                                   for e in eos)}


def _attention_dropout(d: dict, where: str) -> float:
    p = number(d, "attention_dropout", 0.0, where, low=0.0, nullable=True)
    if not p < 1:
        raise ModelError(f"{where}: attention_dropout must be in [0, 1), got {p!r}")
    if p:
        warnings.warn(f"{where}: attention_dropout {p} is not applied: lora's attention has "
                      f"no dropout (transformers applies it only in training mode)",
                      stacklevel=3)
    return p


def _file_dtype(d: dict, where: str) -> str | None:
    """The weights' dtype the config names (``dtype``, else the older ``torch_dtype``):
    what the file says, for the record; the tensors' own dtypes are what is read."""
    value = d.get("dtype") or d.get("torch_dtype")
    if value is None:
        return None
    if not isinstance(value, str) and not type(value).__module__.startswith("torch"):
        raise ModelError(f"{where}: dtype must be a string such as 'bfloat16', got {value!r}, "
                         f"{json_kind(value)}")
    return str(value).removeprefix("torch.")


# ---------------------------------------------------------------- weights and devices

def linear_modules(config: LMConfig) -> dict[str, tuple[int, int, bool]]:
    """Every Linear of transformers' model by its module name: (out, in, has a bias),
    in the model's order; ``lm_head`` last (a Linear even where its weight is tied)."""
    c, out = config, {}
    for i in range(c.num_hidden_layers):
        for name, rows, cols, bias in (
                ("self_attn.q_proj", c.q_dim, c.hidden_size, c.qkv_bias),
                ("self_attn.k_proj", c.kv_dim, c.hidden_size, c.qkv_bias),
                ("self_attn.v_proj", c.kv_dim, c.hidden_size, c.qkv_bias),
                ("self_attn.o_proj", c.hidden_size, c.q_dim, c.o_bias),
                ("mlp.gate_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
                ("mlp.up_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
                ("mlp.down_proj", c.hidden_size, c.intermediate_size, c.mlp_bias)):
            out[f"model.layers.{i}.{name}"] = (rows, cols, bias)
    out["lm_head"] = (c.vocab_size, c.hidden_size, False)
    return out


def weight_shapes(config: LMConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of transformers' model by its state_dict name, in its order, with the
    shape the config implies; ``lm_head.weight`` only where the head is not tied."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size,
                                                                         c.hidden_size)}
    for module, (rows, cols, bias) in linear_modules(c).items():
        if module == "lm_head":
            continue
        shapes[f"{module}.weight"] = (rows, cols)
        if bias:
            shapes[f"{module}.bias"] = (rows,)
        if module.endswith("down_proj"):
            layer = module.removesuffix("mlp.down_proj")
            shapes[f"{layer}input_layernorm.weight"] = (c.hidden_size,)
            shapes[f"{layer}post_attention_layernorm.weight"] = (c.hidden_size,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


@dataclass(frozen=True)
class WeightSplit:
    """How a weight is bound: ``chunks`` buffers, each one binding, of ``rows_per_chunk``
    rows (the last may hold fewer); ``chunks`` 1: the whole weight in one binding."""

    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    rows_per_chunk: int


ROPE_TABLES = ("rope.cos", "rope.sin")  # memory_check's names of the f32 rotary tables
LIMITS = ("max-buffer-size", "max-storage-buffer-binding-size")


def _chunk_cap(limits) -> tuple[int, str]:
    """The most bytes one chunk may hold (a buffer and a binding of its own), and the
    limits it comes from, as the messages say them."""
    limits = getattr(limits, "limits", limits)
    try:
        values = {key: int(limits[key]) for key in LIMITS}
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"memory_check: device_limits must be a device or its limits, holding "
                         f"{LIMITS}, got {type(limits).__name__} ({e!r})") from None
    cap = min(values.values())
    return cap - cap % 4, ", ".join(f"{key} = {values[key]}" for key in LIMITS)


def _split(name: str, shape: tuple, dtype: np.dtype, cap: int, said: str) -> WeightSplit:
    rows = shape[0] if len(shape) > 1 else 1
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    row_bytes = nbytes // rows
    if row_bytes > cap:
        raise ModelError(f"{name} {list(shape)} {dtype.name} is {nbytes} bytes: it is bound in "
                         f"chunks of whole rows, each a buffer and a binding of at most {cap} "
                         f"bytes ({said}), and one row is {row_bytes} bytes; the config's sizes "
                         f"are beyond what the device can hold")
    per_chunk = rows if nbytes <= cap else cap // row_bytes
    return WeightSplit(tuple(shape), nbytes, -(-rows // per_chunk), per_chunk)


def memory_check(config: LMConfig, device_limits,
                 dtype: DTypeLike = np.float32) -> dict[str, WeightSplit]:
    """Each weight of ``config`` stored as ``dtype`` (float32 or float16), and the
    float32 rotary tables (``rope.cos``, ``rope.sin``: [max_position_embeddings,
    head_dim / 2]), against ``device_limits`` (a device or its ``limits``), before
    anything is allocated: {name: WeightSplit}. A weight over a binding is split into
    chunks of rows; ModelError, naming the tensor and its bytes, where a row of one is
    over max-storage-buffer-binding-size or max-buffer-size."""
    storage = np.dtype(dtype)
    if storage not in (np.float32, np.float16):
        raise ModelError(f"memory_check: dtype must be float32 or float16, got {dtype!r}")
    cap, said = _chunk_cap(device_limits)
    out = {name: _split(name, shape, storage, cap, said)
           for name, shape in weight_shapes(config).items()}
    table = (config.max_position_embeddings, config.head_dim // 2)
    out.update({name: _split(name, table, np.dtype(np.float32), cap, said)
                for name in ROPE_TABLES})
    return out
