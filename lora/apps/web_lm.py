"""A causal language model for web pages and Node: ``python -m lora export --lm FOLDER``.

The model is recorded, not rewritten. A :class:`lora.CausalLM` of the folder's
config is built on a :class:`LMRecorder` (an interpreter device that lists its
dispatches and copies and allocates nothing for the weights, which are zeros
there), with WebGPU's default limits and no subgroups unless asked; then its
graphs record one pass each: the training step (forward, loss, backward,
optimizer) and the logits at [batch, seq], and greedy generation's prefill at
[gen_batch, prompt] and decode step at [gen_batch, 1] over a KV cache of
prompt + new_tokens. The ES module (web_assets/lm.mjs) holds the kernels, every
buffer by name with its size, group and first contents (none for the weights,
which it streams from a safetensors file, and for the adapters, which it makes
or is given), the steps of each graph, and ``loadCausalLM``.

Each graph's shapes are baked into its kernels, as in Python a graph is built
for one batch shape; the page pads a smaller batch into them (see lm.mjs).
Decode steps are all alike (where a step reads its ids, the cache's past and the
positions advance on the GPU), so the page replays one list at every step; a uniform
a step binds goes with its value, and with its increase a step where the decode step,
recorded twice, shows one.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shaderdsl.export import js_object, kernel_info

from ..models.causal_lm import CausalLM
from ..models.config import LMConfig, weight_shapes
from ..models.generate import STEPS_PER_SUBMIT, KVCache
from ..models.graph import Graph
from ..models.inputs import check_batch
from ..models.weights import EMBEDDING, HEAD, LMWeights, load_weights
from ..training.optim import SGD, AdamW
from .web_export import Recorder, asset, module_code, module_types
from .web_train import optimizer_config

# What the page allocates together: the model's (weights, adapters, optimizer), each
# graph group's, and "shared": buffers more than one group uses (a run-time plan's
# scratch, cached on the adapter's weight, serves the logits and the prefill alike).
GROUPS = ("model", "train", "logits", "generate", "shared")
GRAPH_GROUPS = {"train": "train", "logits": "logits", "prefill": "generate",
                "decode": "generate"}


@dataclass(frozen=True)
class LMShapes:
    """The shapes the module bakes in: training steps and logits at ``batch`` x
    ``seq`` tokens; generation for ``gen_batch`` prompts of up to ``prompt``
    tokens and up to ``new_tokens`` new ones (the KV cache holds both)."""

    batch: int = 1
    seq: int = 64
    gen_batch: int = 1
    prompt: int = 32
    new_tokens: int = 32

    def check(self, config: LMConfig) -> None:
        for key, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--lm: {key.replace('_', '-')} must be an int >= 1, got "
                                 f"{value!r}")
        most = config.max_position_embeddings
        for what, n in (("--seq", self.seq), ("--prompt-tokens + --new-tokens",
                                              self.prompt + self.new_tokens)):
            if n > most:
                raise ValueError(f"--lm: {what} ({n}) is over the model's "
                                 f"max_position_embeddings ({most})")

    @property
    def positions(self) -> int:
        """Positions any graph reaches (RoPE's table rows the page needs)."""
        return max(self.seq, self.prompt + self.new_tokens)


@dataclass(frozen=True)
class LMSetup:
    """What ``--lm`` exports: the folder (its config.json and weights' names, shapes
    and tie are read; no value), the storage dtype, the adapters (peft's
    LoraConfig: target_modules, rank, alpha, use_rslora, lora_dropout; ``seed``:
    the page's fresh adapters and the dropout masks), the optimizer and the
    limits the kernels are built within (WebGPU's defaults unless given)."""

    folder: Path
    shapes: LMShapes = LMShapes()
    dtype: str = "f32"
    target_modules: object = None
    rank: int = 8
    alpha: float = 8.0
    use_rslora: bool = False
    lora_dropout: float = 0.0
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3
    max_grad_norm: float | None = None
    settings: dict = field(default_factory=dict)
    limits: dict = field(default_factory=dict)


class LMRecorder(Recorder):
    """A Recorder that tags each buffer with the phase it was made in (the group
    the page allocates it with), leaves a buffer made from zeros unwritten (so a
    large model's zero weights take no memory here) and lists every host write."""

    def __init__(self, features, limits):
        super().__init__(features=features)
        self.limits.update(limits)
        self.phase = "model"
        self.made: dict[int, tuple[str, object]] = {}
        self.writes: list = []

    def _alloc(self, shape, dtype, kind, name, data, size):
        blank = data is None or not np.asarray(data).any()
        buf = super()._alloc(shape, dtype, kind, name, None if blank else data, size)
        self.made[id(buf)] = (self.phase, buf)
        return buf

    def _write(self, buf, array) -> None:
        self.writes.append(buf)
        super()._write(buf, array)


def placeholder_weights(weights: LMWeights) -> LMWeights:
    """``weights``' names, shapes and tie with zeros for values (nothing is read)."""
    shapes = weight_shapes(weights.config)
    if not weights.tied:
        shapes[HEAD] = (weights.config.vocab_size, weights.config.hidden_size)
    dtype = weights.dtype
    return LMWeights(weights.config, {n: (lambda s=s: np.zeros(s, dtype))
                                      for n, s in shapes.items() if n in weights},
                     dtype, weights.source)


def build_model(setup: LMSetup) -> tuple[CausalLM, LMRecorder, LMWeights]:
    """The CausalLM of ``setup`` on a recorder, and the folder's (checked) weights."""
    storage = {"f32": np.float32, "f16": np.float16}[setup.dtype]
    weights = load_weights(setup.folder, storage)
    setup.shapes.check(weights.config)
    dev = LMRecorder(["shader-f16"] if setup.dtype == "f16" else [], setup.limits)
    make = AdamW if setup.optimizer == "adamw" else SGD
    opt = make(lr=setup.lr, max_grad_norm=setup.max_grad_norm, **setup.settings)
    lm = CausalLM(placeholder_weights(weights), target_modules=setup.target_modules,
                  rank=setup.rank, alpha=setup.alpha, dtype=storage, optimizer=opt,
                  lora_dropout=setup.lora_dropout, use_rslora=setup.use_rslora,
                  seed=setup.seed, dropout_seed=setup.seed, device=dev)
    return lm, dev, weights


@dataclass
class Recorded:
    """The graphs built (``made``: train, logits, prefill), the KV cache, and each
    graph's ops (``ops``: train, logits, prefill; ``decode``: its ops at steps 0 and 1,
    or None where generation makes one token)."""

    made: dict
    cache: KVCache
    ops: dict
    decode: tuple | None


def record_graphs(lm: CausalLM, dev: LMRecorder, shapes: LMShapes) -> Recorded:
    """Every graph of the page built on ``dev`` (each in its group) and recorded."""
    b, s, g = shapes.batch, shapes.seq, shapes.gen_batch
    dev.phase = "train"   # as CausalLM.step makes it (f16: the optimizer undoes its loss scale)
    made = {"train": lm._training_graph(check_batch(
        np.zeros((b, s), np.int64), vocab=lm.config.vocab_size,
        max_positions=lm.config.max_position_embeddings, call="--lm"))}
    dev.phase = "logits"
    made["logits"] = Graph(lm, b, s, training=False)
    dev.phase = "generate"
    cache = KVCache(lm, g, shapes.prompt + shapes.new_tokens, shapes.new_tokens)
    made["prefill"] = Graph(lm, g, shapes.prompt, training=False, cache=cache)
    decode = Graph(lm, g, 1, training=False, cache=cache) if shapes.new_tokens > 1 else None
    dev.writes.clear()
    # Twice: a run-time plan (cached on an adapter's weight, so several graphs share it)
    # grows its scratch as it records a larger count, releasing the smaller buffer that
    # an earlier graph recorded; the second pass records the grown ones only.
    for _ in range(2):
        ops, steps = _record_once(dev, made, decode)
    if dev.writes:
        raise ValueError(f"--lm: recording wrote {dev.writes[0].name!r} from the host; the "
                         f"page replays dispatches and copies only")
    return Recorded(made, cache, ops, tuple(steps) if steps else None)


def users(recorded: Recorded) -> dict[int, set[str]]:
    """{buffer id: the groups whose graphs bind or copy it}."""
    out: dict[int, set[str]] = {}
    lists = [(GRAPH_GROUPS[name], ops) for name, ops in recorded.ops.items()]
    lists += [("generate", ops) for ops in recorded.decode or ()]
    for group, ops in lists:
        for op in ops:
            for buf in (op[2] if op[0] == "dispatch" else op[1:3]):
                out.setdefault(id(buf), set()).add(group)
    return out


def _record_once(dev: LMRecorder, made: dict, decode) -> tuple[dict, list]:
    """Each graph's ops recorded once (each in its group, for what a plan makes as it
    records), and the decode step's at steps 0 and 1."""
    ops = {}
    for name, run in (("train", made["train"].record_step),
                      ("logits", made["logits"].record_forward),
                      ("prefill", made["prefill"].record_forward)):
        dev.ops, dev.phase = [], GRAPH_GROUPS[name]
        run()
        ops[name] = dev.ops
    steps = []
    if decode is not None:   # twice: a step's uniform values may change from step to step
        dev.phase = "generate"
        for _ in range(2):
            dev.ops = []
            decode.record_forward()
            steps.append(dev.ops)
    return ops, steps


class Names:
    """A unique name for each buffer: its own (``lm.x0``), prefixed by its group
    where that is not the model's (``train/lm.x0``), numbered where taken. A buffer
    made for the model is the model's; another, the group of the graphs using it
    (``users``), or "shared" where several groups use it."""

    def __init__(self, dev: LMRecorder, used: dict[int, set[str]]):
        self.dev, self.used, self.of, self.taken = dev, used, {}, set()

    def __call__(self, buf) -> str:
        if buf.released:
            raise ValueError(f"--lm: the recorded steps bind {buf.name!r} after its release")
        if id(buf) not in self.of:
            group = self.group(buf)
            base = buf.name or "buf"
            name = base if group == "model" else f"{group}/{base}"
            k = 1
            while name in self.taken:
                k += 1
                name = f"{base if group == 'model' else f'{group}/{base}'}#{k}"
            self.taken.add(name)
            self.of[id(buf)] = (name, buf)
        return self.of[id(buf)][0]

    def group(self, buf) -> str:
        phase, _ = self.dev.made.get(id(buf), ("model", None))
        groups = self.used.get(id(buf), {phase})
        return phase if phase == "model" else "shared" if len(groups) > 1 else min(groups)


def _uniform_value(value) -> int:
    if isinstance(value, (np.integer, int)) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"--lm: a recorded uniform holds {value!r}; the page writes u32 values")


def graph_steps(ops: list, names: Names, kernels: list, decode: list | None = None) -> list:
    """The page's steps of ``ops`` (web_export.module_steps' form, and for a uniform
    binding [value at step 0, increase per step]: ``decode``, the same ops recorded
    one step later, gives the increase; none, it is 0)."""
    later = decode if decode is not None else ops
    steps = []
    for op, next_op in zip(ops, later, strict=True):
        if op[0] == "copy":
            steps.append({"copy": [names(op[1]), names(op[2]), op[3]]})
            continue
        _, kernel, bufs, grid = op
        if next_op[1] is not kernel or next_op[3] != grid:
            raise ValueError(f"--lm: kernel {kernel.name!r}: the decode step differs between "
                             f"steps beyond its uniforms")
        if kernel not in kernels:
            kernels.append(kernel)
        step: dict = {"kernel": kernels.index(kernel),
                      "grid": list(grid) if isinstance(grid, tuple) else [grid, 1, 1],
                      "buffers": {}}
        for b, buf, later_buf in zip(kernel.bindings, bufs, next_op[2]):
            if b.access == "uniform":
                first = _uniform_value(buf)
                step.setdefault("uniforms", {})[b.name] = [first, _uniform_value(later_buf) - first]
            else:
                step["buffers"][b.name] = names(buf)
        steps.append(step)
    return steps


def weight_list(lm: CausalLM, names: Names) -> list[dict]:
    """Every frozen weight's buffer: the tensor it holds, its first row and rows
    (a chunk of the embedding or head past the binding limit), its dtype."""
    frozen, out = lm.frozen, []

    def add(buf, tensor: str, first: int = 0) -> None:
        rows = buf.shape[0] if len(buf.shape) > 1 else 1
        out.append({"buffer": names(buf), "tensor": tensor, "first": first, "rows": rows,
                    "dtype": buf.dtype.name})

    for first, buf in frozen.embed:
        add(buf, EMBEDDING, first)
    if frozen.head is not frozen.embed:
        for first, buf in frozen.head:
            add(buf, HEAD, first)
    add(frozen.norm, "model.norm.weight")
    for i, norms in enumerate(frozen.layers):
        for norm, buf in norms.items():
            add(buf, f"model.layers.{i}.{norm}.weight")
    for name, (w, bias) in frozen.linears.items():
        add(w, f"{name}.weight")
        if bias is not None:
            add(bias, f"{name}.bias")
    return out


def adapter_list(lm: CausalLM, names: Names) -> dict:
    """Per adapted module (peft's name, in the model's order): where A and B are as
    the kernels read them and as the optimizer keeps them (f32; the same buffers in
    f32), its rank, dims, alpha, rsLoRA and scale."""
    out = {}
    for module, ad in lm.adapted.items():
        layer = ad.layer
        out[module] = {"a": names(ad.weight.a), "b": names(ad.weight.b),
                       "masterA": names(ad.masters[0]), "masterB": names(ad.masters[1]),
                       "rank": ad.rank, "inDim": layer.in_dim, "outDim": layer.out_dim,
                       "alpha": layer.alpha, "useRslora": layer.use_rslora,
                       "scale": float(np.float32(ad.scale))}
    return out


def graph_io(recorded: Recorded, names: Names) -> dict:
    """The buffers the page writes before each graph and reads after it."""
    made, cache = recorded.made, recorded.cache
    train, logits, prefill = made["train"], made["logits"], made["prefill"]
    return {"train": {"ids": names(train.ids), "keep": names(train.keep),
                      "positions": names(train.positions), "labels": names(train.labels),
                      "losses": names(train.losses)},
            "logits": {"ids": names(logits.ids), "keep": names(logits.keep),
                       "positions": names(logits.positions), "logits": names(logits.logits)},
            "generate": {"ids": names(prefill.ids), "positions": names(prefill.positions),
                         "keep": names(cache.keep), "past": names(cache.past),
                         "next": names(cache.positions), "out": names(cache.ids),
                         "offset": names(cache.offset)}}


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


MAX_INIT = 8 << 20  # bytes of first contents the module may embed for one buffer


def buffer_table(dev: LMRecorder, names: Names, skip: set, rope: dict) -> dict:
    """{name: bytes, dtype, group, init}: ``init`` the base64 first contents of a
    buffer the page fills from the module (the optimizer's settings; RoPE's rows
    ``rope`` gives), None for zeros and for ``skip`` (weights and adapters)."""
    out = {}
    for name, buf in list(names.of.values()):
        init = None
        if name in rope:
            init = _b64(buf.array[:rope[name]])
        elif name not in skip:
            first = buf.array  # (a view: a large buffer of zeros is never copied)
            if first.any():
                if first.nbytes > MAX_INIT:
                    raise ValueError(f"--lm: {name} starts with {first.nbytes} bytes of "
                                     f"values; the module embeds at most {MAX_INIT}")
                init = _b64(first)
        out[name] = {"bytes": int(buf.bound_bytes), "dtype": buf.dtype.name,
                     "group": names.group(buf), "init": init}
    return out


def model_facts(config: LMConfig, tied: bool, folder) -> dict:
    """What the page needs of the config (and says in its messages)."""
    c = config
    return {"architecture": c.architecture, "modelType": c.model_type,
            "vocabSize": c.vocab_size, "hiddenSize": c.hidden_size,
            "intermediateSize": c.intermediate_size, "layers": c.num_hidden_layers,
            "heads": c.num_attention_heads, "kvHeads": c.num_key_value_heads,
            "headDim": c.head_dim, "maxPositions": c.max_position_embeddings,
            "tied": tied, "eosTokenIds": list(c.eos_token_ids), "padTokenId": c.pad_token_id,
            "bosTokenId": c.bos_token_id, "folder": str(folder)}


@dataclass
class LMModule:
    """Everything the module holds, as JSON-able data, and its kernels."""

    config: dict
    buffers: dict
    graphs: dict
    kernels: list


def record_module(setup: LMSetup) -> LMModule:
    """The model of ``setup`` recorded: config, buffers, each graph's steps, kernels."""
    lm, dev, weights = build_model(setup)
    recorded = record_graphs(lm, dev, setup.shapes)
    names, kernels = Names(dev, users(recorded)), []
    graphs = {name: graph_steps(ops, names, kernels) for name, ops in recorded.ops.items()}
    if recorded.decode is not None:
        graphs["decode"] = graph_steps(recorded.decode[0], names, kernels, recorded.decode[1])
    weight_rows = weight_list(lm, names)
    adapters = adapter_list(lm, names)
    io = graph_io(recorded, names)
    opt = optimizer_config(lm.optimizer)
    opt["buffer"] = names(lm.optimizer.hyper)
    rope = {names(lm.frozen.cos): setup.shapes.positions,
            names(lm.frozen.sin): setup.shapes.positions}
    skip = {w["buffer"] for w in weight_rows} | {a[k] for a in adapters.values()
                                                for k in ("a", "b", "masterA", "masterB")}
    buffers = buffer_table(dev, names, skip, rope)
    config = {"model": model_facts(weights.config, weights.tied, setup.folder),
              "dtype": setup.dtype, "shapes": {"batch": setup.shapes.batch,
                                               "seq": setup.shapes.seq,
                                               "genBatch": setup.shapes.gen_batch,
                                               "prompt": setup.shapes.prompt,
                                               "newTokens": setup.shapes.new_tokens},
              "tensors": {n: list(s) for n, s in weight_shapes(weights.config).items()},
              "weights": weight_rows, "adapters": adapters,
              "targetModules": lm._peft_targets(), "loraDropout": setup.lora_dropout,
              "seed": setup.seed, "optimizer": opt, "io": io,
              "stepsPerSubmit": STEPS_PER_SUBMIT,
              "limits": {"maxStorageBufferBindingSize":
                         dev.limits["max-storage-buffer-binding-size"],
                         "maxBufferSize": dev.limits["max-buffer-size"]},
              "memory": {g: sum(b["bytes"] for b in buffers.values() if b["group"] == g)
                         for g in GROUPS},
              "features": sorted({f for k in kernels for f in kernel_info(k)["features"]})}
    return LMModule(config, buffers, graphs, kernels)


def module_js(module: LMModule, command: str = "") -> str:
    """The ES module: config, buffers, graphs, kernels, the runtime, loadCausalLM."""
    body = ",\n".join("  " + js_object(kernel_info(k), "  ") for k in module.kernels)
    made = f"`{command}`" if command else "lora.apps.web_lm"
    graphs = "".join(f"  {json.dumps(name)}: [\n" +
                     "".join(f"    {json.dumps(s)},\n" for s in steps) + "  ],\n"
                     for name, steps in module.graphs.items())
    return (f"// lora_lm.js: generated by {made}.\n"
            f"// A {module.config['model']['architecture']} with LoRA: weights streamed from "
            f"safetensors, logits, greedy generation with a KV cache and training steps on "
            f"GPUBuffers; standard WebGPU only. See docs/browser.md.\n\n"
            f"export const config = {json.dumps(module.config)};\n"
            f"export const buffers = {json.dumps(module.buffers)};\n"
            f"export const graphs = {{\n{graphs}}};\n"
            f"export const kernels = [\n{body},\n];\n\n"
            f"{module_code('optim.mjs', 'lm.mjs')}")


def module_dts(command: str = "") -> str:
    made = f"`{command}`" if command else "lora.apps.web_lm"
    return f"// lora_lm.d.ts: generated by {made}.\n{module_types('lm.d.ts')}"


def demo_page(module: LMModule, command: str = "", steps: int = 200) -> str:
    """The page (web_assets/lm_demo.html and lm_demo.mjs): the module and lora_adapter.js
    inlined; it loads the model's files the user picks (or ``?model=URL&text=URL``),
    fine-tunes on the text's bytes for ``steps`` steps, plots the loss, samples before and
    after and offers the adapter."""
    page = {"steps": steps, "lr": module.config["optimizer"]["values"]["lr"],
            "command": command}
    script = asset("lm_demo.mjs").replace("/*PAGE*/null", json.dumps(page))
    return (asset("lm_demo.html").replace("/*ADAPTER*/", asset("adapter.mjs"))
            .replace("/*LM*/", module_js(module, command)).replace("/*SCRIPT*/", script))
