"""Host-side checks, shared by every device (the GPU runtime, the interpreter)
and by lora: made before anything reaches a device.

Each check raises the library's own exception with a message naming the
kernel, the binding and what was expected versus what was given. The GPU
device runs the dispatch checks once per (kernel, buffers) and caches the
result, so the hot path only pays for them on the first dispatch of a
combination. Nothing here touches a device: a device is anything with
``name``, ``backend``, ``features`` and ``limits`` (and, optionally,
``adapters_with(feature)`` for the message of a missing feature).
"""
from __future__ import annotations

import operator
from types import SimpleNamespace

import numpy as np

from . import expr as E
from . import nodes as N
from .devicebuffer import DeviceBuffer, describe
from .errors import (
    AliasingError,
    BindingError,
    DispatchError,
    FeatureError,
    WGSLCompileError,
    is_positive_int,
)
from .types import (
    SUBGROUP_MATRIX_FEATURE,
    Array,
    MatrixConfig,
    Scalar,
    SubgroupMatrix,
    Vector,
    numpy_dtype,
)

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32),
                    np.dtype(np.uint32))


def check_dtype(dtype, what: str = "buffer") -> np.dtype:
    """The numpy dtype as a np.dtype, or BindingError if WGSL cannot hold it."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise BindingError(f"{what}: {dtype!r} is not a numpy dtype") from e
    if dt not in SUPPORTED_DTYPES:
        raise BindingError(
            f"{what}: dtype {dt.str} ({dt.name}) is not supported; use native-endian "
            f"float32, float16, int32 or uint32 (convert with arr.astype(np.float32) etc.)")
    return dt


def host_array(array, what: str = "buffer") -> np.ndarray:
    """A C-contiguous array of a supported dtype; never converts dtypes silently."""
    if not isinstance(array, np.ndarray):
        raise BindingError(f"{what}: expected a numpy array, got {type(array).__name__}")
    check_dtype(array.dtype, what)
    # (np.ascontiguousarray would make a 0-d array 1-d: a uniform's shape would change)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def uniform_array(value) -> np.ndarray:
    """Host array for a uniform: numpy arrays/scalars keep their dtype,
    Python float -> float32, Python int -> uint32 (counts and sizes)."""
    if isinstance(value, np.ndarray):
        return host_array(value, "uniform")
    if isinstance(value, np.generic):
        return host_array(np.asarray(value), "uniform")
    if isinstance(value, bool):
        raise BindingError("uniform: bool is not host-shareable; pass np.uint32(0/1)")
    if isinstance(value, float):
        return np.asarray(value, np.float32)
    if isinstance(value, int):
        if not 0 <= value < 2**32:
            raise BindingError(f"uniform: Python int {value} does not fit u32; pass an "
                               f"np.int32 for a signed uniform")
        return np.asarray(value, np.uint32)
    raise BindingError(f"uniform: expected a numpy array or scalar, got {type(value).__name__}")


def binding_where(kernel, binding) -> str:
    return f"kernel {kernel.name!r} binding {binding.name!r} (@binding({binding.index}))"


def _spell(dtype: np.dtype, shape: tuple) -> str:
    return f"{dtype.name}{list(shape)}" if shape else f"a {dtype.name} scalar"


def uniform_value(kernel, binding, value) -> np.ndarray:
    """A plain value given to a uniform binding for one dispatch (every device
    takes one): the rules of ``uniform_array`` (Python float -> float32, int ->
    uint32, numpy keeps its dtype), then dtype and shape must be exactly the
    binding's (``()`` for a scalar, ``(n,)`` for a vecN)."""
    want = binding.dtype
    shape = (binding.elem.size,) if isinstance(binding.elem, Vector) else ()
    try:
        arr = uniform_array(value)
    except BindingError as e:
        raise BindingError(f"{binding_where(kernel, binding)}: expected a Buffer (device.uniform) "
                           f"or {_spell(want, shape)} (WGSL {binding.elem}), got {value!r}: "
                           f"{e}") from None
    if arr.dtype != want or arr.shape != shape:
        hint = (f"np.{want.name}(...)" if not shape else
                f"np.array([...], np.{want.name}) of {shape[0]} values")
        raise BindingError(f"{binding_where(kernel, binding)}: expected {_spell(want, shape)} "
                           f"(WGSL {binding.elem}), got {_spell(arr.dtype, arr.shape)} "
                           f"from {value!r}; pass {hint}")
    return arr


def uniform_values(kernel, buffers: list) -> dict:
    """position -> ``uniform_value``'s array for each plain value given to a
    uniform binding (``buffers`` in binding order), in binding-number order."""
    order = sorted(range(len(buffers)), key=lambda i: kernel.bindings[i].index)
    return {i: uniform_value(kernel, kernel.bindings[i], buffers[i]) for i in order
            if kernel.bindings[i].access == "uniform" and not isinstance(buffers[i], DeviceBuffer)}


def _refuse_storage_values(kernel, buffers) -> None:
    """A plain value for a storage binding: say that only uniforms take one."""
    for binding, obj in zip(kernel.bindings, buffers):
        if binding.access != "uniform" and isinstance(obj, (int, float, np.generic)):
            raise BindingError(f"{binding_where(kernel, binding)}: a plain value ({obj!r}) is "
                               f"accepted only by a uniform binding; {binding.name!r} is a "
                               f"storage buffer ({binding.access}): give it a Buffer "
                               f"(device.buffer(array))")


def buffer_shape(shape) -> tuple:
    """``device.empty``'s shape on every device: an int or a tuple of ints, none negative."""
    try:
        shape = (operator.index(shape),) if not isinstance(shape, (tuple, list)) else tuple(
            operator.index(s) for s in shape)
    except TypeError:
        raise BindingError(f"shape must be an int or a tuple of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise BindingError(f"negative shape {shape}")
    return shape


def write_array(buf, array) -> np.ndarray:
    """What ``device.write(buf, array)`` writes, on every device: ``array``
    with exactly ``buf``'s dtype and shape (a uniform also takes a scalar)."""
    if buf.usage_kind == "uniform" and not isinstance(array, np.ndarray):
        array = uniform_array(array)
    if not isinstance(array, np.ndarray):
        raise BindingError(f"write to {buf!r}: expected a numpy array, got "
                           f"{type(array).__name__}")
    if array.dtype != buf.dtype or array.shape != buf.shape:
        raise BindingError(f"write to {buf!r}: expected {describe(buf.dtype, buf.shape)}, "
                           f"got {describe(array.dtype, array.shape)}")
    return array


def copy_size(src, dst, nbytes) -> int:
    """The byte count ``device.copy(src, dst, nbytes)`` moves, on every device:
    all of src by default (an odd float16 count takes its padding along when
    both buffers have it), else a multiple of 4 that fits both."""
    if src is dst:
        raise BindingError(f"copy: source and destination are the same buffer {src!r}")
    if nbytes is None:
        nbytes = src.nbytes
        if nbytes % 4:
            nbytes = -(-nbytes // 4) * 4
            if nbytes > min(src.bound_bytes, dst.bound_bytes):
                raise BindingError(f"copy: {src.nbytes} bytes is not a multiple of 4; "
                                   f"pass nbytes explicitly")
    else:
        nbytes = operator.index(nbytes)
        if nbytes < 0 or nbytes % 4:
            raise BindingError(f"copy: nbytes={nbytes} must be a non-negative multiple of 4")
        if nbytes > src.bound_bytes or nbytes > dst.bound_bytes:
            raise BindingError(f"copy: nbytes={nbytes} is larger than {src!r} "
                               f"({src.nbytes} B) or {dst!r} ({dst.nbytes} B)")
    if nbytes > dst.bound_bytes:
        raise BindingError(f"copy: {nbytes} bytes do not fit {dst!r} ({dst.nbytes} B)")
    return nbytes


def live_buffer(buf, device, what: str, kind: str | None = "storage", dtype=None, why: str = ""):
    """``buf`` is a live buffer on ``device``, of ``kind`` ("storage", "uniform";
    None: either) and of ``dtype`` when given."""
    if not isinstance(buf, DeviceBuffer):
        raise BindingError(f"{what}: expected a Buffer (device.buffer(array)), got "
                           f"{type(buf).__name__}")
    if buf.released:
        raise BindingError(f"{what}: {buf!r} was released")
    if buf.device is not device:
        owner = buf.device
        raise BindingError(f"{what}: {buf!r} belongs to another device "
                           f"({getattr(owner, 'name', owner)!r}, {getattr(owner, 'backend', '?')})")
    if kind is not None and buf.usage_kind != kind:
        hint = "device.uniform(value)" if kind == "uniform" else "device.buffer(array)"
        raise BindingError(f"{what}: needs a {kind} buffer, got a {buf.usage_kind} buffer "
                           f"{buf!r}; create it with {hint}")
    if dtype is not None and buf.dtype != dtype:
        raise BindingError(f"{what}: expected dtype {np.dtype(dtype).name}, got "
                           f"{buf.dtype.name} ({buf!r}){why}")
    return buf


def binding_size(what: str, nbytes: int, device, kind: str = "storage") -> None:
    """A binding of ``nbytes`` fits the device's binding-size limit (checked
    before any pipeline is built: some drivers fail compiling otherwise)."""
    key = "max-uniform-buffer-binding-size" if kind == "uniform" else \
        "max-storage-buffer-binding-size"
    cap = device.limits.get(key)
    if cap is not None and nbytes > cap:
        raise BindingError(f"{what}: buffer of {nbytes} bytes is over {key} = {cap} on "
                           f"{device.name!r}")


def distinct(*uses) -> None:
    """``uses``: (what, buffer, writes). No buffer may appear twice where one use writes it."""
    seen: dict = {}
    for what, buf, writes in uses:
        prev = seen.get(buf.id)
        if prev is None:
            seen[buf.id] = (what, writes)
        elif writes or prev[1]:
            raise AliasingError(f"{prev[0]} and {what} are the same buffer {buf!r}; WebGPU "
                                f"forbids binding a buffer twice where one use writes it. "
                                f"Allocate another with device.empty(...)")


def check_features(what: str, needed, device, first_use=()) -> None:
    """FeatureError naming the missing features, the line that first needs each
    (``first_use``: (feature, file:line) pairs) and the adapters that have them."""
    missing = sorted(set(needed) - set(device.features))
    if not missing:
        return
    where_else = getattr(device, "adapters_with", lambda feature: [])
    parts = []
    for feat in missing:
        having = where_else(feat)
        used = dict(first_use).get(feat)
        parts.append(f"{feat!r} ({f'first used at {used}; ' if used else ''}available on: "
                     f"{', '.join(having) or 'no adapter on this machine'})")
    raise FeatureError(
        f"{what} needs feature(s) {', '.join(parts)}; device {device.name!r} "
        f"({device.backend}) lacks it. Pick another adapter with SHADERDSL_ADAPTER / "
        f"SHADERDSL_BACKEND or get_device(backend=..., adapter=...).")

# Limits whose names the messages use (wgpu-py spells limits in kebab-case).
MAX_DYNAMIC_UNIFORMS = "max-dynamic-uniform-buffers-per-pipeline-layout"
MAX_WORKGROUPS = "max-compute-workgroups-per-dimension"
MAX_INVOCATIONS = "max-compute-invocations-per-workgroup"
MAX_WG_SIZE = ("max-compute-workgroup-size-x", "max-compute-workgroup-size-y",
               "max-compute-workgroup-size-z")


def expected_dtype(binding) -> np.dtype | None:
    """The numpy dtype a buffer for this binding must have (None: not checkable)."""
    elem = getattr(binding, "holds", None) or binding.elem
    while isinstance(elem, Array):
        elem = elem.elem
    try:
        return numpy_dtype(elem)
    except TypeError:  # e.g. a struct-like uniform the runtime cannot describe
        return None


def check_kernel(kernel, device) -> None:
    """Features, subgroup-matrix shapes and workgroup size: things that depend
    only on kernel and device."""
    check_features(f"kernel {kernel.name!r}", kernel.features, device, kernel.feature_lines)
    configs = getattr(device, "subgroup_matrix_configs", ())
    if configs:  # a device that lists its shapes (Dawn's adapters; the interpreter's too)
        check_subgroup_matrices(kernel, device, configs)
    limits = device.limits
    wg = kernel.workgroup_size
    for axis, (n, key) in enumerate(zip(wg, MAX_WG_SIZE)):
        if not is_positive_int(n):
            raise DispatchError(f"kernel {kernel.name!r}: workgroup_size {wg} must be "
                                f"positive ints")
        if key in limits and n > limits[key]:
            raise DispatchError(f"kernel {kernel.name!r}: workgroup_size[{axis}] = {n} exceeds "
                                f"{key} = {limits[key]} on {device.name!r}")
    wg_cap = limits.get("max-compute-workgroup-storage-size")
    if wg_cap is not None and kernel.workgroup_bytes > wg_cap:
        raise DispatchError(f"kernel {kernel.name!r} declares {kernel.workgroup_bytes} bytes of "
                            f"workgroup memory, over max-compute-workgroup-storage-size = "
                            f"{wg_cap} on {device.name!r}")
    cap = limits.get(MAX_INVOCATIONS)
    if cap is not None and kernel.threads_per_workgroup > cap:
        raise DispatchError(f"kernel {kernel.name!r}: workgroup_size {wg} has "
                            f"{kernel.threads_per_workgroup} invocations, over {MAX_INVOCATIONS} "
                            f"= {cap} on {device.name!r}")


_PRODUCTS = ("subgroup_matrix_multiply", "subgroup_matrix_multiply_accumulate")


def _matrix_uses(module) -> dict:
    """What of subgroup matrices a kernel's tree uses -> the line that first uses
    it: each product as the MatrixConfig it needs, each matrix type."""
    found: dict = {}

    def expr(e, where: str) -> None:
        if isinstance(e, E.Call) and e.op.name in _PRODUCTS:
            left, right = e.args[0].type, e.args[1].type
            found.setdefault(MatrixConfig(left.component, e.type.component, left.rows,
                                          right.cols, left.cols), where)
        if isinstance(e.type, SubgroupMatrix):
            found.setdefault(e.type, where)
        for sub in E.operands(e):
            expr(sub, where)

    def block(b) -> None:
        for st in b.stmts:
            ref = getattr(st, "ref", None)
            for e in ((ref,) if ref is not None else ()) + N.expressions(st):
                expr(e, st.where)
            for _, body in getattr(st, "branches", ()):
                block(body)
            for body in (getattr(st, "else_body", None), getattr(st, "body", None)):
                if body is not None:
                    block(body)
    for fn in module.functions:
        block(fn.body)
        for e in (*fn.params, *([] if fn.result is None else [fn.result])):
            expr(e, fn.where)
    block(module.body)
    return found


def _shape_of(use) -> str:
    """``the product f16->f32 8x8x8 (component->result MxNxK)`` or
    ``subgroup_matrix_left<f16, 8, 8> (MxK 8x8)``."""
    if isinstance(use, MatrixConfig):
        return f"the product {use} (component->result MxNxK)"
    rows_by_cols = {"left": "MxK", "right": "KxN", "result": "MxN"}[use.kind]
    return f"{use} ({rows_by_cols} {use.rows}x{use.cols})"


def _fits(use, config) -> bool:
    if isinstance(use, MatrixConfig):
        return (use.component, use.result, use.m, use.n, use.k) == \
            (config.component, config.result, config.m, config.n, config.k)
    return use in config.types()


def _sizes(config) -> str:
    """``32`` or ``16-64``: the subgroup sizes a configuration runs on."""
    low, high = config.subgroup_sizes
    return f"{low}" if low == high else f"{low}-{high}"


def _listed(configs) -> str:
    """``f16->f32 16x16x16, i8->i32 16x8x32 (component->result MxNxK, on subgroups of 32)``."""
    if not configs:
        return "none"
    sizes = dict.fromkeys(map(_sizes, configs))
    if len(sizes) == 1:
        return f"{', '.join(map(str, configs))} (component->result MxNxK, on subgroups of " \
               f"{next(iter(sizes))})"
    return ", ".join(f"{c} (subgroups of {_sizes(c)})" for c in configs) + \
        " (component->result MxNxK)"


def check_subgroup_matrices(kernel, device, configs, subgroup_size: int | None = None) -> None:
    """What Dawn checks of a kernel with subgroup matrices before it runs, on
    ``device`` with the subgroup-matrix ``configs`` (MatrixConfigs): every
    product and matrix type one of them (FeatureError naming the shape and
    the configurations there are), on subgroups of ``subgroup_size`` where
    the device has one size (the interpreter; FeatureError), and a workgroup
    x size that is a multiple of their largest subgroup size (DispatchError)."""
    if SUBGROUP_MATRIX_FEATURE not in kernel.features or kernel.ir is None:
        return
    configs = tuple(configs)
    uses = _matrix_uses(kernel.ir)
    fits: list = []
    # products first: their message names the whole M x N x K
    for use in sorted(uses, key=lambda u: not isinstance(u, MatrixConfig)):
        what = f"kernel {kernel.name!r} uses {_shape_of(use)} (first at {uses[use]})"
        shapes = [c for c in configs if _fits(use, c)]
        if not shapes:
            raise FeatureError(f"{what}, a shape device {device.name!r} does not offer; its "
                               f"subgroup-matrix configurations: {_listed(configs)}")
        sized = [c for c in shapes if subgroup_size is None or
                 c.subgroup_sizes[0] <= subgroup_size <= c.subgroup_sizes[1]]
        if not sized:
            raise FeatureError(
                f"{what}, which device {device.name!r} offers on subgroups of "
                f"{' or '.join(dict.fromkeys(map(_sizes, shapes)))} only, not on its subgroups "
                f"of {subgroup_size}; its subgroup-matrix configurations: {_listed(configs)}")
        fits += sized
    widest = max((c.subgroup_sizes[1] for c in fits), default=1)
    if kernel.workgroup_size[0] % widest:
        raise DispatchError(
            f"kernel {kernel.name!r}: workgroup_size {tuple(kernel.workgroup_size)} uses "
            f"subgroup matrices, so its x size must be a multiple of the largest subgroup size "
            f"({widest}) on {device.name!r}, as Dawn requires")


def workgroups(kernel, value, max_per_dim: int) -> tuple[int, int, int]:
    """Normalize an int or 1..3-tuple to (x, y, z), each in 1..max_per_dim."""
    if isinstance(value, (tuple, list)):
        if not 1 <= len(value) <= 3:
            raise DispatchError(f"kernel {kernel.name!r}: workgroups must be an int or 1 to 3 "
                                f"ints, got {value!r}")
        counts = list(value) + [1] * (3 - len(value))
    else:
        counts = [value, 1, 1]
    try:
        counts = [operator.index(c) for c in counts]
    except TypeError:
        raise DispatchError(f"kernel {kernel.name!r}: workgroup counts must be ints, "
                            f"got {value!r}") from None
    for axis, c in enumerate(counts):
        if c < 1:
            raise DispatchError(f"kernel {kernel.name!r}: workgroup count {c} on axis "
                                f"{'xyz'[axis]} must be >= 1 (a dispatch of nothing is almost "
                                f"always a bug)")
        if c > max_per_dim:
            raise DispatchError(
                f"kernel {kernel.name!r}: workgroup count {c} on axis {'xyz'[axis]} exceeds "
                f"{MAX_WORKGROUPS} = {max_per_dim}; split the grid over y/z or use a "
                f"grid-stride loop")
    return counts[0], counts[1], counts[2]


def overrides_key(kernel, overrides) -> tuple:
    """Sorted (name, value) pairs after checking names and value kinds; an
    override with neither a default nor a value fails as a GPU pipeline does
    (WGSLCompileError), with one message whichever WGSL compiler is underneath."""
    if not overrides:
        _all_valued(kernel, ())
        return ()
    if not isinstance(overrides, dict):
        raise DispatchError(f"kernel {kernel.name!r}: overrides must be a dict name -> value")
    known = {o.name: o for o in kernel.overrides}
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise DispatchError(f"kernel {kernel.name!r} has no override(s) {unknown}; it has "
                            f"{sorted(known)}")
    items = []
    for name in sorted(overrides):
        ty = known[name].type
        tname = ty.name if isinstance(ty, Scalar) else str(ty)
        items.append((name, _override_value(name, tname, overrides[name])))
    _all_valued(kernel, overrides)
    return tuple(items)


def _override_value(name: str, tname: str, given):
    """An override's value as its WGSL type ``tname`` takes it, or DispatchError."""
    if isinstance(given, (bool, np.bool_)):
        if tname != "bool":
            raise DispatchError(f"override {name!r}: bool given for {tname}")
        return bool(given)
    if tname in ("u32", "i32"):
        try:
            value = operator.index(given)
        except TypeError:
            raise DispatchError(f"override {name!r}: {tname} needs an int, "
                                f"got {given!r}") from None
        lo, hi = (0, 2**32) if tname == "u32" else (-2**31, 2**31)
        if not lo <= value < hi:
            raise DispatchError(f"override {name!r}: {value} is out of range for {tname}")
        return value
    if tname in ("f32", "f16"):
        if not isinstance(given, (int, float, np.integer, np.floating)):
            raise DispatchError(f"override {name!r}: {tname} needs a number, got {given!r}")
        value = float(given)
        limit = 65504.0 if tname == "f16" else 3.4028234663852886e38
        if not abs(value) <= limit:  # also refuses NaN
            raise DispatchError(f"override {name!r}: {value!r} is not a finite {tname}")
        return value
    return bool(given) if tname == "bool" else given


def _all_valued(kernel, given) -> None:
    missing = [o.name for o in kernel.overrides if o.default is None and o.name not in given]
    if missing:
        raise WGSLCompileError(f"Missing value for pipeline-overridable constant "
                               f"{', '.join(map(repr, missing))} (no default): pass "
                               f"overrides={{{missing[0]!r}: ...}}", kernel_name=kernel.name)


def order_buffers(kernel, bindings) -> list:
    """Buffers in binding order, from a dict name -> Buffer or a sequence."""
    names = [b.name for b in kernel.bindings]
    if isinstance(bindings, dict):
        missing = [n for n in names if n not in bindings]
        unknown = [n for n in bindings if n not in names]
        if missing or unknown:
            msg = [f"kernel {kernel.name!r} bindings do not match: it takes {names}"]
            if missing:
                msg.append(f"missing {missing}")
            if unknown:
                msg.append(f"unknown {unknown}")
            raise BindingError("; ".join(msg))
        return [bindings[n] for n in names]
    if isinstance(bindings, (str, bytes)) or not hasattr(bindings, "__len__"):
        raise BindingError(f"kernel {kernel.name!r}: bindings must be a dict name -> Buffer or a "
                           f"sequence in binding order {names}, got {type(bindings).__name__}")
    if len(bindings) != len(names):
        raise BindingError(f"kernel {kernel.name!r} takes {len(names)} bindings {names}, "
                           f"got {len(bindings)}")
    return list(bindings)


def check_buffers(kernel, buffers: list, device) -> None:
    """Each buffer fits its binding, and no written buffer is bound twice."""
    seen: dict[int, list] = {}
    for binding, buf in zip(kernel.bindings, buffers):
        where = f"kernel {kernel.name!r} binding {binding.name!r} (@binding({binding.index}))"
        kind = "uniform" if binding.access == "uniform" else "storage"
        live_buffer(buf, device, where, kind)
        want = expected_dtype(binding)
        if want is not None and buf.dtype != want:
            raise BindingError(f"{where}: expected dtype {want.name} (WGSL {binding.elem}), got "
                               f"{buf.dtype.name} from {buf!r}")
        need = binding.min_bytes
        if buf.nbytes < need:
            length = f"{binding.length} x " if binding.length else ""
            if binding.length and binding.shape and len(binding.shape) > 1:
                length = f"{tuple(binding.shape)} = {length}"
            raise BindingError(f"{where}: buffer has {buf.nbytes} bytes, needs at least {need} "
                               f"({length}{binding.elem}, stride {binding.elem_stride}); "
                               f"got {buf!r}")
        _rows_fit(where, binding, buf)
        binding_size(where, buf.bound_bytes, device, kind)
        seen.setdefault(buf.id, []).append(binding)
    for uses in seen.values():
        if len(uses) > 1 and any(b.writable for b in uses):
            names = ", ".join(f"{b.name!r} ({b.access})" for b in uses)
            raise AliasingError(
                f"kernel {kernel.name!r}: one buffer is bound to {names}; WebGPU forbids binding "
                f"a buffer more than once when one use writes it. Use a separate output buffer "
                f"(device.empty/zeros) and copy back if needed.")


def _rows_fit(where: str, binding, buf) -> None:
    """A buffer whose shape has as many axes as the binding's declared shape
    (two or more) must agree on every axis after the first: a transposed
    array or one of another row length would be read with the wrong strides.
    More rows are fine, and so is a flat buffer; a vector binding's arrays
    carry its components as a last axis."""
    shape = binding.shape
    if shape is None or len(shape) < 2:
        return
    have = tuple(buf.shape)
    if binding.components > 1 and have[-1:] == (binding.components,):
        have = have[:-1]
    if len(have) != len(shape):
        return
    for axis in range(1, len(shape)):
        if isinstance(shape[axis], int) and have[axis] != shape[axis]:
            fits = ", ".join(["any"] + [str(a) for a in shape[1:]])
            raise BindingError(
                f"{where}: declared with shape {tuple(shape)}, got {buf!r} of shape {have}: "
                f"axis {axis} is {have[axis]}, not {shape[axis]}, so it would be read with the "
                f"wrong strides (a transposed array?); a shape ({fits}) fits")


def check_bound(kernel, buffers: list, device, valued=()) -> None:
    """What a dispatch binds, on every device: no storage binding takes a plain
    value; the uniform bindings given plain values (positions ``valued``) each
    need a dynamic offset, so the kernel's uniform bindings must fit
    max-dynamic-uniform-buffers-per-pipeline-layout; every Buffer given fits
    its binding (``check_buffers``)."""
    _refuse_storage_values(kernel, buffers)
    if not valued:
        check_buffers(kernel, buffers, device)
        return
    uniforms = sum(b.access == "uniform" for b in kernel.bindings)
    cap = device.limits.get(MAX_DYNAMIC_UNIFORMS)
    if cap is not None and uniforms > cap:
        raise BindingError(
            f"kernel {kernel.name!r} has {uniforms} uniform bindings, over "
            f"{MAX_DYNAMIC_UNIFORMS} = {cap} on {device.name!r}: plain values need a dynamic "
            f"offset for each; give them device.uniform(...) Buffers instead")
    kept = [i for i in range(len(buffers)) if i not in valued]
    view = SimpleNamespace(name=kernel.name, bindings=[kernel.bindings[i] for i in kept])
    check_buffers(view, [buffers[i] for i in kept], device)
