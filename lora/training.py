"""Training a LoRA layer on the GPU: the backward plan, the execute functions
that mirror Hesper's (gradB, gradDh, gradA, inputGrad), numpy-facing
``backward``, and a training step that stays on the GPU.

With s the scale, h = A x saved by the forward and g = dL/d(out):
dh = s g B, dB = s g^T h, dA = dh^T x, dx = dh A (see lora.kernels.backward).
Gradients are float32; x, g and dx are stored like the weight. Each gradient
is overwritten, or accumulated with ``accumulate=True`` (micro-batches).
"""
from __future__ import annotations

import numpy as np

from shaderdsl import checks as host
from shaderdsl.errors import BindingError
from shaderdsl.runtime import get_device

from . import checks as C
from .plan import Plan, build_steps, record_steps
from .strategy import Backward, Strategy
from .weight import Weight, wgsl_dtype


def _backward_of(strategy, tokens: int, rank: int, device) -> Backward:
    if strategy is None:
        return Backward.for_shape(tokens, rank, device.has_feature("subgroup"))
    return strategy if isinstance(strategy, Backward) else Backward.parse(strategy)


class BackwardPlan:
    """One backward for fixed shapes: kernels, grids and scratch (dh and the
    partial sums of dA and dB), resolved and checked once; ``record`` is only
    dispatches. ``with_dx=False`` skips the input gradient (a first layer)."""

    def __init__(self, device, weight, scale: float, tokens: int, strategy=None, *,
                 accumulate: bool = False, with_dx: bool = True):
        C.check_f16(device, weight.dtype, "BackwardPlan")
        self.device, self.tokens, self.scale = device, tokens, float(scale)
        self.strategy = _backward_of(strategy, tokens, weight.rank, device)
        self.a, self.b, self.dtype = weight.a, weight.b, weight.dtype
        r, i, o = weight.rank, weight.in_dim, weight.out_dim
        self.shapes = {"x": (tokens, i), "g": (tokens, o), "h": (tokens, r), "dA": (r, i),
                       "dB": (o, r), "dx": (tokens, i)}
        scratch = self.strategy.scratch(tokens, r, i, o)
        item = self.dtype.itemsize
        sizes = {"A": self.a.bound_bytes, "B": self.b.bound_bytes, "x": tokens * i * item,
                 "g": tokens * o * item, "dx": tokens * i * item, "h": 4 * tokens * r,
                 "dA": 4 * r * i, "dB": 4 * o * r,
                 **{k: 4 * int(np.prod(s)) for k, s in scratch.items()}}
        self.steps = build_steps(device, self.strategy.kernels(
            r, i, o, self.scale, tokens, wgsl_dtype(self.dtype), accumulate, with_dx), sizes)
        self.scratch = {k: device.empty(s, np.float32, name=f"lora_{k}") for k, s in scratch.items()}
        self.with_dx = with_dx

    @property
    def dh(self):
        return self.scratch["dh"]

    def __repr__(self) -> str:
        return (f"<BackwardPlan {self.strategy} rank={self.shapes['h'][1]} in={self.shapes['x'][1]}"
                f" out={self.shapes['g'][1]} tokens={self.tokens} {self.dtype.name}>")

    def check(self, g, x, h, grad_a, grad_b, grad_x=None) -> None:
        """Every buffer: live, on this device, its dtype and shape; no aliasing."""
        one = self.tokens == 1
        uses = []
        for what, role, buf, dtype, writes in (
                ("grad_out_buf", "g", g, self.dtype, False), ("x_buf", "x", x, self.dtype, False),
                ("h_buf", "h", h, np.float32, False), ("grad_a_buf", "dA", grad_a, np.float32, True),
                ("grad_b_buf", "dB", grad_b, np.float32, True),
                *((("grad_x_buf", "dx", grad_x, self.dtype, True),) if self.with_dx else ())):
            C.storage(self.device, buf, what, dtype)
            shape = self.shapes[role]
            if buf.shape != shape and not (one and role in ("x", "g", "h", "dx")
                                           and buf.shape == shape[1:]):
                raise BindingError(f"{self!r}: {what} must be {np.dtype(dtype).name} {shape}, got "
                                   f"{buf.dtype.name} {buf.shape}")
            uses.append((what, buf, writes))
        host.distinct(*uses, ("weight.a", self.a, False), ("weight.b", self.b, False))

    def record(self, g, x, h, grad_a, grad_b, grad_x=None) -> None:
        buffers = {"A": self.a, "B": self.b, "g": g, "x": x, "h": h, "dA": grad_a, "dB": grad_b,
                   "dx": grad_x, **self.scratch}
        record_steps(self.device, self.steps, buffers)

    def __call__(self, g, x, h, grad_a, grad_b, grad_x=None) -> None:
        self.check(g, x, h, grad_a, grad_b, grad_x)
        self.record(g, x, h, grad_a, grad_b, grad_x)


# ---------------------------------------------------------------- Hesper's names

def _plan(device, weight, scale, grad_out_buf, strategy, accumulate, with_dx):
    """The weight's cached backward plan for this token count."""
    C.device_of(device)
    w = C.weight_on(device, weight)
    s = C.scale_value(scale)
    g = C.storage(device, grad_out_buf, "grad_out_buf", w.dtype,
                  "; activations are stored like the weight")
    tokens = C.tokens_of(g, w.out_dim, "grad_out_buf", "out_dim")
    key = ("backward", s, tokens, str(strategy), bool(accumulate), bool(with_dx))
    plan = w.plans.get(key)
    if plan is None:
        plan = w.plans[key] = BackwardPlan(device, w, s, tokens, strategy, accumulate=accumulate,
                                           with_dx=with_dx)
    return plan


def execute_lora_backward(device, weight, scale, grad_out_buf, x_buf, h_buf, grad_a_buf,
                          grad_b_buf, grad_x_buf=None, *, accumulate=False, strategy=None) -> None:
    """dB, dA (and dx when ``grad_x_buf`` is given) from the upstream gradient,
    the forward's input x and its saved h = A x (lora.execute_lora_forward_train
    leaves it). ``strategy``: a lora.strategy.Backward or its text (default:
    fused for a few tokens, split beyond). Everything is checked first."""
    plan = _plan(device, weight, scale, grad_out_buf, strategy, accumulate, grad_x_buf is not None)
    plan(grad_out_buf, x_buf, h_buf, grad_a_buf, grad_b_buf, grad_x_buf)


_GRAD_BUFFERS = {  # role -> (argument name, leading dims of its shape, stored like the weight)
    "g": ("grad_out_buf", "out_dim", True), "h": ("h_buf", "rank", False),
    "dh": ("dh_buf", "rank", False), "x": ("x_buf", "in_dim", True),
    "dx": ("grad_x_buf", "in_dim", True), "dA": ("grad_a_buf", None, False),
    "dB": ("grad_b_buf", None, False)}


def _check_one(device, w, buffers: dict) -> int:
    """Check the buffers of one backward kernel; returns the token count."""
    tokens = None
    for role, buf in buffers.items():
        what, dim_key, like_weight = _GRAD_BUFFERS[role]
        C.storage(device, buf, what, w.dtype if like_weight else np.float32)
        if dim_key is None:
            shape = (w.rank, w.in_dim) if role == "dA" else (w.out_dim, w.rank)
            if buf.shape != shape:
                raise BindingError(f"{what}: expected shape {shape}, got {list(buf.shape)} ({buf!r})")
        elif tokens is None:
            tokens = C.tokens_of(buf, getattr(w, dim_key), what, dim_key)
        else:
            C.shaped(buf, tokens, getattr(w, dim_key), what, dim_key)
    host.distinct(*((_GRAD_BUFFERS[r][0], b, r in ("dh", "dx", "dA", "dB"))
                    for r, b in buffers.items()),
                  ("weight.a", w.a, False), ("weight.b", w.b, False))
    return tokens


def _one(device, weight, scale, grad: str, buffers: dict, accumulate, strategy) -> None:
    """Check and run the dispatches of one result of the backward (and, for a
    chunked dA or dB, their sum)."""
    C.device_of(device)
    w = C.weight_on(device, weight)
    s = C.scale_value(scale)
    tokens = _check_one(device, w, buffers)
    plan = _backward_of(strategy, tokens, w.rank, device)
    kernels = plan.kernels_of(grad, w.rank, w.in_dim, w.out_dim, s, tokens, wgsl_dtype(w.dtype),
                              accumulate)
    scratch = {k: device.empty(shape, np.float32) for k, shape in
               plan.scratch(tokens, w.rank, w.in_dim, w.out_dim).items() if k != "dh"}
    everything = {"A": w.a, "B": w.b, **buffers, **scratch}
    steps = build_steps(device, kernels, {k: b.bound_bytes for k, b in everything.items()})
    record_steps(device, steps, everything)


def execute_grad_b(device, weight, scale, grad_out_buf, h_buf, grad_b_buf, *, accumulate=False,
                   strategy="split") -> None:
    """dB = s g^T h (Hesper's gradB; ``strategy="seed"`` runs its design)."""
    _one(device, weight, scale, "dB", {"g": grad_out_buf, "h": h_buf, "dB": grad_b_buf},
         accumulate, strategy)


def execute_grad_dh(device, weight, scale, grad_out_buf, dh_buf, *, strategy="split") -> None:
    """dh = s g B (Hesper's gradDh; ``strategy="seed"`` runs its design)."""
    _one(device, weight, scale, "dh", {"g": grad_out_buf, "dh": dh_buf}, False, strategy)


def execute_grad_a(device, weight, dh_buf, x_buf, grad_a_buf, *, accumulate=False,
                   strategy="split") -> None:
    """dA = dh^T x (Hesper's gradA; ``strategy="seed"`` runs its design)."""
    _one(device, weight, 1.0, "dA", {"dh": dh_buf, "x": x_buf, "dA": grad_a_buf}, accumulate,
         strategy)


def execute_grad_input(device, weight, dh_buf, grad_x_buf, *, accumulate=False,
                       strategy="split") -> None:
    """dx = dh A (Hesper's inputGrad; ``strategy="seed"`` runs its design)."""
    _one(device, weight, 1.0, "dx", {"dh": dh_buf, "dx": grad_x_buf}, accumulate, strategy)


def execute_lora_forward_train(device, weight, scale, input_buf, output_buf, h_buf, *,
                               strategy=None) -> None:
    """``output += scale * B @ (A @ input)`` that also leaves h = A @ input in
    ``h_buf`` (float32 [tokens, rank]) for the backward: the forward of a
    training step. ``strategy``: a forward strategy text (default: ``fused``
    for one token, ``tiled`` beyond)."""
    C.device_of(device)
    w = C.weight_on(device, weight)
    x = C.storage(device, input_buf, "input_buf", w.dtype, "; activations are stored like the weight")
    tokens = C.tokens_of(x, w.in_dim, "input_buf", "in_dim")
    C.storage(device, h_buf, "h_buf")
    C.shaped(h_buf, tokens, w.rank, "h_buf", "rank")
    s = Strategy.parse(strategy) if isinstance(strategy, str) else strategy or \
        (Strategy("fused") if tokens == 1 else Strategy("tiled", 256, tile_tokens=8))
    key = ("forward_train", C.scale_value(scale), tokens, str(s))
    plan = w.plans.get(key)
    if plan is None:
        plan = w.plans[key] = Plan(device, w, scale, tokens, s, save_h=True)
    plan.check(input_buf, output_buf)
    host.distinct(("input_buf", x, False), ("output_buf", output_buf, True),
                  ("h_buf", h_buf, True))
    plan.record(input_buf, output_buf, h=h_buf)


# ---------------------------------------------------------------- numpy in, numpy out

def backward(x, a, b, grad_out, *, alpha: float | None = None, scale: float | None = None,
             device=None, strategy=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grad_x, grad_a, grad_b) of ``out = base + scale * B @ (A @ x)`` for the
    upstream gradient ``grad_out``, on the GPU in float32; numpy in and out.
    Shapes as lora.forward: x ``(in_dim,)`` or ``(tokens, in_dim)``, grad_out
    like the output. ``scale`` if given, else ``alpha / rank``, else 1."""
    from .execute import _host_problem, _scale_of

    xs, am, bm, gs = _host_problem(x, a, b, grad_out, np.float32)
    s = _scale_of(alpha, scale, am.shape[0])
    dev = get_device() if device is None else C.device_of(device)
    weight = Weight.from_numpy(dev, am, bm)
    tokens = 1 if xs.ndim == 1 else xs.shape[0]
    bufs = {"x": dev.buffer(xs), "g": dev.buffer(gs), "h": dev.empty((tokens, am.shape[0]), np.float32),
            "dA": dev.empty(am.shape, np.float32), "dB": dev.empty(bm.shape, np.float32),
            "dx": dev.empty(xs.shape, np.float32), "out": dev.empty(gs.shape, np.float32)}
    try:
        execute_lora_forward_train(dev, weight, s, bufs["x"], bufs["out"], bufs["h"])
        execute_lora_backward(dev, weight, s, bufs["g"], bufs["x"], bufs["h"], bufs["dA"],
                              bufs["dB"], bufs["dx"], strategy=strategy)
        return dev.read(bufs["dx"]).copy(), dev.read(bufs["dA"]).copy(), dev.read(bufs["dB"]).copy()
    finally:
        for buf in (*bufs.values(), weight.a, weight.b):
            dev.release(buf)
        weight.plans.clear()


# ---------------------------------------------------------------- a training step on the GPU

LOSSES = ("mse", "xent")


class LayerTrainer:
    """Trains one adapted layer: each step is the forward (saving h), the loss
    and its gradient, the backward and the optimizer step, recorded into one
    submit; the loss is read back only when asked for (:meth:`loss`).

    ``loss``: "mse" against a target of the output's shape, or "xent":
    softmax cross-entropy of the outputs as logits against u32 labels
    [tokens]. ``optimizer``: a lora.AdamW or lora.SGD, attached here to the
    weight's A and B. The output buffer holds the frozen base layer's output
    when a step starts and the adapted output afterwards.
    """

    def __init__(self, device, weight, scale: float, tokens: int, optimizer, *, loss="mse",
                 forward=None, backward=None):
        if loss not in LOSSES:
            raise ValueError(f"loss: expected one of {LOSSES}, got {loss!r}")
        if weight.dtype != np.float32:
            raise BindingError("LayerTrainer: training needs a float32 weight (the optimizer "
                               "updates A and B in place)")
        self.device, self.tokens, self.kind = device, tokens, loss
        fwd = Strategy.parse(forward) if isinstance(forward, str) else forward or \
            (Strategy("fused") if tokens == 1 else Strategy("tiled", 256, tile_tokens=8))
        self.forward = Plan(device, weight, scale, tokens, fwd, save_h=True)
        self.backward = BackwardPlan(device, weight, scale, tokens, backward, with_dx=False)
        self.grad_a = device.empty(weight.a.shape, np.float32, name="lora.dA")
        self.grad_b = device.empty(weight.b.shape, np.float32, name="lora.dB")
        self.g = device.empty((tokens, weight.out_dim), np.float32, name="lora.g")
        n = tokens * weight.out_dim
        kernel = ("mse", dict(n=n)) if loss == "mse" else \
            ("softmax_xent", dict(classes=weight.out_dim, tokens=tokens, threads=64))
        self.partial = device.empty(-(-n // 256) if loss == "mse" else tokens, np.float32)
        self._loss_role = "partial" if loss == "mse" else "losses"
        self._n = n
        sizes = {"out": 4 * n, "logits": 4 * n, "g": 4 * n, "want": 4 * n, "labels": 4 * tokens,
                 self._loss_role: self.partial.bound_bytes}
        self.loss_steps = build_steps(device, [kernel], sizes)
        self.optimizer = optimizer
        optimizer.attach(device, [(weight.a, self.grad_a), (weight.b, self.grad_b)])
        self._copy = None  # (steps or None, bytes) of the base copy

    def record(self, x_buf, out_buf, target_buf, base_buf=None) -> None:
        """One training step on a batch: x [tokens, in], out [tokens, out] (the
        base output on entry, or copied in from ``base_buf`` first, in the same
        submit), target [tokens, out] (mse) or labels u32 [tokens] (xent)."""
        dev = self.device
        with dev.batch():
            if base_buf is not None:
                self._copy_base(base_buf, out_buf)
            self.forward.record(x_buf, out_buf)
            names = {"out": out_buf, "want": target_buf} if self.kind == "mse" else \
                {"logits": out_buf, "labels": target_buf}
            record_steps(dev, self.loss_steps, {**names, "g": self.g,
                                                self._loss_role: self.partial})
            self.backward.record(self.g, x_buf, self.forward.h, self.grad_a, self.grad_b)
            self.optimizer.record()

    def _copy_base(self, base_buf, out_buf) -> None:
        """base -> out with a copy kernel (on the H200 copy_buffer_to_buffer moved
        84 MB in 101 us, a vec4 kernel in about 25)."""
        if base_buf.shape != out_buf.shape or base_buf.dtype != out_buf.dtype:
            raise BindingError(f"base_buf must be like output_buf ({out_buf.dtype.name} "
                               f"{out_buf.shape}), got {base_buf.dtype.name} {base_buf.shape}")
        if self._copy is None or self._copy[1] != base_buf.nbytes:
            n4 = -(-base_buf.nbytes // 16)
            sizes = {"src": base_buf.bound_bytes, "dst": out_buf.bound_bytes}
            if base_buf.nbytes % 16:
                self._copy = (None, base_buf.nbytes)
            else:
                self._copy = (build_steps(self.device, [("copy", dict(n4=n4))], sizes),
                              base_buf.nbytes)
        steps, _ = self._copy
        if steps is None:
            self.device.copy(base_buf, out_buf)
        else:
            record_steps(self.device, steps, {"src": base_buf, "dst": out_buf})

    def loss(self) -> float:
        """The last step's loss (reads back a small buffer: waits for the GPU)."""
        values = self.device.read(self.partial).astype(np.float64)
        return float(values.sum() / self._n if self.kind == "mse" else values.mean())
