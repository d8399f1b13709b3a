"""The LoRA arguments, checked before anything is allocated or recorded.

Built on ``shaderdsl.checks`` (live buffers, aliasing, binding sizes,
features); what is LoRA's own is here: a weight's matrices and f16
storage, a scale, a positive int (``count``, the one such check), a power-of-two
thread count, token counts read off activation shapes, and each message
naming the argument as the caller spelled it.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from shaderdsl import checks
from shaderdsl.errors import BindingError, DispatchError, FeatureError

F32 = np.dtype(np.float32)
PROJECTIONS = ("workgroup", "seed")  # how project_a sums: a workgroup per token, or Hesper's


def device_of(device):
    if device is None or not hasattr(device, "dispatch"):
        raise TypeError(f"device: expected a shaderdsl Device (shaderdsl.runtime.get_device()), "
                        f"got {type(device).__name__}")
    return device


def storage(device, buf, what: str, dtype=F32, why: str = ""):
    """A live storage buffer of ``dtype`` on ``device``."""
    return checks.live_buffer(buf, device, what, "storage", dtype, why)


def storage_dtype_of(buf) -> np.dtype:
    """float16 for a float16 buffer, else float32: the dtype a check then expects."""
    return np.dtype(np.float16) if getattr(buf, "dtype", None) == np.float16 else F32


def tokens_of(buf, dim: int, what: str, dim_name: str) -> int:
    """Token count of an activation: shape ``(dim,)`` is one token, ``(T, dim)`` T tokens."""
    shape = buf.shape
    if shape == (dim,):
        return 1
    if len(shape) == 2 and shape[1] == dim and shape[0] >= 1:
        return shape[0]
    raise BindingError(f"{what}: expected shape ({dim_name},) = ({dim},) or (tokens, {dim}), "
                       f"got {list(shape)} ({buf!r})")


def shaped(buf, tokens: int, dim: int, what: str, dim_name: str) -> None:
    """``buf`` is exactly ``(tokens, dim)`` (or ``(dim,)`` for one token)."""
    shape = buf.shape
    if shape == (tokens, dim) or (tokens == 1 and shape == (dim,)):
        return
    want = f"({dim},) or (1, {dim})" if tokens == 1 else f"({tokens}, {dim})"
    raise BindingError(f"{what}: expected shape {want} for {tokens} token(s) of {dim_name} = "
                       f"{dim}, got {list(shape)} ({buf!r})")


def holds(n: int, *named) -> None:
    """Each (what, buffer) holds at least ``n`` elements."""
    for what, buf in named:
        if buf.size < n:
            raise BindingError(f"{what}: num_elements = {n} but the buffer holds only "
                               f"{buf.size} elements ({buf!r})")


def scale_value(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number, got {type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or not abs(s) <= float(np.finfo(np.float32).max):
        raise ValueError(f"scale: expected a finite float32 value, got {scale!r}")
    return s


def count(value, what: str, low: int = 1, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= ``low`` (a bool is not one), else ``error``
    naming ``what``: the one positive-int check of lora."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise error(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


def check_f16(device, dtype: np.dtype, what: str) -> None:
    """float16 storage needs the adapter's shader-f16: refuse before allocating."""
    if dtype == np.float16 and not device.has_feature("shader-f16"):
        raise FeatureError(f"{what}: float16 storage needs the 'shader-f16' feature, which "
                           f"{device.name!r} ({device.backend}) lacks; use float32")


def host_matrix(array, what: str, layout: str, dtype: DTypeLike = np.float32) -> np.ndarray:
    """``array`` as a C-contiguous matrix of ``dtype`` (float32 or float16), or
    a clear BindingError.

    Accepts any real floating dtype (float16/32/64; cast to ``dtype``); refuses
    ints, bools, complex and objects rather than guessing, and values that are
    NaN or infinite after the cast (a float64 over 3.4e38, or anything over
    65504 in float16, becomes inf).
    """
    arr = host_values(array)
    if arr.dtype.kind != "f":
        raise BindingError(f"Weight: {what} must have a real floating dtype (float16, float32 or "
                           f"float64), got {arr.dtype.name}; convert with .astype(np.float32)")
    if arr.ndim != 2:
        raise BindingError(f"Weight: {what} must be 2-D {layout}, got shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise BindingError(f"Weight: {what} {layout} must have no empty dimension, got shape "
                           f"{arr.shape}")
    with np.errstate(over="ignore"):  # overflow shows up as inf, reported below
        out = np.ascontiguousarray(arr, dtype=dtype)
    bad = np.count_nonzero(~np.isfinite(out))
    if bad:
        limit = " (float16 holds at most 65504)" if out.dtype == np.float16 else ""
        raise BindingError(f"Weight: {what} has {bad} NaN or infinite value(s) as "
                           f"{out.dtype.name}{limit}")
    return out


def threads_value(device, threads, subgroups: bool = False) -> int:
    t = count(threads, "threads")
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


def subgroups_value(device, subgroups, projection: str = "workgroup") -> bool:
    if not isinstance(subgroups, (bool, np.bool_)):
        raise TypeError(f"subgroups: expected True or False, got {subgroups!r}")
    if subgroups and projection != "workgroup":
        raise ValueError(f"subgroups=True applies to projection='workgroup' only, got "
                         f"projection={projection!r}")
    if subgroups and not device.has_feature("subgroup"):
        raise FeatureError(f"subgroups=True needs the 'subgroup' feature, which {device.name!r} "
                           f"({device.backend}) lacks; call with subgroups=False")
    return bool(subgroups)


def projection_value(projection) -> str:
    if projection not in PROJECTIONS:
        raise ValueError(f"projection: expected one of {PROJECTIONS}, got {projection!r}")
    return projection


# ---------------------------------------------------------------- numpy in

def host_values(value) -> np.ndarray:
    """``value`` as a numpy array. A torch tensor (anything with ``detach``,
    ``cpu`` and ``numpy``) is read as its values, detached and copied to the
    host, bfloat16 widened to float32: torch users pass parameters that
    require grad and CUDA tensors, which ``np.asarray`` refuses."""
    if all(hasattr(value, k) for k in ("detach", "cpu", "numpy")):
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return tensor.numpy()
    return np.asarray(value)


def host_activation(arr, what: str, dtype) -> np.ndarray:
    """An activation as a C-contiguous array of ``dtype``; refuses non-floats
    and values that float16 cannot hold."""
    arr = host_values(arr)
    if arr.dtype.kind != "f":
        raise BindingError(f"{what}: expected a real floating dtype (float16, float32 or "
                           f"float64), got {arr.dtype.name}; convert with .astype(np.float32)")
    with np.errstate(over="ignore"):  # overflow shows up as inf, reported below
        out = np.ascontiguousarray(arr, dtype=dtype)
    if dtype == np.float16 and np.isfinite(arr).all() and not np.isfinite(out).all():
        raise BindingError(f"{what}: values beyond float16's range (65504) become infinite "
                           f"when stored as float16")
    return out


class HostProblem(NamedTuple):
    """``host_problem``'s arrays: x as [tokens, in_dim] (or [in_dim] for a 1-D
    x), A, B, the output-shaped array as [tokens, out_dim] (or [out_dim]), and
    ``shape``, the result's shape: x.shape[:-1] + (out_dim,)."""

    x: np.ndarray
    a: np.ndarray
    b: np.ndarray
    out: np.ndarray
    shape: tuple

    @property
    def tokens(self) -> int:
        return 1 if self.x.ndim == 1 else self.x.shape[0]


def host_problem(x, a, b, base, dtype, base_name: str = "base") -> HostProblem:
    """x, A, B and base (or a gradient shaped like the output, called
    ``base_name`` in messages) as C-contiguous arrays of ``dtype``, shapes
    checked. x may have leading dimensions, as torch's Linear takes
    ([batch, seq, in_dim]): they are flattened into tokens. No tokens
    (a leading dimension of 0) is allowed: the result is empty."""
    xs = host_activation(x, "x", dtype)
    if xs.ndim < 1 or xs.shape[-1] < 1:
        raise BindingError(f"x: expected shape (in_dim,) or (..., in_dim) with in_dim >= 1, "
                           f"got {xs.shape}")
    am = host_matrix(a, "a", "[rank, in_dim]", dtype)
    bm = host_matrix(b, "b", "[out_dim, rank]", dtype)
    if bm.shape[1] != am.shape[0]:
        raise BindingError(f"b: a is [rank, in_dim] = {list(am.shape)}, so b must be "
                           f"[out_dim, {am.shape[0]}], got {list(bm.shape)}")
    if xs.shape[-1] != am.shape[1]:
        raise BindingError(f"x: a is [rank, in_dim] = {list(am.shape)}, so x must end in "
                           f"{am.shape[1]}, got shape {xs.shape}")
    shape = xs.shape[:-1] + (bm.shape[0],)
    if base is None:
        out = np.zeros(shape, dtype)
    else:
        out = host_activation(base, base_name, dtype)
        if out.shape != shape:
            raise BindingError(f"{base_name}: expected shape {shape} (x.shape[:-1] + "
                               f"(out_dim,)), got {out.shape}")
    if xs.ndim > 2:
        xs, out = xs.reshape(-1, xs.shape[-1]), out.reshape(-1, shape[-1])
    return HostProblem(xs, am, bm, out, shape)


def scale_of(alpha, scale, rank: float) -> float:
    """``scale``, else ``alpha / rank`` (rank: rsLoRA's sqrt(rank) where it says so), else 1."""
    if alpha is not None and scale is not None:
        raise ValueError("give alpha or scale, not both (scale = alpha / rank)")
    if scale is None and alpha is not None:
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
            raise TypeError(f"alpha: expected a real number, got {alpha!r}")
        scale = float(alpha) / rank
    return scale_value(1.0 if scale is None else scale)
