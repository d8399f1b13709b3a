"""Our side of ``python -m lora bench --lm`` (lora.apps.bench_lm): a lora.CausalLM
with LoRA on every Linear but the head, made from the transformers model theirs runs
(``from_transformers``) or, where torch is not installed, from random weights of the
same shapes (numpy alone); its training step timed by wall clock (steps recorded and
submitted one by one, then the loss read) and by GPU timestamps (tuning.median_us),
and lm.generate's prefill and decode step by GPU timestamps; where the GPU time goes;
and the device memory (lm.memory(), and a generate's graphs and KV cache).

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

from ..core.tuning import median_us
from ..models.causal_lm import CausalLM
from ..models.config import LMConfig, weight_shapes
from ..models.generate import Generation, prepared
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
    return {"loss": loss, "ms": float(np.median(times)) * 1e3, "gpu_ms": gpu_us / 1e3,
            **shares(lm.device, graph.forwards + graph.backwards, gpu_us, steps, repeats)}


def generate_gpu(lm: CausalLM, prompt: np.ndarray, room: int, n: int, repeats: int) -> dict:
    """lm.generate's prefill over ``prompt`` and one of its decode steps (the graphs
    lm.generate keeps for this shape, with a KV cache of ``room`` tokens past the
    prompt): GPU milliseconds and the groups' shares of each; and ``bytes``: what a
    generate of this shape holds (the weights, the adapters, the two graphs and the
    cache)."""
    gen = cache_graphs(lm, prompt, room)
    cache, prefill, step = gen.cache, gen.prefill, gen.step()
    dev, (batch, length) = lm.device, prompt.shape

    def record_prefill():
        dev.write(cache.past, np.zeros(1, np.uint32))
        prefill.record_forward()

    def record_step():  # the writes land before the batch runs; each step advances past
        dev.write(cache.past, np.array([length], np.uint32))
        dev.write(cache.positions, np.full(batch, length, np.uint32))
        step.record_forward()
    out: dict = {}
    for what, graph, record, most in (("prefill", prefill, record_prefill, 1000),
                                      ("decode", step, record_step, room - 1)):
        us = median_us(dev, record, min(n, most), repeats, most=most)
        out[what] = {"gpu_ms": us / 1e3, **shares(dev, graph.forwards, us, n, repeats)}
    parts = lm.memory()
    out["bytes"] = parts["weights"] + parts["adapters"] + gen.nbytes()
    return out


def cache_graphs(lm: CausalLM, prompt: np.ndarray, room: int) -> Generation:
    """What lm.generate keeps for ``prompt`` (unpadded) with ``room`` new tokens
    (lora.models.generate.Generation: the cache, the prefill graph and the decode
    step's), the prompt's ids, positions, the cache's mask and offset written."""
    batch, length = prompt.shape
    gen = prepared(lm, batch, length, room)
    cache, dev = gen.cache, lm.device
    dev.write(cache.keep, np.ones(batch * cache.length, np.uint32))
    dev.write(cache.offset, np.zeros(1, np.uint32))
    dev.write(gen.prefill.ids, prompt.reshape(-1).astype(np.uint32))
    dev.write(gen.prefill.positions, np.tile(np.arange(length, dtype=np.uint32), batch))
    return gen


def shares(device, steps: list, total_us: float, n: int, repeats: int) -> dict:
    """Each group's share of ``total_us``: the plans of ``steps`` ((plan, arguments)
    of a graph) whose every dispatch is a kernel of the group, recorded alone and
    timed as the whole was; "rest" the remainder."""
    out, left = {}, total_us
    for group, prefix in GROUPS.items():
        us = _alone_us(device, [plan for plan, args in steps if not args and _kernel_names(plan)
                                and all(k.startswith(prefix) for k in _kernel_names(plan))],
                       n, repeats)
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


def generator(lm: CausalLM):
    """``generate(prompt, n)``: lm.generate's greedy tokens, int64 [batch, prompt + n]."""
    return lambda prompt, n: np.asarray(lm.generate(prompt, n))


def memory(lm: CausalLM) -> dict:
    """``bytes``: the sum of lm.memory()'s parts; ``memory``: the parts."""
    parts = lm.memory()
    return {"bytes": sum(parts.values()), "memory": parts}
