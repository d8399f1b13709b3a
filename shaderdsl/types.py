"""WGSL types as Python values.

Every expression of the DSL carries one of these, so a type mismatch is caught
when the expression is built, not when the WGSL compiler reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, ClassVar

import numpy as np

from .errors import ShaderTypeError, is_positive_int


class WType:
    """Base of all WGSL types; ``str(t)`` is the WGSL spelling."""

    name: str

    def __str__(self) -> str:
        return self.name

    @property
    def is_numeric(self) -> bool:
        return False


@dataclass(frozen=True)
class Scalar(WType):
    name: str
    # f32(x), vec4f(a, b, c, d): scalar and vector types double as conversions.
    # The expressions they make are shaderdsl.expr's (a layer above), which sets
    # __call__ when imported (import shaderdsl does).
    __call__: ClassVar[Callable[..., Any]]

    @property
    def is_float(self) -> bool:
        return self.name in ("f32", "f16")

    @property
    def is_int(self) -> bool:
        return self.name in ("i32", "u32")

    @property
    def is_numeric(self) -> bool:
        return self.name != "bool"

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Vector(WType):
    size: int
    scalar: Scalar
    __call__: ClassVar[Callable[..., Any]]

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"vec{self.size}<{self.scalar.name}>"

    @property
    def is_numeric(self) -> bool:
        return self.scalar.is_numeric

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Array(WType):
    """``array<elem, length>``; ``length=None`` is a runtime-sized array."""

    elem: WType
    length: int | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        if self.length is None:
            return f"array<{self.elem.name}>"
        return f"array<{self.elem.name}, {self.length}>"

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Atomic(WType):
    scalar: Scalar

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"atomic<{self.scalar.name}>"

    def __repr__(self) -> str:
        return self.name


class MatrixKind(StrEnum):
    LEFT = "left"      # K cols, M rows: the A of A @ B
    RIGHT = "right"    # N cols, K rows: the B
    RESULT = "result"  # N cols, M rows


@dataclass(frozen=True)
class SubgroupMatrix(WType):
    """``subgroup_matrix_{kind}<component, cols, rows>`` (Dawn's WGSL extension
    chromium_experimental_subgroup_matrix): a matrix held by a whole subgroup,
    each invocation a part of it, changed only by subgroup-wide builtins.
    ``kind`` is left (K cols, M rows), right (N, K) or result (N, M);
    ``component`` f32, f16, i32, u32, or i8/u8 (left and right only)."""

    kind: MatrixKind
    component: str
    cols: int
    rows: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"subgroup_matrix_{self.kind}<{self.component}, {self.cols}, {self.rows}>"

    @property
    def is_8bit(self) -> bool:
        return self.component in ("i8", "u8")

    def __repr__(self) -> str:
        return self.name


MATRIX_COMPONENTS = ("f32", "f16", "i32", "u32", "i8", "u8")
SUBGROUP_MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"  # Dawn's feature name


def _subgroup_matrix(kind: MatrixKind, component, cols, rows) -> SubgroupMatrix:
    c = component.name if isinstance(component, Scalar) else component
    if c not in MATRIX_COMPONENTS or (c in ("i8", "u8") and kind == MatrixKind.RESULT):
        allowed = MATRIX_COMPONENTS if kind != MatrixKind.RESULT else MATRIX_COMPONENTS[:4]
        raise ShaderTypeError(f"subgroup_matrix_{kind} component must be one of {allowed}, "
                              f"got {component!r}")
    for n in (cols, rows):
        if not is_positive_int(n):
            raise ShaderTypeError(f"subgroup_matrix_{kind} sizes must be positive ints, "
                                  f"got {cols!r}, {rows!r}")
    return SubgroupMatrix(kind, c, int(cols), int(rows))


def subgroup_matrix_left(component, k: int, m: int) -> SubgroupMatrix:
    """``subgroup_matrix_left<T, K, M>``: M rows, K columns (the A of A @ B)."""
    return _subgroup_matrix(MatrixKind.LEFT, component, k, m)


def subgroup_matrix_right(component, n: int, k: int) -> SubgroupMatrix:
    """``subgroup_matrix_right<T, N, K>``: K rows, N columns (the B of A @ B)."""
    return _subgroup_matrix(MatrixKind.RIGHT, component, n, k)


def subgroup_matrix_result(component, n: int, m: int) -> SubgroupMatrix:
    """``subgroup_matrix_result<T, N, M>``: M rows, N columns."""
    return _subgroup_matrix(MatrixKind.RESULT, component, n, m)


@dataclass(frozen=True)
class MatrixConfig:
    """One shape an adapter's subgroup matrices come in (Dawn's
    ``subgroup_matrix_configs``): an M x K left and a K x N right of
    ``component`` multiply into an M x N result of ``result``, on subgroups
    of ``subgroup_sizes`` (min, max). A device's ``subgroup_matrix_configs``
    lists them; kernels pick their tile shapes from them."""

    component: str
    result: str
    m: int
    n: int
    k: int
    subgroup_sizes: tuple = (32, 32)

    def types(self) -> tuple[SubgroupMatrix, SubgroupMatrix, SubgroupMatrix]:
        """(left, right, result) matrix types of this shape."""
        return (subgroup_matrix_left(self.component, self.k, self.m),
                subgroup_matrix_right(self.component, self.n, self.k),
                subgroup_matrix_result(self.result, self.n, self.m))

    def __str__(self) -> str:
        return f"{self.component}->{self.result} {self.m}x{self.n}x{self.k}"


def matrix_config(configs, component: str, result: str, m: int | None = None,
                  n: int | None = None) -> MatrixConfig | None:
    """The first of ``configs`` with these component types (and M, N where
    given), or None where the adapter has no such shape."""
    for c in configs:
        if (c.component, c.result) == (component, result) and m in (None, c.m) and \
                n in (None, c.n):
            return c
    return None


f32 = Scalar("f32")
f16 = Scalar("f16")
i32 = Scalar("i32")
u32 = Scalar("u32")
bool_ = Scalar("bool")

SCALARS = {"f32": f32, "f16": f16, "i32": i32, "u32": u32, "bool": bool_}


def vec2(s: Scalar) -> Vector:
    return Vector(2, s)


def vec3(s: Scalar) -> Vector:
    return Vector(3, s)


def vec4(s: Scalar) -> Vector:
    return Vector(4, s)


def array(elem: WType, length: int | None = None) -> Array:
    if isinstance(elem, SubgroupMatrix):
        raise ShaderTypeError(f"{elem} cannot be an array element, a buffer element or "
                              f"workgroup memory: a subgroup matrix lives in a let or var; "
                              f"load and store it with subgroup_matrix_load/store")
    if length is not None and not is_positive_int(length):
        raise ShaderTypeError(f"array length must be a positive int or None, got {length!r}")
    return Array(elem, None if length is None else int(length))


def atomic(s: Scalar) -> Atomic:
    if s not in (u32, i32):
        raise ShaderTypeError(f"atomic<T> needs T = u32 or i32, got {s}")
    return Atomic(s)


vec2f, vec3f, vec4f = vec2(f32), vec3(f32), vec4(f32)
vec2h, vec3h, vec4h = vec2(f16), vec3(f16), vec4(f16)
vec2i, vec3i, vec4i = vec2(i32), vec3(i32), vec4(i32)
vec2u, vec3u, vec4u = vec2(u32), vec3(u32), vec4(u32)


def scalar_of(t: WType) -> Scalar | None:
    """The scalar component type of a scalar, vector or atomic; else None."""
    if isinstance(t, Scalar):
        return t
    if isinstance(t, (Vector, Atomic)):
        return t.scalar
    return None


def component(t: WType) -> Scalar:
    """The scalar component type of a scalar, vector or atomic type (for a type
    a rule has already checked to be one)."""
    s = scalar_of(t)
    if s is None:
        raise TypeError(f"{t} has no scalar component type")
    return s


def uses_f16(t: WType) -> bool:
    if isinstance(t, Array):
        return uses_f16(t.elem)
    if isinstance(t, SubgroupMatrix):
        return t.component == "f16"
    return scalar_of(t) == f16


# The numpy dtype of each scalar type: a value in the interpreter, an element
# of a buffer on the host (bool is not host-shareable) ...
DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i32": np.dtype(np.int32),
          "u32": np.dtype(np.uint32), "bool": np.dtype(np.bool_)}
# ... and of the components of subgroup matrices (8-bit ones too).
MATRIX_DTYPES = {**DTYPES, "i8": np.dtype(np.int8), "u8": np.dtype(np.uint8)}


def numpy_dtype(t: WType) -> np.dtype:
    """The numpy dtype of one component of a host-shareable element type:
    what a numpy array must look like to fill a buffer of this type."""
    s = scalar_of(t)
    if s is None or s == bool_:
        raise TypeError(f"{t} is not host-shareable (no numpy dtype)")
    return DTYPES[s.name]


def size_and_align(t: WType) -> tuple[int, int]:
    """Byte size and alignment under WGSL's storage layout rules."""
    if isinstance(t, (Scalar, Atomic)):
        s = scalar_of(t)
        if s == bool_:
            raise TypeError("bool is not host-shareable")
        return (2, 2) if s == f16 else (4, 4)
    if isinstance(t, Vector):
        c, _ = size_and_align(t.scalar)
        align = c * (4 if t.size >= 3 else 2)
        return c * t.size, align
    if isinstance(t, Array):
        size, align = size_and_align(t.elem)
        stride = -(-size // align) * align
        return (stride * t.length if t.length else stride), align
    raise TypeError(f"no layout for {t}")


def stride(t: WType) -> int:
    """Bytes between consecutive elements of ``array<t>``."""
    size, align = size_and_align(t)
    return -(-size // align) * align


def components(t: WType) -> int:
    """Number of scalar components in one element (vec3 counts 3)."""
    return t.size if isinstance(t, Vector) else 1


def parse(name: str) -> WType:
    """Parse a WGSL type spelling such as ``f32`` or ``vec4<u32>`` (for the CLI)."""
    name = name.replace(" ", "")
    if name in SCALARS:
        return SCALARS[name]
    for n in (2, 3, 4):
        pre = f"vec{n}<"
        if name.startswith(pre) and name.endswith(">") and name[len(pre):-1] in SCALARS:
            return Vector(n, SCALARS[name[len(pre):-1]])
    raise ValueError(f"unknown WGSL type {name!r}")
