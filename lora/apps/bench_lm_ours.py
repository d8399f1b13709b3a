"""Our side of ``python -m lora bench --lm`` (lora.apps.bench_lm): a lora.CausalLM
with LoRA on every Linear but the head, made from the transformers model theirs runs
(``from_transformers``) or, where torch is not installed, from random weights of the
same shapes (numpy alone); its training step timed by wall clock (steps recorded and
submitted one by one, then the loss read) and by GPU timestamps (tuning.median_us);
where its GPU time goes; and the device memory its buffers take.

Where the time goes: WebGPU's timestamps bracket passes, not dispatches, so the step's
dispatches are timed by group, each group recorded alone in timed batches: the frozen
base products (kernels ``dense*``: every Linear's x W^T and its input gradient, the LM
head), attention (``attention*``: the forward and its three backward kernels), and the
rest (everything else: LoRA, norms, RoPE, SwiGLU, the residual stream, the embedding,
the loss, the optimizer) as the step's time less those two.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from shaderdsl.devicebuffer import DeviceBuffer
from shaderdsl.hostdevice import HostDevice

from ..core.tuning import median_us
from ..models.causal_lm import CausalLM
from ..models.config import LMConfig, weight_shapes
from ..models.weights import LMWeights
from ..training.optim import AdamW
from .bench_lm_torch import LR

GROUPS = {"base": "dense", "attention": "attention"}  # group -> kernel name prefix


def random_weights(config: dict, dtype, seed: int = 0) -> LMWeights:
    """Weights of ``config``'s shapes as transformers initialises a model from a config
    (norms 1, biases 0, the rest normal with sd 0.02), made with numpy when read."""
    cfg = LMConfig.from_dict(config, source="bench --lm config")

    def reader(name: str, shape: tuple, k: int):
        def read() -> np.ndarray:
            if name.endswith("norm.weight"):
                return np.ones(shape, dtype)
            if name.endswith(".bias"):
                return np.zeros(shape, dtype)
            rng = np.random.default_rng(seed + k)
            return (0.02 * rng.standard_normal(shape, np.float32)).astype(dtype)
        return read
    readers = {name: reader(name, shape, k)
               for k, (name, shape) in enumerate(weight_shapes(cfg).items())}
    return LMWeights(cfg, readers, dtype, "random weights (numpy)")


def build(config: dict, torch_model, dtype, rank: int, device=None) -> CausalLM:
    """Ours with LoRA of ``rank`` (alpha = rank) on "all-linear" and AdamW: from
    ``torch_model`` (transformers') where given, else from random weights."""
    options: dict[str, Any] = dict(target_modules="all-linear", rank=rank, alpha=rank,
                                   dtype=dtype, optimizer=AdamW(lr=LR), device=device)
    if torch_model is not None:
        return CausalLM.from_transformers(torch_model, **options)
    return CausalLM(random_weights(config, dtype), **options)


def train_times(lm: CausalLM, ids: np.ndarray, steps: int, repeats: int) -> dict:
    """The first step's loss, then milliseconds per step: ``ms`` by wall clock
    (``steps`` calls of lm.step, each its own submit, then lm.loss() waits; median of
    ``repeats``), ``gpu_ms`` by GPU timestamps (median_us), and the groups' shares."""
    lm.step(ids)
    loss = lm.loss()  # builds the graph and compiles its kernels: not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            lm.step(ids)
        lm.loss()
        times.append((time.perf_counter() - t0) / steps)
    gpu_us = median_us(lm.device, lambda: lm.step(ids), steps, repeats)
    graph = training_graph(lm)
    plans = [plan for plan, _ in graph.forwards + graph.backwards]
    return {"loss": loss, "ms": float(np.median(times)) * 1e3, "gpu_ms": gpu_us / 1e3,
            **shares(lm.device, plans, gpu_us, steps, repeats)}


def prefill_gpu(lm: CausalLM, prompt: np.ndarray, steps: int, repeats: int) -> dict:
    """GPU milliseconds of the forward over ``prompt`` (lm.logits's graph: every
    position's logits, nothing read back) and the groups' shares of it."""
    lm.logits(prompt)  # builds the graph and writes the ids
    graph = inference_graph(lm, *prompt.shape)
    gpu_us = median_us(lm.device, graph.record_forward, steps, repeats)
    plans = [plan for plan, _ in graph.forwards]
    return {"gpu_ms": gpu_us / 1e3, **shares(lm.device, plans, gpu_us, steps, repeats)}


def shares(device, plans: list, total_us: float, n: int, repeats: int) -> dict:
    """Each group's share of ``total_us``: its plans (those whose every dispatch is a
    kernel of the group) recorded alone, timed as the whole was; "rest" the remainder."""
    out, left = {}, total_us
    for group, prefix in GROUPS.items():
        us = _alone_us(device, [p for p in plans if _kernel_names(p) and all(
            name.startswith(prefix) for name in _kernel_names(p))], n, repeats)
        out[f"{group}_share"] = us / total_us
        left -= us
    out["rest_share"] = left / total_us
    return out


def _alone_us(device, plans: list, n: int, repeats: int) -> float:
    """GPU microseconds of ``plans`` (each bound, recorded with no arguments) alone."""
    def record():
        for plan in plans:
            plan.record()
    return median_us(device, record, n, repeats) if plans else 0.0


def _kernel_names(plan) -> list[str]:
    return [step.kernel.name for step in getattr(plan, "steps", ())]


def training_graph(lm: CausalLM):
    """The graph lm.step records (lora.models.graph.Graph; made by the first step)."""
    if lm._train is None:
        raise RuntimeError("no training graph: call lm.step first")
    return lm._train


def inference_graph(lm: CausalLM, batch: int, seq: int):
    """The graph lm.logits records for [batch, seq] ids."""
    return lm._inference_graph(batch, seq)


def generator(lm: CausalLM):
    """``generate(prompt, n)``: lm.generate's greedy tokens, int64 [batch, prompt + n];
    AttributeError where this build of lora has no lm.generate."""
    generate = getattr(lm, "generate", None)
    if generate is None:
        raise AttributeError("no lora.CausalLM.generate in this build of lora")
    return lambda prompt, n: np.asarray(generate(prompt, n))


def buffer_bytes(lm: CausalLM) -> int:
    """Bytes of the distinct live GPU buffers reachable from ``lm``: its weights,
    adapters, optimizer state and the graphs of the shapes it has run (the uniform
    ring and the device's own staging buffers are not counted)."""
    seen: set[int] = set()
    total, todo = 0, [lm]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, DeviceBuffer):
            total += 0 if obj.released else obj.nbytes
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj).__module__.startswith("lora.") and not isinstance(obj, HostDevice):
            todo.extend(_fields(obj))
    return total


def _fields(obj) -> list:
    """The values of an object's attributes (its __dict__ and its __slots__)."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        values += [getattr(obj, s) for s in getattr(cls, "__slots__", ()) if hasattr(obj, s)]
    return values


def memory(lm: CausalLM) -> dict:
    """``bytes`` (buffer_bytes) and, where this build has it, what lm.memory() says."""
    out: dict = {"bytes": buffer_bytes(lm)}
    said = getattr(lm, "memory", None)
    if callable(said):
        out["lm_memory"] = said()  # as it comes (the JSON writes what it cannot hold as str)
    return out
