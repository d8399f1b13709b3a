"""The execute functions: LoRA kernels dispatched on a Device, as Hesper names them.

``output += scale * B @ (A @ x)``, in place on a buffer that already holds
the base layer's output. Each forward function is a Plan of a fixed strategy
(:mod:`lora.strategy`):

- :func:`execute_lora_forward`: ``three`` (project_a, project_b, add_scaled);
- :func:`execute_lora_forward_fused`: ``split`` (project_a, fused_b_add);
- :func:`execute_lora_forward_single`: ``fused`` (fused_forward, one dispatch);
- :func:`execute_lora_forward_auto`: the autotuned strategy (or a chosen one).

Every function takes one token (``x`` shaped ``(in_dim,)``) or several
(``(tokens, in_dim)``); ``h`` is then ``(rank,)``/``(tokens, rank)`` and
``y``/``output`` ``(out_dim,)``/``(tokens, out_dim)``. The activations ``x``
and ``output`` are stored like the weight (float32, or float16 for a weight
made with ``dtype=np.float16``); the scratch buffers ``h`` and ``y`` are
always float32. Sums are f32 in every case.

Everything is checked before the first dispatch (types, device, dtype, exact
shapes, aliasing, grid and binding limits, features; the kernels are
compiled too), so a call that raises has recorded nothing and left every
buffer as it was. The result is cached with the weight (weakly: it goes when
the weight goes), so a repeated call is a lookup and its dispatches. From 2
to ``tuning.RUNTIME_TOKENS`` tokens the whole forwards run plans whose
kernels read the token count at run time (:class:`lora.plan.Plan` with
``tokens=None``), so buffers of a new token count compile nothing. Calls
made inside ``with device.batch():`` are recorded into that batch; outside
one, the dispatches of a multi-dispatch forward still go out in one submit.
"""
from __future__ import annotations

import numbers
import os
import warnings
import weakref

import numpy as np

from shaderdsl import checks as host
from shaderdsl.errors import BindingError
from shaderdsl.runtime import get_device

from . import checks as C
from . import tuning
from .plan import Plan, build_steps, record_steps
from .strategy import STRATEGIES, Strategy
from .weight import Weight, host_matrix, storage_dtype, wgsl_dtype

PATHS = ("auto", "three", "fused", "single")  # lora.forward's former `path` names

_DEVICE_CACHE: dict = {}  # device -> {key: steps} for calls without a weight (add_scaled)
_WEIGHTS: "weakref.WeakSet" = weakref.WeakSet()  # weights whose ``plans`` hold something
_LIMIT = 256  # checked combinations kept per weight (or device) before starting afresh


# ---------------------------------------------------------------- the cache of checked calls

def _table(owner) -> dict | None:
    """Where checked calls are kept: the weight's ``plans``, or per device."""
    if isinstance(owner, Weight):
        return owner.plans
    return _DEVICE_CACHE.setdefault(owner, {}) if hasattr(owner, "dispatch") else None


def _forget(table: dict) -> None:
    """Empty one cache, freeing the scratch buffers of its plans now."""
    for entry in table.values():
        if isinstance(entry, Plan):
            entry.release()
    table.clear()


def _cached(owner, key, buffers, build):
    """The checked result of ``build()`` for ``key`` under ``owner``; one of
    ``buffers`` released since the check makes build() run again (and raise
    its message)."""
    table = _table(owner)
    try:
        hit = table.get(key) if table is not None else None
    except TypeError:  # an unhashable argument: let build() explain
        return build()
    if hit is not None:
        for b in buffers:
            if b.released:
                break
        else:
            return hit
    hit = build()
    if table is not None:
        if len(table) >= _LIMIT:
            _forget(table)
        table[key] = hit
        if isinstance(owner, Weight):
            _WEIGHTS.add(owner)
    return hit


def _ids(*bufs) -> tuple:
    return tuple([getattr(b, "id", None) for b in bufs])


def clear_plan_cache(weight: Weight | None = None) -> None:
    """Forget the checked calls and plans of ``weight`` (default: of every
    weight and device), freeing their scratch buffers. Kernels stay compiled."""
    tables = [weight.plans] if weight is not None else \
        [w.plans for w in list(_WEIGHTS)] + list(_DEVICE_CACHE.values())
    for table in tables:
        _forget(table)


def _run_steps(device, owner, key, buffers: dict, build) -> None:
    record_steps(device, _cached(owner, key, buffers.values(), build), buffers)


def _steps(device, kernels, buffers: dict) -> list:
    """The checked steps of one kernel call on these (already checked) buffers."""
    return build_steps(device, kernels, {role: b.bound_bytes for role, b in buffers.items()})


# ---------------------------------------------------------------- one kernel

def execute_project_a(device, weight, x_buf, h_buf, *, strategy: str = "workgroup",
                      threads: int = 256, subgroups: bool = False) -> None:
    """``h = A @ x`` for every token (one dispatch).

    ``strategy="workgroup"``: one workgroup of ``threads`` per token; each
    thread sums a strided slice of in_dim for every rank, then the workgroup
    reduces (in workgroup memory, or with ``subgroupAdd`` when
    ``subgroups=True``). ``strategy="seed"``: Hesper's design, one thread per
    element of h with a serial loop over in_dim.
    """
    def build():
        C.device_of(device)
        w = C.weight_on(device, weight)
        st = C.projection_value(strategy)
        sg = C.subgroups_value(device, subgroups, st)
        th = C.threads_value(device, threads, sg) if st == "workgroup" else 64
        x = C.storage(device, x_buf, "x_buf", w.dtype, "; activations are stored like the weight")
        h = C.storage(device, h_buf, "h_buf")
        tokens = C.tokens_of(x, w.in_dim, "x_buf", "in_dim")
        C.shaped(h, tokens, w.rank, "h_buf", "rank")
        host.distinct(("x_buf", x, False), ("h_buf", h, True), ("weight.a", w.a, False))
        s = Strategy("three", th, subgroups=sg, projection=st)
        return _steps(device, s.kernels(w.rank, w.in_dim, w.out_dim, 1.0, tokens,
                                        wgsl_dtype(w.dtype))[:1], {"A": w.a, "x": x, "h": h})

    _run_steps(device, weight, ("a", strategy, threads, subgroups, _ids(x_buf, h_buf)),
               {"A": getattr(weight, "a", None), "x": x_buf, "h": h_buf}, build)


def execute_project_b(device, weight, h_buf, y_buf, *, threads: int = 256) -> None:
    """``y = B @ h`` for every token (one dispatch; one thread per element of y)."""
    def build():
        C.device_of(device)
        w = C.weight_on(device, weight)
        th = C.threads_value(device, threads)
        h = C.storage(device, h_buf, "h_buf")
        y = C.storage(device, y_buf, "y_buf")
        tokens = C.tokens_of(h, w.rank, "h_buf", "rank")
        C.shaped(y, tokens, w.out_dim, "y_buf", "out_dim")
        host.distinct(("h_buf", h, False), ("y_buf", y, True), ("weight.b", w.b, False))
        return _steps(device, [("project_b", dict(out_dim=w.out_dim, rank=w.rank, tokens=tokens,
                                                  threads=th, dtype=wgsl_dtype(w.dtype)))],
                      {"B": w.b, "h": h, "y": y})

    _run_steps(device, weight, ("b", threads, _ids(h_buf, y_buf)),
               {"B": getattr(weight, "b", None), "h": h_buf, "y": y_buf}, build)


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
        return _steps(device, [("add_scaled", dict(
            num_elements=n, scale=C.scale_value(scale), threads=C.threads_value(device, threads),
            dtype=wgsl_dtype(dtype)))], {"y": y, "output": out})

    _run_steps(device, device, ("add", num_elements, scale, threads, _ids(y_buf, output_buf)),
               {"y": y_buf, "output": output_buf}, build)


def execute_fused_b_add(device, weight, scale, h_buf, output_buf, *, threads: int = 256) -> None:
    """``output += scale * B @ h`` for every token: project_b and add_scaled in one dispatch."""
    def build():
        C.device_of(device)
        w = C.weight_on(device, weight)
        s = C.scale_value(scale)
        th = C.threads_value(device, threads)
        h = C.storage(device, h_buf, "h_buf")
        out = C.storage(device, output_buf, "output_buf", w.dtype,
                        "; activations are stored like the weight")
        tokens = C.tokens_of(h, w.rank, "h_buf", "rank")
        C.shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
        host.distinct(("h_buf", h, False), ("output_buf", out, True), ("weight.b", w.b, False))
        return _steps(device, Strategy("split", th).kernels(
            w.rank, w.in_dim, w.out_dim, s, tokens, wgsl_dtype(w.dtype))[1:],
            {"B": w.b, "h": h, "output": out})

    _run_steps(device, weight, ("fb", scale, threads, _ids(h_buf, output_buf)),
               {"B": getattr(weight, "b", None), "h": h_buf, "output": output_buf}, build)


# ---------------------------------------------------------------- whole forwards

def _forward_plan(device, weight, scale, input_buf, output_buf, scratch: dict, make_strategy):
    """Check a forward's arguments (scratch: role -> buffer) and build its Plan
    (without scratch buffers of its own)."""
    C.device_of(device)
    w = C.weight_on(device, weight)
    s = C.scale_value(scale)
    strategy = make_strategy()
    x = C.storage(device, input_buf, "input_buf", w.dtype, "; activations are stored like the weight")
    out = C.storage(device, output_buf, "output_buf", w.dtype,
                    "; activations are stored like the weight")
    tokens = C.tokens_of(x, w.in_dim, "input_buf", "in_dim")
    C.shaped(out, tokens, w.out_dim, "output_buf", "out_dim")
    uses = [("input_buf", x, False), ("output_buf", out, True)]
    dims = {"h": (w.rank, "rank"), "y": (w.out_dim, "out_dim")}
    for role, buf in scratch.items():
        (dim, dim_name), what = dims[role], f"{role}_buf"
        C.storage(device, buf, what)
        C.shaped(buf, tokens, dim, what, dim_name)
        uses.append((what, buf, True))
    host.distinct(*uses, ("weight.a", w.a, False), ("weight.b", w.b, False))
    if tuning.runtime_bucket(device, w, tokens):  # kernels shared by every token count
        return Plan(device, w, s, None, strategy, scratch=False, max_tokens=tokens)
    return Plan(device, w, s, tokens, strategy, scratch=False)


def _fixed_strategy(device, name, strategy, threads, subgroups):
    """The Strategy of a Hesper-mirror forward, from its keyword arguments."""
    def make():
        projection = C.projection_value(strategy)
        sg = C.subgroups_value(device, subgroups, projection)
        return Strategy(name, C.threads_value(device, threads, sg), subgroups=sg,
                        projection=projection)
    return make


def _run_forward(device, weight, scale, input_buf, output_buf, scratch: dict, key, make):
    """Record the cached, checked plan of a forward (checking it on first sight)."""
    buffers = (getattr(weight, "a", None), getattr(weight, "b", None), input_buf, output_buf,
               *scratch.values())
    plan = _cached(weight, key + _ids(*buffers[2:]), buffers,
                   lambda: _forward_plan(device, weight, scale, input_buf, output_buf, scratch,
                                         make))
    plan.record(input_buf, output_buf, **scratch)


def execute_lora_forward(device, weight, scale, input_buf, output_buf, h_buf, y_buf, *,
                         strategy: str = "workgroup", threads: int = 256,
                         subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in three dispatches, as Hesper does:
    ``h = A @ x`` (project_a), ``y = B @ h`` (project_b), ``output += scale * y``
    (add_scaled). ``h_buf`` and ``y_buf`` are scratch buffers the call overwrites.
    ``strategy`` is project_a's: "workgroup" or Hesper's "seed"."""
    _run_forward(device, weight, scale, input_buf, output_buf, {"h": h_buf, "y": y_buf},
                 ("3", scale, strategy, threads, subgroups),
                 _fixed_strategy(device, "three", strategy, threads, subgroups))


def execute_lora_forward_fused(device, weight, scale, input_buf, output_buf, h_buf, *,
                               strategy: str = "workgroup", threads: int = 256,
                               subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in two dispatches: project_a, then
    fused_b_add (no ``y`` buffer, one pass over the output): strategy ``split``."""
    _run_forward(device, weight, scale, input_buf, output_buf, {"h": h_buf},
                 ("2", scale, strategy, threads, subgroups),
                 _fixed_strategy(device, "split", strategy, threads, subgroups))


def execute_lora_forward_single(device, weight, scale, input_buf, output_buf, *,
                                threads: int = 256, outputs_per_thread: int = 1,
                                subgroups: bool = False) -> None:
    """``output += scale * B @ (A @ input)`` in one dispatch (fused_forward):
    each workgroup recomputes ``h`` for its token, then updates
    ``threads * outputs_per_thread`` outputs. No scratch buffers."""
    def make():
        sg = C.subgroups_value(device, subgroups)
        th = C.threads_value(device, threads, sg)
        return Strategy("fused", th, C.count(outputs_per_thread, "outputs_per_thread"), sg)
    _run_forward(device, weight, scale, input_buf, output_buf, {},
                 ("1", scale, threads, outputs_per_thread, subgroups), make)


def execute_lora_forward_auto(device, weight, scale, input_buf, output_buf, *,
                              strategy=None) -> None:
    """``output += scale * B @ (A @ input)`` with the fastest strategy for this
    shape on this device (see :mod:`lora.tuning`; measured once, cached on
    disk), or the one forced by ``strategy`` (e.g. ``"tiled:256:8"``) or
    ``$LORA_STRATEGY``. After the first call for a shape, recording costs one
    cache lookup, a shape check and the dispatches: the hot path.

    From 2 to ``tuning.RUNTIME_TOKENS`` tokens the plan is a run-time one,
    chosen and kept per bucket of token counts (``tuning.BUCKETS``): a new
    count in a bucket seen before compiles nothing. One token, and counts
    past the last bucket or the device's binding-size limit, get a plan
    with the count baked in.
    """
    strategy = strategy or os.environ.get("LORA_STRATEGY") or "auto"
    tokens = input_buf.size // weight.in_dim if isinstance(weight, Weight) and \
        isinstance(input_buf, host.DeviceBuffer) else None
    bucket = tuning.runtime_bucket(device, weight, tokens) \
        if tokens and getattr(device, "limits", None) is not None else None

    def build():
        C.device_of(device)
        w = C.weight_on(device, weight)
        s = C.scale_value(scale)
        x = C.storage(device, input_buf, "input_buf", w.dtype,
                      "; activations are stored like the weight")
        out = C.storage(device, output_buf, "output_buf", w.dtype,
                        "; activations are stored like the weight")
        t = C.tokens_of(x, w.in_dim, "input_buf", "in_dim")
        C.shaped(out, t, w.out_dim, "output_buf", "out_dim")
        host.distinct(("input_buf", x, False), ("output_buf", out, True),
                      ("weight.a", w.a, False), ("weight.b", w.b, False))
        if bucket:
            return Plan(device, w, s, None, tuning.choose_bucket(device, w, s, bucket, strategy),
                        max_tokens=bucket[1])
        return Plan(device, w, s, t, tuning.choose(device, w, s, t, strategy))

    plan = _cached(weight, ("auto", scale, bucket or tokens, str(strategy)), (), build)
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


# ---------------------------------------------------------------- numpy in, numpy out

def _host_activation(arr, what: str, dtype) -> np.ndarray:
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


def _host_problem(x, a, b, base, dtype):
    """x, A, B and base as C-contiguous arrays of ``dtype``, shapes checked."""
    xs = _host_activation(x, "x", dtype)
    if xs.ndim not in (1, 2) or xs.shape[-1] < 1 or xs.size == 0:
        raise BindingError(f"x: expected shape (in_dim,) or (tokens, in_dim), got {xs.shape}")
    am = host_matrix(a, "a", "[rank, in_dim]", dtype)
    bm = host_matrix(b, "b", "[out_dim, rank]", dtype)
    if bm.shape[1] != am.shape[0]:
        raise BindingError(f"b: a is [rank, in_dim] = {list(am.shape)}, so b must be "
                           f"[out_dim, {am.shape[0]}], got {list(bm.shape)}")
    if xs.shape[-1] != am.shape[1]:
        raise BindingError(f"x: a is [rank, in_dim] = {list(am.shape)}, so x must end in "
                           f"{am.shape[1]}, got shape {xs.shape}")
    out_shape = xs.shape[:-1] + (bm.shape[0],)
    if base is None:
        return xs, am, bm, np.zeros(out_shape, dtype)
    base = _host_activation(base, "base", dtype)
    if base.shape != out_shape:
        raise BindingError(f"base: expected shape {out_shape} (x.shape[:-1] + (out_dim,)), "
                           f"got {base.shape}")
    return xs, am, bm, base


def _scale_of(alpha, scale, rank: int) -> float:
    """``scale``, else ``alpha / rank``, else 1."""
    if alpha is not None and scale is not None:
        raise ValueError("forward: give alpha or scale, not both (scale = alpha / rank)")
    if scale is None and alpha is not None:
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
            raise TypeError(f"alpha: expected a real number, got {alpha!r}")
        scale = float(alpha) / rank
    return C.scale_value(1.0 if scale is None else scale)


def _strategy_of_path(path: str, strategy, threads: int, subgroups: bool):
    """The strategy text a former ``path`` meant (``strategy`` was project_a's there)."""
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if path == "auto":
        return strategy
    warnings.warn(f"lora.forward(path={path!r}) is deprecated; pass strategy= instead "
                  f"(see lora.strategy)", DeprecationWarning, stacklevel=3)
    sg = ":sg" if subgroups else ""
    projection = C.projection_value(strategy or "workgroup")
    seed = ":seed" if projection == "seed" else ""
    return {"three": f"three:{threads}{seed}{sg}", "fused": f"split:{threads}{seed}{sg}",
            "single": f"fused:{threads}:1{sg}"}[path]


def forward(x, a, b, base=None, *, alpha: float | None = None, scale: float | None = None,
            device=None, strategy: str | None = None, dtype=np.float32, path: str = "auto",
            threads: int = 256, subgroups: bool = False) -> np.ndarray:
    """``base + scale * B @ (A @ x)`` on the GPU, numpy in and numpy out.

    ``x``: ``(in_dim,)`` or ``(tokens, in_dim)``; ``a``: ``[rank, in_dim]``;
    ``b``: ``[out_dim, rank]``; ``base``: the base layer's output, shaped like
    the result (``x.shape[:-1] + (out_dim,)``), default zeros. Any real float
    dtype in; stored on the GPU and returned as ``dtype`` (float32, or float16
    where the adapter has shader-f16); sums are float32 either way.

    The factor is ``scale`` if given, else ``alpha / rank``; with neither it is
    1 (alpha = rank, as ``Config(rank)``). ``strategy``: None for the fastest,
    autotuned once per shape and device, or a strategy text such as
    ``"fused:256:1"`` (:mod:`lora.strategy`). ``path`` (with ``threads`` and
    ``subgroups``) is the former spelling of a strategy and warns.
    ``device`` defaults to ``shaderdsl.runtime.get_device()``.
    """
    strategy = _strategy_of_path(path, strategy, threads, subgroups)
    dtype = storage_dtype(dtype)
    xs, am, bm, base_host = _host_problem(x, a, b, base, dtype)
    s = _scale_of(alpha, scale, am.shape[0])
    dev = get_device() if device is None else C.device_of(device)
    weight = Weight.from_numpy(dev, am, bm, dtype=dtype)
    x_buf = dev.buffer(xs, name="lora.x")
    out_buf = dev.buffer(base_host, name="lora.output")
    try:
        execute_lora_forward_auto(dev, weight, s, x_buf, out_buf, strategy=strategy)
        return dev.read(out_buf).reshape(base_host.shape).copy()
    finally:
        for buf in (x_buf, out_buf, weight.a, weight.b):
            dev.release(buf)
        clear_plan_cache(weight)


__all__ = ["execute_project_a", "execute_project_b", "execute_add_scaled", "execute_fused_b_add",
           "execute_lora_forward", "execute_lora_forward_fused", "execute_lora_forward_single",
           "execute_lora_forward_auto", "save_activation", "forward", "clear_plan_cache",
           "STRATEGIES", "PATHS"]
