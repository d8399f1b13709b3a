"""``lora.CausalLM``: a transformers causal language model (Llama, Qwen2) on
the GPU with LoRA adapters on its Linear layers, trained and run as
transformers + peft would, every kernel in shaderdsl.

    lm = lora.CausalLM.from_pretrained("SmolLM2-135M", target_modules="all-linear", rank=16)
    lm.step(input_ids)           # one training step, one submit, nothing read back
    lm.loss()                    # that step's loss (waits for the GPU)
    lm.logits(input_ids)         # float32 [batch, seq, vocab]
    lm.save_adapter("adapter")   # what PeftModel.from_pretrained(model, "adapter") loads

Everything the user gives is checked before any buffer is made; the weights
go to the GPU once, the activations of a batch shape when it first comes.
"""
from __future__ import annotations

import os

import numpy as np
from numpy.typing import DTypeLike

from ..core.checks import count
from ..core.weight import storage_dtype
from ..training.adapter_io import LoraLayer, load_adapter, save_adapter
from ..training.optim import AdamW, check_free
from . import inputs as I
from .adapters import peft_adapter
from .config import linear_modules, memory_check
from .generate import generate
from .graph import Graph, _buffers
from .mixed import MixedAdapters
from .params import Frozen, fresh_layer, upload_adapter
from .rope import rope_tables
from .targets import lm_modules, resolve_targets
from .weights import load_weights, weights_from_transformers

INFERENCE_SHAPES = 2   # inference graphs kept, most recent first


class CausalLM:
    """A causal LM with LoRA on ``target_modules`` (as peft reads them: module
    name suffixes, a regex, or "all-linear"; None: peft's default q_proj and
    v_proj). Make one with :meth:`from_pretrained` (a local Hugging Face
    folder, no torch needed) or :meth:`from_transformers` (a model in memory,
    or a peft PeftModel with its adapter).

    ``rank``, ``alpha``, ``use_rslora``, ``lora_dropout``: peft's LoraConfig
    (r, lora_alpha, use_rslora, lora_dropout); fresh adapters are made as peft
    makes them (B = 0, A Kaiming-uniform seeded by ``seed``), or given as
    ``adapters`` {module name: lora.LoraLayer}. In training, lora_dropout drops
    each adapter's input (not the base's) with lora.Network's masks: a hash
    of (``dropout_seed`` + the module's index among the adapted ones, the
    step, the element), not torch's generator. ``dtype``: float32, or float16
    for mixed precision as torch.autocast does it (f16 weights and
    activations, f32 sums, softmax, norms, residual stream and loss, f32
    masters of A and B). ``optimizer``: a lora.AdamW (default) or lora.SGD."""

    def __init__(self, weights, *, target_modules=None, rank: int = 8, alpha: float = 8,
                 dtype: DTypeLike = np.float32, optimizer=None, lora_dropout: float = 0.0,
                 use_rslora: bool = False, seed: int = 0, dropout_seed: int = 0, adapters=None,
                 device=None):
        self.config = weights.config
        self.dtype = storage_dtype(dtype)
        self.device = device if device is not None else _default_device()
        splits = memory_check(self.config, self.device.limits, self.dtype)
        self.optimizer = AdamW() if optimizer is None else optimizer
        check_free(self.optimizer, "CausalLM")
        self.lora_dropout = _dropout(lora_dropout)
        self.dropout_seed = _seed(dropout_seed)
        layers = self._layers(target_modules, count(rank, "CausalLM: rank"), alpha,
                              use_rslora, seed, adapters)
        cos, sin = rope_tables(self.config, self.config.max_position_embeddings,
                               inv_freq=weights.inv_freq)
        self.frozen = Frozen(self.device, weights, self.dtype, splits, cos, sin)
        self.adapted = {name: upload_adapter(self.device, name, layer, self.dtype)
                        for name, layer in layers.items()}
        self.lowest_adapted = min(int(name.split(".")[2]) for name in self.adapted)
        self.optimizer.attach(self.device, [pair for ad in self.adapted.values()
                                            for pair in zip(ad.masters, ad.grads)])
        self._train: Graph | None = None
        self._infer: list[Graph] = []
        self._generations: list = []   # generate's caches and graphs, by shape (generate.py)
        self.steps, self._counted = 0, 0
        self.mixed = MixedAdapters(self)

    def _layers(self, target_modules, rank: int, alpha, use_rslora: bool, seed: int,
                adapters) -> dict[str, LoraLayer]:
        """{module name: LoraLayer} of every targeted Linear, in the model's order."""
        targets = resolve_targets(target_modules, lm_modules(self.config))
        if "lm_head" in targets:
            raise ValueError("CausalLM: LoRA on lm_head is not supported; target the decoder "
                             "layers' Linear modules (\"all-linear\" leaves lm_head out)")
        given = dict(adapters or {})
        unknown = sorted(set(given) - set(targets))
        if unknown:
            raise ValueError(f"CausalLM: adapters for {unknown}, which target_modules does not "
                             f"target")
        shapes = linear_modules(self.config)
        out = {}
        for k, name in enumerate(targets):
            rows, cols, _ = shapes[name]
            layer = given.get(name) or fresh_layer(cols, rows, rank, alpha, use_rslora, seed + k)
            if (layer.in_dim, layer.out_dim) != (cols, rows):
                raise ValueError(f"CausalLM: the adapter of {name} is A {list(layer.a.shape)}, "
                                 f"B {list(layer.b.shape)}; the module is {cols} -> {rows}")
            out[name] = layer
        return out

    # ------------------------------------------------------------ making one

    @classmethod
    def from_pretrained(cls, folder, **options) -> "CausalLM":
        """The model in a local Hugging Face folder (config.json and
        safetensors, sharded or not; f32, f16 or bf16), read without torch;
        ``options`` are the constructor's."""
        return cls(load_weights(folder, storage_dtype(options.get("dtype", np.float32))),
                   **options)

    @classmethod
    def from_transformers(cls, model, **options) -> "CausalLM":
        """A transformers LlamaForCausalLM or Qwen2ForCausalLM in memory (its
        weights copied to the GPU once), or a peft PeftModel of one, whose
        LoraConfig (target modules, ranks, alphas, rsLoRA, dropout) and adapter
        weights it takes; ``options`` are the constructor's."""
        weights = weights_from_transformers(model, storage_dtype(options.get("dtype",
                                                                             np.float32)))
        if hasattr(model, "peft_config"):
            taken = sorted(set(options) & {"target_modules", "rank", "alpha", "use_rslora",
                                           "adapters"})
            if taken:
                raise ValueError(f"CausalLM.from_transformers: {taken} come from the "
                                 f"PeftModel's LoraConfig and adapter; give the model before "
                                 f"get_peft_model to set them")
            peft = peft_adapter(model)
            options.setdefault("lora_dropout", peft.lora_dropout)
            options.update(target_modules=list(peft.layers), adapters=peft.layers)
        return cls(weights, **options)

    # ------------------------------------------------------------ training

    def step(self, input_ids, labels=None, attention_mask=None) -> None:
        """One training step on ``input_ids`` [batch, seq] with transformers'
        meaning: ``labels`` default to the ids and are shifted inside (-100
        ignored), the loss the mean over the counted tokens, ``attention_mask``
        0 at padding. Written and recorded in one submit; nothing is read back."""
        batch = self._batch(input_ids, labels, attention_mask, "CausalLM.step", True)
        graph = self._training_graph(batch)
        dev = self.device
        for buf, values in ((graph.ids, batch.ids), (graph.keep, batch.keep),
                            (graph.positions, batch.positions), (graph.labels, batch.labels)):
            dev.write(buf, values)
        graph.record_step()
        self.steps += 1
        self._counted = batch.counted

    def loss(self) -> float:
        """The last step's loss, of the forward before its update (as
        transformers' ``outputs.loss``); reads back, so waits for the GPU."""
        if self._train is None or not self.steps:
            raise RuntimeError("CausalLM.loss: no step recorded yet; call step(input_ids) first")
        losses = self.device.read(self._train.losses).astype(np.float64)
        return float(losses.sum() / self._counted) if self._counted else 0.0

    def _batch(self, input_ids, labels, attention_mask, call: str, training: bool) -> I.Batch:
        c = self.config
        return I.check_batch(input_ids, labels, attention_mask, vocab=c.vocab_size,
                             max_positions=c.max_position_embeddings, call=call,
                             with_labels=training)

    def _training_graph(self, batch: I.Batch) -> Graph:
        """The training graph for this batch's shape (made again for another shape)."""
        graph = self._train
        if graph is None or (graph.batch, graph.seq) != (batch.batch, batch.seq):
            self._train = None   # its buffers go before the new ones are made
            graph = self._train = Graph(self, batch.batch, batch.seq, training=True)
            self.optimizer.scale_gradients(1.0 / graph.loss_scale)
        return graph

    # ------------------------------------------------------------ inference

    def logits(self, input_ids, attention_mask=None, adapter_names=None) -> np.ndarray:
        """The adapted model's logits, float32 [batch, seq, vocab] (read back).
        Positions count from 0 in every row, as transformers' forward counts
        them without position_ids; a query that sees no key (a left pad) gets
        an attention output of 0 (transformers' value there depends on its
        attention implementation). ``adapter_names``: one per sequence, as
        peft's mixed batch ("default": the model's own, "__base__": none,
        others loaded with :meth:`add_adapter`)."""
        batch = self._batch(input_ids, None, attention_mask, "CausalLM.logits", False)
        routes = None if adapter_names is None else \
            self.mixed.ids(adapter_names, batch.batch, batch.seq)
        graph = self._inference_graph(batch.batch, batch.seq, routes is not None)
        if routes is not None:
            graph.mixed_plans = self.mixed.plans(routes)
        dev = self.device
        for buf, values in ((graph.ids, batch.ids), (graph.keep, batch.keep),
                            (graph.positions, batch.positions)):
            dev.write(buf, values)
        with dev.batch():
            graph.record_forward()
        out = dev.read(graph.logits).astype(np.float32)
        return out.reshape(batch.batch, batch.seq, self.config.vocab_size)

    def generate(self, input_ids, max_new_tokens: int, eos_token_id=None, attention_mask=None,
                 pad_token_id=None, adapter_names=None) -> np.ndarray:
        """Greedy decoding with a KV cache on the GPU: the prompt and the new
        ids, int64 [batch, prompt + new], as transformers' ``generate(...,
        do_sample=False)`` returns them, token for token. Stops when every
        sequence has given an ``eos_token_id`` (one id or several; None: the
        config's eos ids) or after ``max_new_tokens``; a finished sequence
        is filled with ``pad_token_id`` (None: the config's pad id, else its
        first eos id). ``attention_mask``: 0 at (left) padding of the prompt;
        positions count from each row's first real token, as generate counts
        them. ``adapter_names``: one per sequence, as :meth:`logits` takes them."""
        return generate(self, input_ids, max_new_tokens, eos_token_id, attention_mask,
                        pad_token_id, adapter_names)

    def _inference_graph(self, batch: int, seq: int, mixed: bool = False) -> Graph:
        for k, graph in enumerate(self._infer):
            if (graph.batch, graph.seq, graph.mixed) == (batch, seq, mixed):
                self._infer.insert(0, self._infer.pop(k))
                return graph
        graph = Graph(self, batch, seq, training=False, mixed=mixed)
        self._infer = [graph] + self._infer[:INFERENCE_SHAPES - 1]
        return graph

    def memory(self) -> dict[str, int]:
        """Bytes on the device by part: the frozen weights (and RoPE's tables),
        the adapters (A and B, their f32 masters and gradients, the
        optimizer's moments), the last training step's activations and
        gradients (once a step has run: what a step of that shape takes on
        top of the rest), and the inference graphs kept (logits' and
        generate's, with generate's KV caches)."""
        seen: dict[int, int] = {}
        _buffers(list(vars(self.frozen).items()), seen, set())
        frozen = sum(seen.values())
        parts: dict = {}
        for ad in self.adapted.values():
            _buffers([(0, ad.weight.a), (1, ad.weight.b), (2, list(ad.masters)),
                      (3, list(ad.grads))], parts, set())
        opt = self.optimizer
        _buffers([(0, getattr(opt, "extra", [])), (1, getattr(opt, "state", None)),
                  (2, getattr(opt, "hyper", None))], parts, set())
        return {"weights": frozen, "adapters": sum(parts.values()),
                "training step": self._train.nbytes() if self._train is not None else 0,
                "inference": sum(g.nbytes() for g in [*self._infer, *self._generations])}

    # ------------------------------------------------------------ adapters

    def adapters(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{peft's module name: (A, B)} as trained (the f32 masters; read back)."""
        read = self.device.read
        return {name: (read(ad.masters[0]).copy(), read(ad.masters[1]).copy())
                for name, ad in self.adapted.items()}

    def add_adapter(self, name: str, adapter) -> None:
        """Load another adapter under ``name`` for mixed batches
        (``adapter_names`` of :meth:`logits` and :meth:`generate`): a peft
        adapter directory, or {module name: lora.LoraLayer}; its modules need
        not be the model's own adapted ones (a module it lacks gets no delta
        from it). It is not trained."""
        layers = load_adapter(adapter) if isinstance(adapter, (str, os.PathLike)) else adapter
        if not isinstance(layers, dict) or not all(isinstance(v, LoraLayer)
                                                   for v in layers.values()):
            raise ValueError(f"CausalLM.add_adapter: expected a peft adapter directory or "
                             f"{{module name: lora.LoraLayer}}, got {type(adapter).__name__}")
        self.mixed.add(name, layers)

    def remove_adapter(self, name: str) -> None:
        """Forget an adapter :meth:`add_adapter` loaded."""
        self.mixed.remove(name)

    def save_adapter(self, path, *, base_model_name_or_path=None):
        """Every adapter as one peft adapter directory, which
        ``PeftModel.from_pretrained(model, path)`` loads into the same model:
        task_type CAUSAL_LM, the targeted modules (their short names where
        those name exactly the adapted modules), each module's rank and alpha
        (peft's patterns where they differ), rsLoRA and lora_dropout."""
        first = next(iter(self.adapted.values())).layer
        return save_adapter(path, self.adapters(),
                            alpha={n: ad.layer.alpha for n, ad in self.adapted.items()},
                            target_modules=self._peft_targets(), use_rslora=first.use_rslora,
                            lora_dropout=self.lora_dropout, task_type="CAUSAL_LM",
                            base_model_name_or_path=base_model_name_or_path)

    def _peft_targets(self) -> list[str]:
        """target_modules for the adapter file: short names ("q_proj") where
        every Linear so named is adapted, else the full module names."""
        short = sorted({name.rsplit(".", 1)[-1] for name in self.adapted})
        named = [n for n in linear_modules(self.config)
                 if n != "lm_head" and n.rsplit(".", 1)[-1] in short]
        return short if set(named) == set(self.adapted) else sorted(self.adapted)

    def load_adapter(self, path) -> None:
        """Every adapter's A and B from a peft adapter directory (what peft
        trained on this model) whose modules are exactly the adapted ones,
        each of the rank and scale this model was made with."""
        layers = load_adapter(path)
        if set(layers) != set(self.adapted):
            raise ValueError(f"CausalLM.load_adapter: {path} adapts {_listed(layers)}; this "
                             f"model adapts {_listed(self.adapted)}")
        for name, layer in layers.items():
            mine = self.adapted[name]
            if layer.rank != mine.rank or not np.isclose(layer.scale, mine.scale, rtol=1e-6):
                raise ValueError(f"CausalLM.load_adapter: {name} in {path} has rank "
                                 f"{layer.rank} and scale {layer.scale:g}; this model's has "
                                 f"rank {mine.rank} and scale {mine.scale:g} (make the model "
                                 f"with the adapter's rank and alpha)")
        for name, layer in layers.items():
            self.adapted[name].weight.write(layer.a, layer.b)


def _listed(names) -> str:
    """Module names in a message: a few, then how many more."""
    names = sorted(names)
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"{names[:4]}{more}"


def _default_device():
    from shaderdsl.runtime import get_device
    return get_device()


def _seed(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
            not 0 <= value < 2**32:
        raise ValueError(f"CausalLM: dropout_seed must be an int in [0, 2^32), got {value!r}")
    return int(value)


def _dropout(p) -> float:
    from ..kernels.dropout import threshold
    threshold(p)  # ValueError outside [0, 1)
    return float(p)
