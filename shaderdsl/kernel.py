"""Kernel: everything the runtime needs to run a generated shader.

A Kernel is plain data: WGSL text, the binding table, workgroup size,
required adapter features, override constants and a cache key. It never
touches a device, so it can be built, printed and compared on any machine.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

from .nodes import Module
from .types import WType, components, numpy_dtype, stride


@dataclass(frozen=True)
class Binding:
    """One ``@group(0) @binding(index)`` resource.

    ``access`` is ``"read"`` (storage, read), ``"read_write"`` (storage) or
    ``"uniform"``. For storage buffers ``elem`` is the array element type and
    ``length`` the element count (None: runtime-sized). For uniforms ``elem``
    is the whole uniform's type and ``length`` is None. ``shape``: a buffer
    declared with a shape, its sizes (ints, or the names of the overrides and
    uniforms that give them). ``holds``: the values a buffer's host data
    holds where the kernel reads their bits through u32 elements (f16 read
    as vec4<u32>, 16 bytes a read), else None: the host data's dtype is it.
    """

    index: int
    name: str
    access: str
    elem: WType
    length: int | None = None
    shape: tuple | None = None
    holds: WType | None = None

    @property
    def writable(self) -> bool:
        return self.access == "read_write"

    @property
    def dtype(self) -> np.dtype:
        return numpy_dtype(self.holds or self.elem)

    @property
    def elem_stride(self) -> int:
        return stride(self.elem)

    @property
    def components(self) -> int:
        return components(self.elem)

    @property
    def min_bytes(self) -> int:
        """Smallest buffer size that can back this binding."""
        return self.elem_stride * (self.length or 1)


@dataclass(frozen=True)
class Override:
    """A pipeline-overridable constant: ``override name: type = default;``."""

    name: str
    type: WType
    default: object = None


@dataclass(frozen=True)
class Kernel:
    name: str
    wgsl: str
    workgroup_size: tuple[int, int, int]
    bindings: tuple[Binding, ...]
    overrides: tuple[Override, ...] = ()
    features: frozenset[str] = frozenset()
    entry_point: str = "main"
    workgroup_bytes: int = 0  # var<workgroup> storage the kernel declares
    # (feature, "file.py:line") of the first line of the kernel function needing it.
    feature_lines: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    # (WGSL line number, "file.py:line") for each emitted statement line.
    source_map: tuple[tuple[int, str], ...] = field(default=(), compare=False, repr=False)
    # The tree the WGSL was printed from (shaderdsl.nodes.Module): what the
    # interpreter runs. None for a Kernel made from WGSL text alone.
    ir: Module | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def cache_key(self) -> str:
        """Identifies the compiled module: same key, same shader."""
        h = hashlib.sha256()
        h.update(self.entry_point.encode())
        h.update(b"\0")
        h.update(self.wgsl.encode())
        return h.hexdigest()[:32]

    @property
    def threads_per_workgroup(self) -> int:
        x, y, z = self.workgroup_size
        return x * y * z

    def binding(self, name: str) -> Binding:
        for b in self.bindings:
            if b.name == name:
                return b
        raise KeyError(f"kernel {self.name!r} has no binding {name!r}; it has "
                       f"{[b.name for b in self.bindings]}")

    def wgsl_for(self, compiler: str = "naga") -> str:
        """The WGSL text for one compiler: Tint (Dawn) requires ``enable subgroups;``
        where a kernel uses subgroup operations, naga (wgpu-native) rejects it."""
        if compiler == "tint" and "subgroup" in self.features:
            first, rest = self.wgsl.split("\n", 1)
            return f"{first}\nenable subgroups;\n{rest}"
        if compiler not in ("naga", "tint"):
            raise ValueError(f"compiler must be 'naga' or 'tint', got {compiler!r}")
        return self.wgsl

    def python_line(self, wgsl_line: int, compiler: str = "naga") -> str | None:
        """The Python 'file:line' that built the given WGSL line, if known."""
        if self.wgsl_for(compiler) is not self.wgsl:
            wgsl_line -= 1  # the inserted enable line
        best = None
        for line, where in self.source_map:
            if line == wgsl_line:
                return where
            if line < wgsl_line:
                best = where
        return best

    def __str__(self) -> str:
        return self.wgsl
