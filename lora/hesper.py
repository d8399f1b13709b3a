"""The execute functions, as Hesper names them: plans of fixed strategies.

``output += scale * B @ (A @ x)``, in place on a buffer that already holds
the base layer's output, and the backward's results:

- :func:`execute_lora_forward`: strategy ``three`` (project_a, project_b, add_scaled);
- :func:`execute_lora_forward_fused`: strategy ``split`` (project_a, then the
  fused_b_add kernel: Hesper's "fused" fuses project_b with the add);
- :func:`execute_lora_forward_single`: strategy ``single`` (one dispatch);
- :func:`execute_lora_forward_auto`: the autotuned strategy (or a chosen one);
- one kernel each: :func:`execute_project_a`, :func:`execute_project_b`,
  :func:`execute_add_scaled`, :func:`execute_fused_b_add`;
- training: :func:`execute_lora_forward_train`, :func:`execute_lora_backward`,
  and one result each: :func:`execute_grad_b`, :func:`execute_grad_dh`,
  :func:`execute_grad_a`, :func:`execute_grad_input`.

Every function takes one token (``x`` shaped ``(in_dim,)``) or several
(``(tokens, in_dim)``); activations are stored like the weight (float32 or
float16), the scratch buffers h and y and the gradients of A and B are
float32. Everything is checked before the first dispatch, with messages
naming the arguments as spelled here, so a call that raises has recorded
nothing. The checked plan is cached on the weight (lora.core.cache) per
combination of buffers: a repeated call is a lookup and its dispatches.
``projection`` is project_a's choice: "workgroup" (a workgroup per token) or
Hesper's "seed" (a thread per element of h).
"""
from __future__ import annotations

import numpy as np

from shaderdsl import checks as host
from shaderdsl.errors import BindingError

from .core import checks as C
from .core.auto import auto_plan
from .core.cache import get_or_build, ids
from .core.forward import forward_plan
from .core.plan import Plan, Role
from .core.strategy import Single, Split, Three
from .core.tuning import runtime_bucket
from .core.weight import Weight, weight_on, wgsl_dtype
from .training.backward import ONE_RESULT, backward_plan, train_forward_plan

ACTIVATION = "; activations are stored like the weight"


def _run(owner, key: tuple, buffers: dict, build) -> None:
    """Record the cached plan of ``key`` (checking the call on first sight)."""
    plan = get_or_build(owner, key + ids(*buffers.values()), build, buffers.values())
    plan.record(**buffers)


def _tokens(device, weight, buf, what: str, dim: str = "in_dim"):
    """The checked weight, and the token count of ``buf`` (rows of ``dim``;
    stored like the weight, or float32 for rows of rank)."""
    C.device_of(device)
    w = weight_on(device, weight)
    like = dim != "rank"
    buf = C.storage(device, buf, what, w.dtype if like else C.F32, ACTIVATION if like else "")
    return w, C.tokens_of(buf, getattr(w, dim), what, dim)


def _kernel_plan(device, name: str, params: dict, roles: dict, bound: dict, tokens=1) -> Plan:
    return Plan(device, name, [(name, params)], roles, bound=bound, tokens=tokens)


# ---------------------------------------------------------------- one kernel

def execute_project_a(device, weight, x_buf, h_buf, *, projection: str = "workgroup",
                      threads: int = 256, subgroups: bool = False) -> None:
    """``h = A @ x`` for every token (one dispatch). ``projection="workgroup"``:
    a workgroup of ``threads`` per token sums strided slices of in_dim and
    reduces (in workgroup memory, or with ``subgroupAdd`` when ``subgroups``);
    ``"seed"``: Hesper's design, a thread per element of h."""
    def build():
        w, tokens = _tokens(device, weight, x_buf, "x_buf")
        p = C.projection_value(projection)
        sg = C.subgroups_value(device, subgroups, p)
        th = C.threads_value(device, threads, sg) if p == "workgroup" else 64
        C.shaped(C.storage(device, h_buf, "h_buf"), tokens, w.rank, "h_buf", "rank")
        host.distinct(("x_buf", x_buf, False), ("h_buf", h_buf, True), ("weight.a", w.a, False))
        kernel = Three(th, p, sg).kernels(w.layer_shape(tokens))[0]
        return Plan(device, kernel[0], [kernel], _roles(w, "x", "h"), bound={"A": w.a},
                    tokens=tokens)

    _run(weight, ("a", projection, threads, subgroups), {"x": x_buf, "h": h_buf}, build)


def _roles(w, *names) -> dict:
    """Roles of checked buffers (the plan's own check is not needed again)."""
    dims = {"x": (w.in_dim, w.dtype), "h": (w.rank, C.F32), "y": (w.out_dim, C.F32),
            "output": (w.out_dim, w.dtype)}
    return {n: Role(n, np.dtype(dims[n][1]), (dims[n][0],), writes=n in ("h", "y", "output"))
            for n in names}


def execute_project_b(device, weight, h_buf, y_buf, *, threads: int = 256) -> None:
    """``y = B @ h`` for every token (one dispatch; one thread per element of y)."""
    def build():
        w, tokens = _tokens(device, weight, h_buf, "h_buf", "rank")
        th = C.threads_value(device, threads)
        C.shaped(C.storage(device, y_buf, "y_buf"), tokens, w.out_dim, "y_buf", "out_dim")
        host.distinct(("h_buf", h_buf, False), ("y_buf", y_buf, True), ("weight.b", w.b, False))
        return _kernel_plan(device, "project_b", dict(out_dim=w.out_dim, rank=w.rank,
                                                      tokens=tokens, threads=th,
                                                      dtype=wgsl_dtype(w.dtype)),
                            _roles(w, "h", "y"), {"B": w.b}, tokens)

    _run(weight, ("b", threads), {"h": h_buf, "y": y_buf}, build)


def execute_add_scaled(device, y_buf, output_buf, num_elements: int | None = None,
                       scale: float = 1.0, *, threads: int = 256) -> None:
    """``output[i] += scale * y[i]`` for the first ``num_elements`` elements
    (both buffers read flat; default: all of ``output_buf``). One dispatch.
    ``y`` is float32; ``output`` float32 or float16."""
    def build():
        C.device_of(device)
        y = C.storage(device, y_buf, "y_buf")
        dtype = C.storage_dtype_of(output_buf)
        C.check_f16(device, dtype, "output_buf")
        out = C.storage(device, output_buf, "output_buf", dtype, "; float32 or float16")
        n = out.size if num_elements is None else C.count(num_elements, "num_elements")
        C.holds(n, ("y_buf", y), ("output_buf", out))
        host.distinct(("y_buf", y, False), ("output_buf", out, True))
        roles = {"y": Role("y_buf", C.F32, (y.size,), per_token=False),
                 "output": Role("output_buf", dtype, (out.size,), per_token=False, writes=True)}
        return _kernel_plan(device, "add_scaled", dict(
            num_elements=n, scale=C.scale_value(scale), threads=C.threads_value(device, threads),
            dtype=wgsl_dtype(dtype)), roles, {})

    _run(device, ("add", num_elements, scale, threads), {"y": y_buf, "output": output_buf},
         build)


def execute_fused_b_add(device, weight, scale, h_buf, output_buf, *, threads: int = 256) -> None:
    """``output += scale * B @ h`` for every token: project_b and add_scaled in one dispatch."""
    def build():
        w, tokens = _tokens(device, weight, h_buf, "h_buf", "rank")
        s, th = C.scale_value(scale), C.threads_value(device, threads)
        out = C.storage(device, output_buf, "output_buf", w.dtype, ACTIVATION)
        C.shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        host.distinct(("h_buf", h_buf, False), ("output_buf", out, True), ("weight.b", w.b, False))
        kernel = Split(th).kernels(w.layer_shape(tokens, s))[1]
        return Plan(device, kernel[0], [kernel], _roles(w, "h", "output"), bound={"B": w.b},
                    tokens=tokens)

    _run(weight, ("fb", scale, threads), {"h": h_buf, "output": output_buf}, build)


# ---------------------------------------------------------------- whole forwards

def _forward(device, weight, scale, input_buf, output_buf, scratch: dict, key, make_strategy):
    """Check a forward's arguments (scratch: role -> buffer the caller gives)
    and record its cached plan of a fixed strategy."""
    def build():
        w, tokens = _tokens(device, weight, input_buf, "input_buf")
        s = C.scale_value(scale)
        strategy = make_strategy()
        out = C.storage(device, output_buf, "output_buf", w.dtype, ACTIVATION)
        C.shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        uses = [("input_buf", input_buf, False), ("output_buf", out, True)]
        dims = {"h": (w.rank, "rank"), "y": (w.out_dim, "out_dim")}
        for role, buf in scratch.items():
            (dim, dim_name), what = dims[role], f"{role}_buf"
            C.shaped(C.storage(device, buf, what), tokens, dim, what, dim_name)
            uses.append((what, buf, True))
        host.distinct(*uses, ("weight.a", w.a, False), ("weight.b", w.b, False))
        if runtime_bucket(device, w, tokens):  # kernels shared by every token count
            return forward_plan(device, w, s, None, strategy, given=tuple(scratch),
                                max_tokens=tokens)
        return forward_plan(device, w, s, tokens, strategy, given=tuple(scratch))

    _run(weight, key, {"x": input_buf, "output": output_buf, **scratch}, build)


def _projected(device, cls, projection, threads, subgroups):
    """The Strategy of a Hesper-mirror forward, from its keyword arguments."""
    def make():
        p = C.projection_value(projection)
        sg = C.subgroups_value(device, subgroups, p)
        return cls(C.threads_value(device, threads, sg), projection=p, subgroups=sg)
    return make


def execute_lora_forward(device, weight, scale, input_buf, output_buf, h_buf, y_buf, *,
                         projection: str = "workgroup", threads: int = 256,
                         subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in three dispatches, as Hesper does:
    ``h = A @ x`` (project_a), ``y = B @ h`` (project_b), ``output += scale * y``
    (add_scaled). ``h_buf`` and ``y_buf`` are scratch buffers the call overwrites."""
    _forward(device, weight, scale, input_buf, output_buf, {"h": h_buf, "y": y_buf},
             ("3", scale, projection, threads, subgroups),
             _projected(device, Three, projection, threads, subgroups))


def execute_lora_forward_fused(device, weight, scale, input_buf, output_buf, h_buf, *,
                               projection: str = "workgroup", threads: int = 256,
                               subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in two dispatches: project_a, then
    fused_b_add (no ``y`` buffer, one pass over the output): strategy ``split``."""
    _forward(device, weight, scale, input_buf, output_buf, {"h": h_buf},
             ("2", scale, projection, threads, subgroups),
             _projected(device, Split, projection, threads, subgroups))


def execute_lora_forward_single(device, weight, scale, input_buf, output_buf, *,
                                threads: int = 256, outputs_per_thread: int = 1,
                                subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in one dispatch (strategy ``single``):
    each workgroup recomputes ``h`` for its token, then updates
    ``threads * outputs_per_thread`` outputs. No scratch buffers."""
    def make():
        sg = C.subgroups_value(device, subgroups)
        th = C.threads_value(device, threads, sg)
        return Single(th, C.count(outputs_per_thread, "outputs_per_thread"), subgroups=sg)
    _forward(device, weight, scale, input_buf, output_buf, {},
             ("1", scale, threads, outputs_per_thread, subgroups), make)


def execute_lora_forward_auto(device, weight, scale, input_buf, output_buf, *,
                              strategy=None) -> None:
    """``output += scale * B @ (A @ input)`` with the fastest strategy for this
    shape on this device (lora.core.tuning; measured once, cached on disk), or
    the one forced by ``strategy`` (e.g. ``"tiled(tile_tokens=8)"``) or
    ``$LORA_STRATEGY``: the plan of :func:`lora.core.auto.auto_plan`, which
    checks the buffers on every call (the arguments once per token count)."""
    def build():
        w, tokens = _tokens(device, weight, input_buf, "input_buf")
        out = C.storage(device, output_buf, "output_buf", w.dtype, ACTIVATION)
        C.shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        host.distinct(("input_buf", input_buf, False), ("output_buf", out, True),
                      ("weight.a", w.a, False), ("weight.b", w.b, False))  # before tuning
        return auto_plan(device, w, C.scale_value(scale), tokens, strategy)

    tokens = getattr(input_buf, "size", 0) // max(1, getattr(weight, "in_dim", 1))
    if isinstance(weight, Weight) and tokens:  # one entry per bucket of counts, as auto_plan's
        tokens = runtime_bucket(device, weight, tokens) or tokens
    plan = get_or_build(weight, ("hesper auto", scale, tokens, str(strategy)), build,
                        (getattr(weight, "a", None), getattr(weight, "b", None)))
    plan(input_buf, output_buf)


def save_activation(device, src_buf, dst_buf, num_elements: int | None = None) -> None:
    """Copy the first ``num_elements`` values of ``src_buf`` into ``dst_buf``
    (default: all of ``src_buf``; both float32 or both float16): keeps the input
    activation for a later backward pass (which needs x to form dB and dA). A
    GPU-side copy, recorded into the open batch if there is one."""
    C.device_of(device)
    dtype = C.storage_dtype_of(src_buf)
    src = C.storage(device, src_buf, "src_buf", dtype, "; float32 or float16")
    dst = C.storage(device, dst_buf, "dst_buf", dtype, "; like src_buf")
    n = src.size if num_elements is None else C.count(num_elements, "num_elements")
    C.holds(n, ("src_buf", src), ("dst_buf", dst))
    host.distinct(("src_buf", src, False), ("dst_buf", dst, True))
    nbytes = n * dtype.itemsize
    if nbytes % 4:  # WebGPU copies whole 4-byte words
        if n != dst.size:
            raise BindingError(f"num_elements: {n} float16 values are {nbytes} bytes; "
                               f"WebGPU copies multiples of 4 bytes, so copy an even count "
                               f"(or all of dst_buf, {dst.size} values)")
        nbytes += 2  # the last word's other half is dst's padding
    device.copy(src, dst, nbytes)


# ---------------------------------------------------------------- training

def execute_lora_forward_train(device, weight, scale, input_buf, output_buf, h_buf, *,
                               strategy=None) -> None:
    """``output += scale * B @ (A @ input)`` that also leaves h = A @ input in
    ``h_buf`` (float32 [tokens, rank]) for the backward: the forward of a
    training step. ``strategy``: a forward strategy or its text (default:
    ``single`` for one token, ``tiled`` beyond)."""
    def build():
        w, tokens = _tokens(device, weight, input_buf, "input_buf")
        C.shaped(C.storage(device, h_buf, "h_buf"), tokens, w.rank, "h_buf", "rank")
        plan = train_forward_plan(device, w, C.scale_value(scale), tokens, strategy)
        plan.check(input_buf, output_buf, h=h_buf)
        return plan

    _run(weight, ("forward_train", scale, str(strategy)),
         {"x": input_buf, "output": output_buf, "h": h_buf}, build)


def execute_lora_backward(device, weight, scale, grad_out_buf, x_buf, h_buf, grad_a_buf,
                          grad_b_buf, grad_x_buf=None, *, accumulate=False, strategy=None) -> None:
    """dB, dA (and dx when ``grad_x_buf`` is given) from the upstream gradient,
    the forward's input x and its saved h = A x (execute_lora_forward_train
    leaves it). ``strategy``: a lora.Backward or its text (default:
    lora.Backward.for_shape's, gemm or split). Everything is checked first."""
    buffers = {"g": grad_out_buf, "x": x_buf, "h": h_buf, "dA": grad_a_buf, "dB": grad_b_buf}
    if grad_x_buf is not None:
        buffers["dx"] = grad_x_buf

    def build():
        w, tokens = _tokens(device, weight, grad_out_buf, "grad_out_buf", "out_dim")
        plan = backward_plan(device, w, C.scale_value(scale), tokens, strategy,
                             accumulate=accumulate, with_dx=grad_x_buf is not None)
        plan.check(**buffers)
        return plan

    _run(weight, ("backward", scale, str(strategy), bool(accumulate)), buffers, build)


def _one(device, weight, scale, grad: str, buffers: dict, accumulate, strategy) -> None:
    """Check and run the dispatches of one result of the backward (and, for a
    chunked dA or dB, their sum)."""
    def build():
        first = ONE_RESULT[grad][0]  # g or dh
        what = "grad_out_buf" if first == "g" else "dh_buf"
        w, tokens = _tokens(device, weight, buffers[first], what,
                            "out_dim" if first == "g" else "rank")
        plan = backward_plan(device, w, C.scale_value(scale), tokens, strategy,
                             accumulate=accumulate, only=grad)
        plan.check(**buffers)
        return plan

    _run(weight, ("one", grad, scale, str(strategy), bool(accumulate)), buffers, build)


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
