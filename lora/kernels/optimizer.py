"""Optimizers as GPU kernels: AdamW and SGD with momentum, global-norm clipping,
learning-rate schedules, with the step count kept on the GPU.

Two small buffers carry everything that changes between steps, so nothing is
recompiled and a whole training loop can be recorded without a host write:

- ``hyper`` (f32[HYPER_SIZE], written by the host when a setting changes):
  HYPER's slots: lr, beta1 (AdamW) or momentum (SGD: the same slot), beta2, eps,
  weight_decay, max_norm (0: no clipping), warmup, total, min_ratio, grad_scale
  (the factor undoing a loss scale: every gradient is read times it);
- ``state`` (f32[STATE_SIZE], written by ``optim_begin`` every step): STATE's
  slots: step, lr (this step's, after the schedule), bias1 = 1 - beta1^step,
  bias2_sqrt = sqrt(1 - beta2^step), clip (the factor on every gradient),
  norm (the gradients' global norm before clipping, when clipping), bias2.

f32 needs care in two places. ``1 - beta^t`` cancels (1 - 0.999 keeps 4
digits), and WGSL's ``pow`` and ``cos`` may be off by 2^-11 (the spec's
bound), so the bias corrections follow the recurrence
``c_t = beta c_(t-1) + (1 - beta)`` (exact to a few ulp) and the cosine
schedule uses a Taylor polynomial, exact in f32.

A step is ``optim_begin`` (one workgroup) then ``adamw_update`` or
``sgd_update`` (one thread per parameter, up to two parameter tensors, the
A and B of one LoRA layer, per dispatch). Clipping first sums the gradients'
squares in ``norm_partials``: one workgroup per NORM_CHUNK values of each
gradient (up to MAX_PARTIAL_TENSORS gradients per dispatch), so the norm
reads the gradients at the whole GPU's bandwidth rather than one
workgroup's, into a small buffer that ``optim_begin`` then adds up. The
update follows torch.optim.AdamW's order of operations exactly (see
lora.reference.adamw_step).
"""
from __future__ import annotations

import math

from shaderdsl import builtins as B
from shaderdsl import f32

from .common import check_threads, reduce_sum

HYPER = {"lr": 0, "beta1": 1, "momentum": 1, "beta2": 2, "eps": 3, "weight_decay": 4,
         "max_norm": 5, "warmup": 6, "total": 7, "min_ratio": 8, "grad_scale": 9}
HYPER_SIZE = 12
STATE = {"step": 0, "lr": 1, "bias1": 2, "bias2_sqrt": 3, "clip": 4, "norm": 5, "bias2": 6}
STATE_SIZE = 8
SCHEDULES = ("constant", "linear", "cosine")  # linear: warm-up, then constant
MAX_UPDATE_TENSORS = 2  # p and g of each, moments, state, hyper: 7 storage bindings (WebGPU's 8)
MAX_PARTIAL_TENSORS = 7  # gradients, partials: 8 storage bindings
NORM_CHUNK = 4096  # gradient values per norm_partials workgroup (256 threads x 16)


def _half_cosine(m, progress):
    """(1 + cos(pi p)) / 2 = cos(pi p / 2)^2 for p in [0, 1], by the Taylor
    series of cos on [0, pi/2] to x^16 (error under 1e-10)."""
    x2 = m.let((0.5 * math.pi * progress) * (0.5 * math.pi * progress), "x2")
    c = m.var(f32, 1.0, "c")
    for k in range(8, 0, -1):  # Horner: 1 - x2/2 (1 - x2/12 (1 - ...))
        m.assign(c, 1.0 - c * x2 / ((2 * k - 1) * (2 * k)))
    return c * c


def _schedule_lr(m, hp, step, schedule):
    """This step's learning rate (lora.reference.learning_rate, in f32)."""
    lr, warmup = hp["lr"], hp["warmup"]
    rate = m.var(f32, lr, "rate")
    if schedule == "cosine":
        span = m.let(B.max(hp["total"] - warmup, 1.0), "span")
        progress = m.let(B.clamp((step - warmup) / span, 0.0, 1.0), "progress")
        low = hp["min_ratio"]
        m.assign(rate, lr * (low + (1.0 - low) * _half_cosine(m, progress)))
    with m.if_((warmup > 0.0) & (step <= warmup)):
        m.assign(rate, lr * step / warmup)
    return rate


def optim_begin(m, partials=0, schedule="constant", threads=256):
    """Advance the step and write this step's lr, bias corrections and clip
    factor to ``state`` (one workgroup). With ``partials`` (a count) it also
    adds that many sums of squares of ``norm_partials``: the gradients'
    squared global norm, for clipping."""
    check_threads(threads)
    state, hyper = state_buffers(m)
    tid = m.local_index()
    total = None
    if partials:
        sums = m.declare_input_buffer("partials", f32, partials)
        acc = m.var(f32, 0.0, "acc")
        with m.loop(tid, partials, threads, name="i") as i:
            acc += sums[i]
        (total,) = reduce_sum(m, [acc], threads, False)
    with m.if_(tid == 0):
        advance(m, state, hyper, schedule, total)


def norm_workgroups(grad_sizes, chunk=NORM_CHUNK) -> list:
    """Workgroups (and partial sums) norm_partials gives each gradient."""
    return [-(-n // chunk) for n in grad_sizes]


def norm_partials(m, grad_sizes, first=0, slots=None, chunk=NORM_CHUNK, threads=256):
    """Sums of squares of gradients g0, g1, ..., ``chunk`` values per workgroup
    (norm_workgroups), into ``partials[first + workgroup]`` of ``slots`` (the
    partials of every gradient of the step, default this dispatch's): the
    global norm at the GPU's bandwidth, in dispatches of up to
    MAX_PARTIAL_TENSORS gradients."""
    check_threads(threads)
    counts = norm_workgroups(grad_sizes, chunk)
    slots = first + sum(counts) if slots is None else slots
    if not 1 <= len(grad_sizes) <= MAX_PARTIAL_TENSORS or first + sum(counts) > slots:
        raise ValueError(f"norm_partials: 1 to {MAX_PARTIAL_TENSORS} gradients whose "
                         f"{sum(counts)} partials fit slots {first}.. of {slots}, got "
                         f"{len(grad_sizes)} gradients")
    grads = [m.declare_input_buffer(f"g{k}", f32, n) for k, n in enumerate(grad_sizes)]
    partials = m.declare_output_buffer("partials", f32, slots)
    tid, group = m.local_index(), m.let(m.workgroup_id().x, "group")
    acc = m.var(f32, 0.0, "acc")
    start = 0
    for g, n, count in zip(grads, grad_sizes, counts):
        with m.if_((group >= start) & (group < start + count)) if start else m.if_(group < count):
            begin = m.let((group - start) * chunk, "begin")
            with m.loop(begin + tid, B.min(begin + chunk, n), threads, name="i") as i:
                acc += g[i] * g[i]
        start += count
    (total,) = reduce_sum(m, [acc], threads, False)
    with m.if_(tid == 0):
        partials[first + group] = total


def advance(m, state, hyper, schedule, norm_squared=None) -> None:
    """One thread's work of a step's begin: the step count, this step's lr, the
    bias corrections and the factor on every gradient: grad_scale (undoing a
    loss scale), times the clip factor with ``norm_squared`` (the gradients'
    squared global norm, as stored: grad_scale times it is the norm clipped).
    Without clipping it needs no gradient, so another kernel of the step may
    run it (LayerTrainer's loss does)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    hp = {k: m.let(hyper[v], k) for k, v in HYPER.items()}
    step = m.let(state[STATE["step"]] + 1.0, "step")
    state[STATE["step"]] = step
    state[STATE["lr"]] = _schedule_lr(m, hp, step, schedule)
    bias1 = m.let(hp["beta1"] * state[STATE["bias1"]] + (1.0 - hp["beta1"]), "bias1")
    bias2 = m.let(hp["beta2"] * state[STATE["bias2"]] + (1.0 - hp["beta2"]), "bias2")
    state[STATE["bias1"]] = bias1
    state[STATE["bias2"]] = bias2
    state[STATE["bias2_sqrt"]] = B.sqrt(bias2)
    clip = m.var(f32, 1.0, "clip")
    if norm_squared is not None:
        norm = m.let(B.sqrt(norm_squared) * hp["grad_scale"], "norm")
        state[STATE["norm"]] = norm
        with m.if_(hp["max_norm"] > 0.0):
            m.assign(clip, B.min(1.0, hp["max_norm"] / (norm + 1e-6)))
    state[STATE["clip"]] = clip * hp["grad_scale"]


def state_buffers(m):
    """The optimizer's ``state`` (written) and ``hyper`` (read) buffers."""
    return (m.declare_output_buffer("state", f32, STATE_SIZE),
            m.declare_input_buffer("hyper", f32, HYPER_SIZE))


def _tensors(m, sizes):
    if not 1 <= len(sizes) <= MAX_UPDATE_TENSORS:
        raise ValueError(f"1 to {MAX_UPDATE_TENSORS} parameter tensors per update, got "
                         f"{len(sizes)}")
    return [(m.declare_output_buffer(f"p{k}", f32, n), m.declare_input_buffer(f"g{k}", f32, n))
            for k, n in enumerate(sizes)]


def _for_each_element(m, sizes, body):
    """body(p, g, j, k): one thread per element of all tensors in turn (j in
    tensor p, k overall), each guarded to its own range."""
    tensors = _tensors(m, sizes)
    state = m.declare_input_buffer("state", f32, STATE_SIZE)
    hyper = m.declare_input_buffer("hyper", f32, HYPER_SIZE)
    k = m.let(m.global_id().x, "k")
    start = 0
    for (p, g), n in zip(tensors, sizes):
        with m.if_((k >= start) & (k < start + n)) if start else m.if_(k < n):
            body(p, g, m.let(k - start, "j") if start else k, k, state, hyper)
        start += n


def adamw_update(m, sizes):
    """One AdamW step for every element of the parameter tensors p0 (and p1),
    with moments m, v in ``moments`` ([m for all | v for all])."""
    total = sum(sizes)
    moments = m.declare_output_buffer("moments", f32, 2 * total)

    def update(p, g, j, k, state, hyper):
        lr = m.let(state[STATE["lr"]], "lr")
        b1, b2 = m.let(hyper[HYPER["beta1"]], "b1"), m.let(hyper[HYPER["beta2"]], "b2")
        grad = m.let(g[j] * state[STATE["clip"]], "grad")
        param = m.let(p[j] * (1.0 - lr * hyper[HYPER["weight_decay"]]), "decayed")
        mk = m.let(b1 * moments[k] + (1.0 - b1) * grad, "m")
        vk = m.let(b2 * moments[total + k] + (1.0 - b2) * (grad * grad), "v")
        moments[k] = mk
        moments[total + k] = vk
        denom = m.let(B.sqrt(vk) / state[STATE["bias2_sqrt"]] + hyper[HYPER["eps"]], "denom")
        p[j] = param - (lr / state[STATE["bias1"]]) * mk / denom

    _for_each_element(m, sizes, update)


def sgd_update(m, sizes):
    """One SGD step (torch.optim.SGD, dampening 0, no Nesterov): g += wd p;
    buf = g on the first step, else momentum buf + g; p -= lr buf."""
    total = sum(sizes)
    buf = m.declare_output_buffer("momentum_buf", f32, total)

    def update(p, g, j, k, state, hyper):
        grad = m.let(g[j] * state[STATE["clip"]] + hyper[HYPER["weight_decay"]] * p[j], "grad")
        first = m.let(state[STATE["step"]] <= 1.0, "first")
        b = m.let(B.select(hyper[HYPER["momentum"]] * buf[k] + grad, grad, first), "b")
        buf[k] = b
        p[j] = p[j] - state[STATE["lr"]] * b

    _for_each_element(m, sizes, update)
