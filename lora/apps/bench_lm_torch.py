"""transformers + peft's side of ``python -m lora bench --lm`` (lora.apps.bench_lm), in
the same process as ours: the random-weights model built from a config dict with
transformers' config classes and ``AutoModelForCausalLM.from_config`` (SDPA attention,
no download), LoRA on it by ``peft.get_peft_model``, its training step (eager or
``torch.compile``'d, fp16 autocast for the f16 rows, torch's AdamW, no GradScaler) timed
with CUDA events, and a greedy ``generate`` for lora.apps.bench_lm to time.

torch, transformers and peft are optional: ``modules()`` says how to install what is
missing, and the bench prints our rows without theirs."""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import statistics
import time
from types import SimpleNamespace

import numpy as np

from .bench_train import _cuda_us

INSTALL = ("pip install torch transformers peft (the CUDA build of torch for a GPU: "
           "https://pytorch.org/get-started/locally/)")
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}
LR = 1e-4
WARM_UP_STEPS = 3


def modules():
    """torch, transformers and peft as a namespace, or a line saying which are missing
    and how to install them."""
    found, missing = {}, []
    for name in ("torch", "transformers", "peft"):
        try:
            found[name] = importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        return f"{', '.join(missing)} not installed: {INSTALL}"
    return SimpleNamespace(**found)


def device_for(mods, quick: bool) -> str:
    """Where theirs runs: "cuda", or "cpu" for a --quick run; ValueError (the reason)
    for a full run without CUDA (its shapes would take hours on the CPU)."""
    if mods.torch.cuda.is_available():
        return "cuda"
    if quick:
        return "cpu"
    raise ValueError(f"torch {mods.torch.__version__} without CUDA: the full shapes are "
                     f"not run on the CPU (--quick runs tiny ones there)")


def versions(mods) -> dict:
    return {name: getattr(mods, name).__version__ for name in ("torch", "transformers", "peft")}


def base_model(mods, config: dict, device: str, seed: int = 0):
    """A random float32 causal LM of ``config`` (a config.json's dict with its
    model_type) on ``device``, SDPA attention, greedy generation with no end token
    (so that every row generates as many tokens as asked)."""
    torch = mods.torch
    cls = getattr(mods.transformers, CONFIG_CLASSES[config["model_type"]])
    cfg = cls(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = mods.transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def with_lora(mods, base, rank: int, half: bool):
    """A copy of ``base`` (fp16 where ``half``) with LoRA of ``rank`` (alpha = rank)
    on every Linear but the head, as peft makes it (B = 0; the adapters in float32)."""
    model = copy.deepcopy(base)
    if half:
        model = model.half()
    config = mods.peft.LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear",
                                  lora_dropout=0.0)
    return mods.peft.get_peft_model(model, config)


def why_no_compile(mods, device: str) -> str | None:
    """Why torch.compile's step is not timed here, or None where it is."""
    if device != "cuda":
        return "not on the CPU (a --quick run)"
    if importlib.util.find_spec("triton") is None:
        return f"torch {mods.torch.__version__} without triton (torch.compile's GPU kernels)"
    return None


def train_step(mods, model, ids: np.ndarray, half: bool, compiled: bool):
    """One training step of ``model`` (a PeftModel) on ``ids`` as a function returning
    the loss tensor: the forward (fp16 autocast where ``half``; ``compiled``: by
    torch.compile), the loss against the ids (shifted inside, as ours), its backward,
    torch's AdamW over the adapters, the gradients zeroed."""
    torch = mods.torch
    dev = next(model.parameters()).device
    x = torch.tensor(ids, device=dev)
    if compiled:
        torch._dynamo.reset()  # a fresh cache: a shared one recompiles up to its limit
    forward = torch.compile(model, dynamic=False) if compiled else model
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR)

    def step():
        with torch.autocast(dev.type, dtype=torch.float16, enabled=half):
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss
    return step


def train_times(mods, model, ids: np.ndarray, half: bool, compiled: bool, steps: int,
                repeats: int) -> dict:
    """Milliseconds per step (median of ``repeats`` runs of ``steps`` steps, after
    WARM_UP_STEPS untimed ones, in which torch.compile compiles), the first step's
    loss, the seconds the warm-up took, and the peak memory of the timed steps."""
    torch = mods.torch
    cuda = next(model.parameters()).device.type == "cuda"
    t0 = time.perf_counter()
    step = train_step(mods, model, ids, half, compiled)
    loss = float(step().item())
    for _ in range(WARM_UP_STEPS - 1):
        step()
    _sync(torch, cuda)
    warm_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        ms = _cuda_us(torch, lambda: [step() for _ in range(steps)], steps, repeats) / 1e3
    else:
        ms = _wall_s(lambda: [step() for _ in range(steps)], repeats) / steps * 1e3
    out = {"ms": ms, "loss": loss, "warm_up_s": warm_s}
    if cuda:
        out["bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def generator(mods, model, adapter: bool = True):
    """``generate(prompt, n) -> int64 [batch, prompt + n]``: ``model``'s greedy
    ``generate`` (eager, its own KV cache), with the adapters or without
    (``adapter=False``: peft's ``disable_adapter``, transformers' model alone), waited for."""
    torch = mods.torch
    dev = next(model.parameters()).device

    def generate(prompt: np.ndarray, n: int) -> np.ndarray:
        x = torch.tensor(prompt, device=dev)
        off = contextlib.nullcontext() if adapter else model.disable_adapter()
        with torch.no_grad(), off:
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 do_sample=False, max_new_tokens=n, min_new_tokens=n)
        _sync(torch, dev.type == "cuda")
        return out.cpu().numpy()
    return generate


def peak_bytes(mods, device: str, fn) -> int | None:
    """torch.cuda.max_memory_allocated over ``fn()`` (None on the CPU)."""
    torch = mods.torch
    if device != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def release(mods, device: str) -> None:
    """Give the CUDA caching allocator's free blocks back (between models)."""
    if device == "cuda":
        mods.torch.cuda.empty_cache()


def _sync(torch, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _wall_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
