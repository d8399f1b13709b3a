"""Dispatch-argument validation, done before anything reaches the GPU.

Each check raises the library's own exception with a message naming the
kernel, the binding and what was expected versus what was given. The device
runs these once per (kernel, buffers) and caches the result, so the hot path
only pays for them on the first dispatch of a combination.
"""
from __future__ import annotations

import operator

import numpy as np

from ..errors import AliasingError, BindingError, DispatchError, FeatureError
from ..types import Array, Scalar, numpy_dtype
from .buffers import Buffer

# Limits whose names the messages use (wgpu-py spells limits in kebab-case).
MAX_WORKGROUPS = "max-compute-workgroups-per-dimension"
MAX_INVOCATIONS = "max-compute-invocations-per-workgroup"
MAX_WG_SIZE = ("max-compute-workgroup-size-x", "max-compute-workgroup-size-y",
               "max-compute-workgroup-size-z")


def expected_dtype(binding) -> np.dtype | None:
    """The numpy dtype a buffer for this binding must have (None: not checkable)."""
    elem = binding.elem
    while isinstance(elem, Array):
        elem = elem.elem
    try:
        return numpy_dtype(elem)
    except TypeError:  # e.g. a struct-like uniform the runtime cannot describe
        return None


def check_kernel(kernel, device) -> None:
    """Features and workgroup size: things that depend only on kernel and device."""
    missing = sorted(set(kernel.features) - device.features)
    if missing:
        from .device import list_adapters

        try:
            adapters = list_adapters()
        except Exception:  # listing is only for the message
            adapters = []
        parts = []
        for feat in missing:
            having = [f"{a['name']} ({a['backend']})" for a in adapters if feat in a["features"]]
            where = ", ".join(having) if having else "no adapter on this machine"
            parts.append(f"{feat!r} (available on: {where})")
        raise FeatureError(
            f"kernel {kernel.name!r} needs feature(s) {', '.join(parts)}; device "
            f"{device.name!r} ({device.backend}) lacks it. Pick another adapter with "
            f"SHADERDSL_ADAPTER / SHADERDSL_BACKEND or get_device(backend=..., adapter=...).")
    limits = device.limits
    wg = kernel.workgroup_size
    for axis, (n, key) in enumerate(zip(wg, MAX_WG_SIZE)):
        if not isinstance(n, int) or n < 1:
            raise DispatchError(f"kernel {kernel.name!r}: workgroup_size {wg} must be positive ints")
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
            raise DispatchError(f"kernel {kernel.name!r}: workgroup count {c} on axis {'xyz'[axis]} "
                                f"must be >= 1 (a dispatch of nothing is almost always a bug)")
        if c > max_per_dim:
            raise DispatchError(
                f"kernel {kernel.name!r}: workgroup count {c} on axis {'xyz'[axis]} exceeds "
                f"{MAX_WORKGROUPS} = {max_per_dim}; split the grid over y/z or use a "
                f"grid-stride loop")
    return counts[0], counts[1], counts[2]


def overrides_key(kernel, overrides) -> tuple:
    """Sorted (name, value) pairs after checking names and value kinds."""
    if not overrides:
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
        value = overrides[name]
        ty = known[name].type
        tname = ty.name if isinstance(ty, Scalar) else str(ty)
        if isinstance(value, (bool, np.bool_)) and tname != "bool":
            raise DispatchError(f"override {name!r}: bool given for {tname}")
        if tname in ("u32", "i32"):
            try:
                value = operator.index(value)
            except TypeError:
                raise DispatchError(f"override {name!r}: {tname} needs an int, got {value!r}") from None
            lo, hi = (0, 2**32) if tname == "u32" else (-2**31, 2**31)
            if not lo <= value < hi:
                raise DispatchError(f"override {name!r}: {value} is out of range for {tname}")
        elif tname in ("f32", "f16"):
            if not isinstance(value, (int, float, np.integer, np.floating)):
                raise DispatchError(f"override {name!r}: {tname} needs a number, got {value!r}")
            value = float(value)
            limit = 65504.0 if tname == "f16" else 3.4028234663852886e38
            if not abs(value) <= limit:  # also refuses NaN
                raise DispatchError(f"override {name!r}: {value!r} is not a finite {tname}")
        elif tname == "bool":
            value = bool(value)
        items.append((name, value))
    return tuple(items)


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
    limits = device.limits
    seen: dict[int, list] = {}
    for binding, buf in zip(kernel.bindings, buffers):
        where = f"kernel {kernel.name!r} binding {binding.name!r} (@binding({binding.index}))"
        if not isinstance(buf, Buffer):
            raise BindingError(f"{where}: expected a Buffer (device.buffer(array)), got "
                               f"{type(buf).__name__}")
        if buf.released:
            raise BindingError(f"{where}: {buf!r} was released")
        if buf.device is not device:
            raise BindingError(f"{where}: {buf!r} belongs to another device ({buf.device.name!r})")
        kind = "uniform" if binding.access == "uniform" else "storage"
        if buf.usage_kind != kind:
            hint = "device.uniform(value)" if kind == "uniform" else "device.buffer(array)"
            raise BindingError(f"{where}: needs a {kind} buffer, got a {buf.usage_kind} buffer "
                               f"{buf!r}; create it with {hint}")
        want = expected_dtype(binding)
        if want is not None and buf.dtype != want:
            raise BindingError(f"{where}: expected dtype {want.name} (WGSL {binding.elem}), got "
                               f"{buf.dtype.name} from {buf!r}")
        need = binding.min_bytes
        if buf.nbytes < need:
            length = f"{binding.length} x " if binding.length else ""
            raise BindingError(f"{where}: buffer has {buf.nbytes} bytes, needs at least {need} "
                               f"({length}{binding.elem}, stride {binding.elem_stride}); got {buf!r}")
        cap_key = ("max-uniform-buffer-binding-size" if kind == "uniform"
                   else "max-storage-buffer-binding-size")
        cap = limits.get(cap_key)
        if cap is not None and buf.wgpu_buffer.size > cap:
            raise BindingError(f"{where}: buffer of {buf.wgpu_buffer.size} bytes is over {cap_key} "
                               f"= {cap} on {device.name!r}")
        seen.setdefault(buf.id, []).append(binding)
    for uses in seen.values():
        if len(uses) > 1 and any(b.writable for b in uses):
            names = ", ".join(f"{b.name!r} ({b.access})" for b in uses)
            raise AliasingError(
                f"kernel {kernel.name!r}: one buffer is bound to {names}; WebGPU forbids binding "
                f"a buffer more than once when one use writes it. Use a separate output buffer "
                f"(device.empty/zeros) and copy back if needed.")


__all__ = ["check_kernel", "workgroups", "overrides_key", "order_buffers", "check_buffers",
           "expected_dtype"]
