"""The execute functions: LoRA kernels dispatched on a Device.

``output += scale * B @ (A @ x)``, in place on a buffer that already holds
the base layer's output. Three ways to run it:

- :func:`execute_lora_forward`: project_a, project_b, add_scaled (3 dispatches);
- :func:`execute_lora_forward_fused`: project_a, fused_b_add (2 dispatches);
- :func:`execute_lora_forward_single`: fused_forward (1 dispatch).

Every function takes one token (``x`` shaped ``(in_dim,)``) or several
(``(tokens, in_dim)``); ``h`` is then ``(rank,)``/``(tokens, rank)`` and
``y``/``output`` ``(out_dim,)``/``(tokens, out_dim)``. The activations ``x``
and ``output`` are stored like the weight (float32, or float16 for a weight
made with ``dtype=np.float16``); the scratch buffers ``h`` and ``y`` are
always float32. Sums are f32 in every case.

Everything is checked before the first dispatch (types, device, dtype, exact
shapes, aliasing, grid limits, features; the kernels are compiled too), so a
call that raises has recorded nothing and left every buffer as it was. The
result of those checks is cached per combination of weight, buffers and
parameters: a repeated call is a dict lookup and its dispatches. Calls made
inside ``with device.batch():`` are recorded into that batch; outside one,
the dispatches of a multi-dispatch forward still go out in a single submit.
"""
from __future__ import annotations

import math
import numbers
import os

import numpy as np

from shaderdsl.errors import AliasingError, BindingError, DispatchError, FeatureError
from shaderdsl.runtime import Buffer, get_device
from shaderdsl import checks

from . import kernels as K
from . import tuning
from .plan import Plan
from .weight import Weight, check_f16, host_matrix, storage_dtype, wgsl_dtype

STRATEGIES = ("workgroup", "seed")
PATHS = ("auto", "three", "fused", "single")

_F32 = np.dtype(np.float32)
_PLANS: dict = {}       # key (names + buffer ids + params) -> tuple of steps
_PLAN_LIMIT = 1024      # forget everything past this many combinations


# ---------------------------------------------------------------- checks

def _device(device):
    if device is None or not hasattr(device, "dispatch"):
        raise TypeError(f"device: expected a shaderdsl Device (shaderdsl.runtime.get_device()), "
                        f"got {type(device).__name__}")
    return device


def _buffer(device, buf, what: str, dtype=_F32, why: str = "") -> Buffer:
    """A live storage Buffer of ``dtype`` on ``device``."""
    return checks.live_buffer(buf, device, what, "storage", dtype, why)


def _storage_of(buf) -> np.dtype:
    """float16 for a float16 buffer, else float32: the dtype a check then expects."""
    return np.dtype(np.float16) if getattr(buf, "dtype", None) == np.float16 else _F32


def _activation(device, buf, what: str, weight: Weight) -> Buffer:
    """x or output: stored like the weight."""
    return _buffer(device, buf, what, weight.dtype, "; activations are stored like the weight")


def _weight(device, weight) -> Weight:
    if not isinstance(weight, Weight):
        raise BindingError(f"weight: expected a lora.Weight (Weight.from_numpy or Weight.init), "
                           f"got {type(weight).__name__}")
    if weight.device is not device:
        raise BindingError(f"weight: {weight!r} lives on another device than {device!r}")
    for what, buf in (("weight.a", weight.a), ("weight.b", weight.b)):
        if buf.released:
            raise BindingError(f"{what}: {buf!r} was released")
    return weight


def _tokens(buf, dim: int, what: str, dim_name: str) -> int:
    """Token count of an activation: shape ``(dim,)`` is one token, ``(T, dim)`` T tokens."""
    shape = buf.shape
    if shape == (dim,):
        return 1
    if len(shape) == 2 and shape[1] == dim and shape[0] >= 1:
        return shape[0]
    raise BindingError(f"{what}: expected shape ({dim_name},) = ({dim},) or (tokens, {dim}), "
                       f"got {list(shape)} ({buf!r})")


def _shaped(buf, tokens: int, dim: int, what: str, dim_name: str) -> None:
    """``buf`` is exactly ``(tokens, dim)`` (or ``(dim,)`` for one token)."""
    shape = buf.shape
    if shape == (tokens, dim) or (tokens == 1 and shape == (dim,)):
        return
    want = f"({dim},) or (1, {dim})" if tokens == 1 else f"({tokens}, {dim})"
    raise BindingError(f"{what}: expected shape {want} for {tokens} token(s) of {dim_name} = "
                       f"{dim}, got {list(shape)} ({buf!r})")


def _hold(n: int, *named) -> None:
    """Each (what, buffer) holds at least ``n`` elements."""
    for what, buf in named:
        if buf.size < n:
            raise BindingError(f"{what}: num_elements = {n} but the buffer holds only "
                               f"{buf.size} elements ({buf!r})")


def _distinct(*uses) -> None:
    """``uses``: (what, buffer, writes). No buffer may appear twice where one use writes it."""
    seen: dict = {}
    for what, buf, writes in uses:
        prev = seen.get(buf.id)
        if prev is None:
            seen[buf.id] = (what, writes)
            continue
        if writes or prev[1]:
            raise AliasingError(f"{prev[0]} and {what} are the same buffer {buf!r}; the LoRA "
                                f"forward needs a separate buffer for each (one of them is "
                                f"written). Allocate another with device.empty(...)")


def _scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number, got {type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or not abs(s) <= float(np.finfo(np.float32).max):
        raise ValueError(f"scale: expected a finite float32 value, got {scale!r}")
    return s


def _int(value, what: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{what}: expected an int >= {low}, got {value!r}")
    return int(value)


def _threads(device, threads, subgroups: bool = False) -> int:
    t = _int(threads, "threads")
    if t & (t - 1):
        raise ValueError(f"threads: expected a power of two (the kernels reduce by halving), "
                         f"got {t}")
    cap = device.limits.get("max-compute-invocations-per-workgroup")
    if cap is not None and t > cap:
        raise DispatchError(f"threads: {t} is over max-compute-invocations-per-workgroup = {cap} "
                            f"on {device.name!r}")
    if subgroups and t < 4:
        raise ValueError(f"threads: the subgroup reduction needs threads >= 4, got {t}")
    return t


def _subgroups(device, subgroups, strategy: str = "workgroup") -> bool:
    if not isinstance(subgroups, (bool, np.bool_)):
        raise TypeError(f"subgroups: expected True or False, got {subgroups!r}")
    if subgroups and strategy != "workgroup":
        raise ValueError(f"subgroups=True applies to strategy='workgroup' only, got "
                         f"strategy={strategy!r}")
    if subgroups and not device.has_feature("subgroup"):
        raise FeatureError(f"subgroups=True needs the 'subgroup' feature, which {device.name!r} "
                           f"({device.backend}) lacks; call with subgroups=False")
    return bool(subgroups)


def _strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    return strategy


def _step(device, kernel, grid):
    """(kernel, binding names in order, grid) after checking grid, memory and compiling."""
    grid = checks.workgroups(kernel, grid, device.limits["max-compute-workgroups-per-dimension"])
    if grid[1:] == (1, 1):
        grid = grid[0]  # an int takes the runtime's fastest path
    device.prepare(kernel)  # features, workgroup size and memory, WGSL: all before any dispatch
    return kernel, tuple(b.name for b in kernel.bindings), grid


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


# ---------------------------------------------------------------- steps per kernel

def _project_a_step(device, w, tokens, strategy, threads, subgroups):
    dt = wgsl_dtype(w.dtype)
    if strategy == "seed":
        k = K.project_a_kernel(w.rank, w.in_dim, tokens, strategy="seed", dtype=dt)
        return _step(device, k, (_ceil(w.rank, k.workgroup_size[0]), tokens, 1))
    k = K.project_a_kernel(w.rank, w.in_dim, tokens, threads=threads, subgroups=subgroups,
                           dtype=dt)
    return _step(device, k, (tokens, 1, 1))


def _project_b_step(device, w, tokens, threads):
    k = K.project_b_kernel(w.out_dim, w.rank, tokens, threads, wgsl_dtype(w.dtype))
    return _step(device, k, (_ceil(w.out_dim, threads), tokens, 1))


def _add_scaled_step(device, n, scale, threads, dtype=_F32):
    k = K.add_scaled_kernel(n, scale, threads, wgsl_dtype(dtype))
    return _step(device, k, (_ceil(n, threads), 1, 1))


def _fused_b_add_step(device, w, scale, tokens, threads):
    k = K.fused_b_add_kernel(w.out_dim, w.rank, scale, tokens, threads, wgsl_dtype(w.dtype))
    return _step(device, k, (_ceil(w.out_dim, threads), tokens, 1))


# ---------------------------------------------------------------- running a plan

def _key(parts: tuple, buffers) -> tuple | None:
    try:
        return parts + tuple([b.id for b in buffers])
    except AttributeError:
        return None


def _run(device, key, build, buffers: dict) -> None:
    """Dispatch the cached plan for ``key`` (building and checking it on a miss)."""
    steps = None
    if key is not None:
        try:
            steps = _PLANS.get(key)
        except TypeError:  # an unhashable parameter: let build() explain
            steps = None
    if steps is None:
        steps = build()
        if key is not None:
            if len(_PLANS) >= _PLAN_LIMIT:
                _PLANS.clear()
            _PLANS[key] = steps
    else:
        for buf in buffers.values():
            if buf.wgpu_buffer is None:  # released since the plan was checked
                build()                  # raises the usual message
    dispatch = device.dispatch
    if len(steps) == 1 or device.in_batch:
        for kernel, names, grid in steps:
            dispatch(kernel, [buffers[n] for n in names], grid)
        return
    with device.batch():  # one submit for the whole forward
        for kernel, names, grid in steps:
            dispatch(kernel, [buffers[n] for n in names], grid)


def clear_plan_cache() -> None:
    """Forget every checked combination (kernels stay compiled)."""
    _PLANS.clear()
    _AUTO.clear()


# ---------------------------------------------------------------- execute functions

def execute_project_a(device, weight, x_buf, h_buf, *, strategy: str = "workgroup",
                      threads: int = 256, subgroups: bool = False) -> None:
    """``h = A @ x`` for every token (one dispatch).

    ``strategy="workgroup"``: one workgroup of ``threads`` per token; each
    thread sums a strided slice of in_dim for every rank, then the workgroup
    reduces (in workgroup memory, or with ``subgroupAdd`` when
    ``subgroups=True``). ``strategy="seed"``: Hesper's design, one thread per
    element of h with a serial loop over in_dim.
    """
    key = _key(("a", device, weight.uid if isinstance(weight, Weight) else None, strategy,
                threads, subgroups), (x_buf, h_buf))

    def build():
        _device(device)
        w = _weight(device, weight)
        st = _strategy(strategy)
        sg = _subgroups(device, subgroups, st)
        th = _threads(device, threads, sg) if st == "workgroup" else 64
        x = _activation(device, x_buf, "x_buf", w)
        h = _buffer(device, h_buf, "h_buf")
        tokens = _tokens(x, w.in_dim, "x_buf", "in_dim")
        _shaped(h, tokens, w.rank, "h_buf", "rank")
        _distinct(("x_buf", x, False), ("h_buf", h, True), ("weight.a", w.a, False))
        return (_project_a_step(device, w, tokens, st, th, sg),)

    _run(device, key, build, {"A": getattr(weight, "a", None), "x": x_buf, "h": h_buf})


def execute_project_b(device, weight, h_buf, y_buf, *, threads: int = 256) -> None:
    """``y = B @ h`` for every token (one dispatch; one thread per element of y)."""
    key = _key(("b", device, weight.uid if isinstance(weight, Weight) else None, threads),
               (h_buf, y_buf))

    def build():
        _device(device)
        w = _weight(device, weight)
        th = _threads(device, threads)
        h = _buffer(device, h_buf, "h_buf")
        y = _buffer(device, y_buf, "y_buf")
        tokens = _tokens(h, w.rank, "h_buf", "rank")
        _shaped(y, tokens, w.out_dim, "y_buf", "out_dim")
        _distinct(("h_buf", h, False), ("y_buf", y, True), ("weight.b", w.b, False))
        return (_project_b_step(device, w, tokens, th),)

    _run(device, key, build, {"B": getattr(weight, "b", None), "h": h_buf, "y": y_buf})


def execute_add_scaled(device, y_buf, output_buf, num_elements: int | None = None,
                       scale: float = 1.0, *, threads: int = 256) -> None:
    """``output[i] += scale * y[i]`` for the first ``num_elements`` elements
    (both buffers read flat; default: all of ``output_buf``). One dispatch.
    ``y`` is float32; ``output`` float32 or float16."""
    key = _key(("add", device, num_elements, scale, threads), (y_buf, output_buf))

    def build():
        _device(device)
        y = _buffer(device, y_buf, "y_buf")
        dtype = _storage_of(output_buf)
        check_f16(device, dtype, "output_buf")
        out = _buffer(device, output_buf, "output_buf", dtype, "; float32 or float16")
        n = out.size if num_elements is None else _int(num_elements, "num_elements")
        _hold(n, ("y_buf", y), ("output_buf", out))
        _distinct(("y_buf", y, False), ("output_buf", out, True))
        return (_add_scaled_step(device, n, _scale(scale), _threads(device, threads), dtype),)

    _run(device, key, build, {"y": y_buf, "output": output_buf})


def execute_fused_b_add(device, weight, scale, h_buf, output_buf, *, threads: int = 256) -> None:
    """``output += scale * B @ h`` for every token: project_b and add_scaled in one dispatch."""
    key = _key(("fb", device, weight.uid if isinstance(weight, Weight) else None, scale, threads),
               (h_buf, output_buf))

    def build():
        _device(device)
        w = _weight(device, weight)
        s = _scale(scale)
        th = _threads(device, threads)
        h = _buffer(device, h_buf, "h_buf")
        out = _activation(device, output_buf, "output_buf", w)
        tokens = _tokens(h, w.rank, "h_buf", "rank")
        _shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        _distinct(("h_buf", h, False), ("output_buf", out, True), ("weight.b", w.b, False))
        return (_fused_b_add_step(device, w, s, tokens, th),)

    _run(device, key, build, {"B": getattr(weight, "b", None), "h": h_buf, "output": output_buf})


def _forward_checks(device, weight, scale, input_buf, output_buf, h_buf, y_buf, strategy,
                    threads, subgroups):
    """Shared checks of the multi-dispatch paths; returns (weight, scale, tokens, strategy,
    threads, subgroups)."""
    _device(device)
    w = _weight(device, weight)
    s = _scale(scale)
    st = _strategy(strategy)
    sg = _subgroups(device, subgroups, st)
    th = _threads(device, threads, sg)
    x = _activation(device, input_buf, "input_buf", w)
    out = _activation(device, output_buf, "output_buf", w)
    tokens = _tokens(x, w.in_dim, "input_buf", "in_dim")
    _shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
    uses = [("input_buf", x, False), ("output_buf", out, True)]
    h = _buffer(device, h_buf, "h_buf")
    _shaped(h, tokens, w.rank, "h_buf", "rank")
    uses.append(("h_buf", h, True))
    if y_buf is not None:
        y = _buffer(device, y_buf, "y_buf")
        _shaped(y, tokens, w.out_dim, "y_buf", "out_dim")
        uses.append(("y_buf", y, True))
    _distinct(*uses, ("weight.a", w.a, False), ("weight.b", w.b, False))
    return w, s, tokens, st, th, sg


def execute_lora_forward(device, weight, scale, input_buf, output_buf, h_buf, y_buf, *,
                         strategy: str = "workgroup", threads: int = 256,
                         subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in three dispatches, as Hesper does:
    ``h = A @ x`` (project_a), ``y = B @ h`` (project_b), ``output += scale * y``
    (add_scaled). ``h_buf`` and ``y_buf`` are scratch buffers the call overwrites."""
    key = _key(("3", device, weight.uid if isinstance(weight, Weight) else None, scale, strategy,
                threads, subgroups), (input_buf, output_buf, h_buf, y_buf))

    def build():
        w, s, tokens, st, th, sg = _forward_checks(device, weight, scale, input_buf, output_buf,
                                                   h_buf, y_buf, strategy, threads, subgroups)
        return (_project_a_step(device, w, tokens, st, th, sg),
                _project_b_step(device, w, tokens, th),
                _add_scaled_step(device, tokens * w.out_dim, s, th, w.dtype))

    _run(device, key, build, {"A": getattr(weight, "a", None), "B": getattr(weight, "b", None),
                              "x": input_buf, "h": h_buf, "y": y_buf, "output": output_buf})


def execute_lora_forward_fused(device, weight, scale, input_buf, output_buf, h_buf, *,
                               strategy: str = "workgroup", threads: int = 256,
                               subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in two dispatches: project_a, then
    fused_b_add (no ``y`` buffer, one pass over the output)."""
    key = _key(("2", device, weight.uid if isinstance(weight, Weight) else None, scale, strategy,
                threads, subgroups), (input_buf, output_buf, h_buf))

    def build():
        w, s, tokens, st, th, sg = _forward_checks(device, weight, scale, input_buf, output_buf,
                                                   h_buf, None, strategy, threads, subgroups)
        return (_project_a_step(device, w, tokens, st, th, sg),
                _fused_b_add_step(device, w, s, tokens, th))

    _run(device, key, build, {"A": getattr(weight, "a", None), "B": getattr(weight, "b", None),
                              "x": input_buf, "h": h_buf, "output": output_buf})


def execute_lora_forward_single(device, weight, scale, input_buf, output_buf, *,
                                threads: int = 256, outputs_per_thread: int = 1,
                                subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in one dispatch (fused_forward):
    each workgroup recomputes ``h`` for its token, then updates
    ``threads * outputs_per_thread`` outputs. No scratch buffers."""
    key = _key(("1", device, weight.uid if isinstance(weight, Weight) else None, scale, threads,
                outputs_per_thread, subgroups), (input_buf, output_buf))

    def build():
        _device(device)
        w = _weight(device, weight)
        s = _scale(scale)
        sg = _subgroups(device, subgroups)
        th = _threads(device, threads, sg)
        opt = _int(outputs_per_thread, "outputs_per_thread")
        x = _activation(device, input_buf, "input_buf", w)
        out = _activation(device, output_buf, "output_buf", w)
        tokens = _tokens(x, w.in_dim, "input_buf", "in_dim")
        _shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        _distinct(("input_buf", x, False), ("output_buf", out, True), ("weight.a", w.a, False),
                  ("weight.b", w.b, False))
        k = K.fused_forward_kernel(w.rank, w.in_dim, w.out_dim, s, tokens, th, opt, sg,
                                   dtype=wgsl_dtype(w.dtype))
        return (_step(device, k, (_ceil(w.out_dim, th * opt), tokens, 1)),)

    _run(device, key, build, {"A": getattr(weight, "a", None), "B": getattr(weight, "b", None),
                              "x": input_buf, "output": output_buf})


_AUTO: dict = {}  # (device, weight uid, scale, tokens, strategy) -> Plan


def execute_lora_forward_auto(device, weight, scale, input_buf, output_buf, *,
                              strategy=None) -> None:
    """``output += scale * B @ (A @ input)`` with the fastest strategy for this
    shape on this device (see :mod:`lora.tuning`; measured once, cached on
    disk), or the one forced by ``strategy`` (e.g. ``"tiled:256:8"``) or
    ``$LORA_STRATEGY``. After the first call for a shape, recording costs one
    cache lookup, a shape check and the dispatches: the hot path.
    """
    plan = None
    strategy = strategy or os.environ.get("LORA_STRATEGY") or "auto"
    if isinstance(weight, Weight) and isinstance(input_buf, Buffer):
        tokens = input_buf.size // weight.in_dim if weight.in_dim else 0
        key = (device, weight.uid, scale, tokens, str(strategy))
        plan = _AUTO.get(key)
    if plan is None:
        _device(device)
        w = _weight(device, weight)
        s = _scale(scale)
        x = _activation(device, input_buf, "input_buf", w)
        out = _activation(device, output_buf, "output_buf", w)
        tokens = _tokens(x, w.in_dim, "input_buf", "in_dim")
        _shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        plan = Plan(device, w, s, tokens, tuning.choose(device, w, s, tokens, strategy))
        if len(_AUTO) >= _PLAN_LIMIT:
            _AUTO.clear()
        _AUTO[(device, w.uid, scale, tokens, str(strategy))] = plan
    plan(input_buf, output_buf)


def _forget_weight(uid: int) -> None:
    """Drop the auto plans of a weight that is going away (and their scratch buffers)."""
    for key in [k for k in _AUTO if k[1] == uid]:
        plan = _AUTO.pop(key)
        if plan.h is not None:
            plan.device.release(plan.h)


def save_activation(device, src_buf, dst_buf, num_elements: int | None = None) -> None:
    """Copy the first ``num_elements`` values of ``src_buf`` into ``dst_buf``
    (default: all of ``src_buf``; both float32 or both float16): keeps the input
    activation for a later backward pass (which needs x to form dB and dA). A
    GPU-side copy, recorded into the open batch if there is one."""
    _device(device)
    dtype = _storage_of(src_buf)
    src = _buffer(device, src_buf, "src_buf", dtype, "; float32 or float16")
    dst = _buffer(device, dst_buf, "dst_buf", dtype, "; like src_buf")
    n = src.size if num_elements is None else _int(num_elements, "num_elements")
    _hold(n, ("src_buf", src), ("dst_buf", dst))
    _distinct(("src_buf", src, False), ("dst_buf", dst, True))
    nbytes = n * dtype.itemsize
    if nbytes % 4:  # WebGPU copies whole 4-byte words
        if n != dst.size:
            raise BindingError(f"num_elements: {n} float16 values are {nbytes} bytes; WebGPU "
                               f"copies multiples of 4 bytes, so copy an even count (or all of "
                               f"dst_buf, {dst.size} values)")
        nbytes += 2  # the last word's other half is dst's padding
    device.copy(src, dst, nbytes)


# ---------------------------------------------------------------- numpy in, numpy out

def _host_activation(arr, what: str, dtype=_F32) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind != "f":
        raise BindingError(f"{what}: expected a real floating dtype (float16, float32 or "
                           f"float64), got {arr.dtype.name}; convert with .astype(np.float32)")
    with np.errstate(over="ignore"):  # overflow shows up as inf, reported below
        out = np.ascontiguousarray(arr, dtype=dtype)
    if dtype == np.float16 and np.isfinite(arr).all() and not np.isfinite(out).all():
        raise BindingError(f"{what}: values beyond float16's range (65504) become infinite "
                           f"when stored as float16")
    return out


def forward(x, a, b, base=None, *, alpha: float | None = None, scale: float | None = None,
            device=None, path: str = "auto", strategy: str | None = None, threads: int = 256,
            subgroups: bool = False, dtype=np.float32) -> np.ndarray:
    """``base + scale * B @ (A @ x)`` on the GPU, numpy in and numpy out.

    ``x``: ``(in_dim,)`` or ``(tokens, in_dim)``; ``a``: ``[rank, in_dim]``;
    ``b``: ``[out_dim, rank]``; ``base``: the base layer's output, shaped like
    the result (``x.shape[:-1] + (out_dim,)``), default zeros. Any real float
    dtype in; stored on the GPU and returned as ``dtype`` (float32, or float16
    where the adapter has shader-f16); sums are float32 either way.

    The factor is ``scale`` if given, else ``alpha / rank``; with neither it is
    1 (alpha = rank, as ``Config(rank)``). ``path``: ``"auto"`` (default: the
    fastest strategy, autotuned once per shape and device, or ``strategy``
    such as ``"fused:256:1"``), ``"three"``, ``"fused"`` or ``"single"`` (see
    the execute functions; there ``strategy`` is project_a's, "workgroup" or "seed").
    ``device`` defaults to ``shaderdsl.runtime.get_device()``.
    """
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if alpha is not None and scale is not None:
        raise ValueError("forward: give alpha or scale, not both (scale = alpha / rank)")
    dtype = storage_dtype(dtype)
    xs = _host_activation(x, "x", dtype)
    if xs.ndim not in (1, 2) or xs.shape[-1] < 1 or xs.size == 0:
        raise BindingError(f"x: expected shape (in_dim,) or (tokens, in_dim), got {xs.shape}")
    am = host_matrix(a, "a", "[rank, in_dim]", dtype)
    bm = host_matrix(b, "b", "[out_dim, rank]", dtype)
    rank, in_dim = am.shape
    out_dim = bm.shape[0]
    if bm.shape[1] != rank:
        raise BindingError(f"b: a is [rank, in_dim] = {list(am.shape)}, so b must be "
                           f"[out_dim, {rank}], got {list(bm.shape)}")
    if xs.shape[-1] != in_dim:
        raise BindingError(f"x: a is [rank, in_dim] = {list(am.shape)}, so x must end in "
                           f"{in_dim}, got shape {xs.shape}")
    out_shape = xs.shape[:-1] + (out_dim,)
    if base is None:
        base_host = np.zeros(out_shape, dtype)
    else:
        base_host = _host_activation(base, "base", dtype)
        if base_host.shape != out_shape:
            raise BindingError(f"base: expected shape {out_shape} (x.shape[:-1] + (out_dim,)), "
                               f"got {base_host.shape}")
    if scale is None:
        if alpha is None:
            scale = 1.0
        else:
            if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
                raise TypeError(f"alpha: expected a real number, got {alpha!r}")
            scale = float(alpha) / rank
    scale = _scale(scale)
    dev = get_device() if device is None else _device(device)
    weight = Weight.from_numpy(dev, am, bm, dtype=dtype)
    x_buf = dev.buffer(xs, name="lora.x")
    out_buf = dev.buffer(base_host, name="lora.output")
    temps = [x_buf, out_buf, weight.a, weight.b]
    try:
        if path == "auto":
            execute_lora_forward_auto(dev, weight, scale, x_buf, out_buf, strategy=strategy)
        elif path == "single":
            execute_lora_forward_single(dev, weight, scale, x_buf, out_buf, threads=threads,
                                        subgroups=subgroups)
        else:
            h_buf = dev.empty(xs.shape[:-1] + (rank,), np.float32, name="lora.h")
            temps.append(h_buf)
            a_strategy = strategy or "workgroup"
            if path == "fused":
                execute_lora_forward_fused(dev, weight, scale, x_buf, out_buf, h_buf,
                                           strategy=a_strategy, threads=threads, subgroups=subgroups)
            else:
                y_buf = dev.empty(out_shape, np.float32, name="lora.y")
                temps.append(y_buf)
                execute_lora_forward(dev, weight, scale, x_buf, out_buf, h_buf, y_buf,
                                     strategy=a_strategy, threads=threads, subgroups=subgroups)
        result = dev.read(out_buf).reshape(out_shape).copy()
    finally:
        _forget_weight(weight.uid)
        for buf in temps:
            dev.release(buf)
    return result


__all__ = ["execute_project_a", "execute_project_b", "execute_add_scaled", "execute_fused_b_add",
           "execute_lora_forward", "execute_lora_forward_fused", "execute_lora_forward_single",
           "execute_lora_forward_auto",
           "save_activation", "forward", "clear_plan_cache", "STRATEGIES", "PATHS"]
