"""Caches for shader modules, layouts, pipelines and bind groups.

Creating any of these costs far more than a dispatch, so each is made once:
modules by ``kernel.cache_key``, pipelines by (cache_key, entry point,
overrides, dynamic), bind groups by (layout, buffer ids); ``dynamic`` is the
uniform ring's layout, whose uniform bindings take dynamic offsets. Buffer ids
are never reused and entries holding a buffer are dropped when it is released,
so a cache hit can never hand back a bind group of a dead buffer.

Nothing is evicted on its own: every new kernel (a lora weight of a new
in_dim) adds a module and a pipeline. :func:`clear_pipeline_caches` (called
by ``lora.clear_plan_cache()``) or ``Device.clear_pipeline_cache()`` drops
them all; a kernel dispatched afterwards compiles again, so a plan still held
keeps working (its first dispatch pays the compile).
"""
from __future__ import annotations

import re
import weakref

import wgpu

from ..errors import WGSLCompileError
from .wgpu_build import COMPILER

_ACCESS_TO_TYPE = {
    "read": wgpu.BufferBindingType.read_only_storage,
    "read_write": wgpu.BufferBindingType.storage,
    "uniform": wgpu.BufferBindingType.uniform,
}

# naga: "┌─ wgsl:3:7" (parse errors) or "┌─ :6:12" (validation); Tint: "name:3:7 error",
# or under wgpudawn "Error while parsing WGSL: :10:18 error: ..." (no file name).
_LOCATION_RES = (re.compile(r"─\s*(?:wgsl)?[^\s:]*:(\d+):(\d+)"),
                 re.compile(r"wgsl:(\d+):(\d+)"),
                 re.compile(r"(?:^|\s)[^\s:]*:(\d+):(\d+) error"),
                 re.compile(r"(?m)^\S*?:(\d+):(\d+)"))


def error_location(message: str) -> tuple[int | None, int | None]:
    """(line, column), 1-based, that a compiler message blames, or (None, None)."""
    for pattern in _LOCATION_RES:
        m = pattern.search(message)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None, None


def excerpt(wgsl: str, line: int, column: int | None = None, context: int = 3) -> str:
    """Numbered WGSL lines around ``line`` with a caret under ``column``."""
    lines = wgsl.splitlines()
    if not 1 <= line <= len(lines):
        return ""
    lo, hi = max(1, line - context), min(len(lines), line + context)
    width = len(str(hi))
    out = []
    for n in range(lo, hi + 1):
        mark = ">" if n == line else " "
        out.append(f"{mark} {n:>{width}} | {lines[n - 1]}")
        if n == line and column:
            out.append(f"  {' ' * width} | {' ' * (column - 1)}^")
    return "\n".join(out)


_FRAME = re.compile(r"^(┌─|│|\d+\s*│)")


def summarize(message: str) -> str:
    """The compiler's verdict lines, without wgpu's framing or naga's code frame."""
    keep = []
    for raw in message.splitlines():
        s = raw.strip()
        if (not s or s in ("Validation Error", "Caused by:") or s.startswith("In wgpu")
                or _FRAME.match(s)):
            continue
        keep.append(s[2:] if s.startswith("= ") else s)
    # naga repeats its notes at the end; keep each once, in order.
    return "; ".join(dict.fromkeys(keep)) or message.strip()


def compile_error(kernel, err: Exception) -> WGSLCompileError:
    message = str(err)
    line, column = error_location(message)
    python_line = kernel.python_line(line, COMPILER) if line is not None else None
    return WGSLCompileError(summarize(message), kernel_name=kernel.name, wgsl_line=line,
                            python_line=python_line,
                            excerpt=excerpt(kernel.wgsl_for(COMPILER), line, column)
                            if line else "")


_OWNERS: "weakref.WeakSet" = weakref.WeakSet()  # the devices that hold a PipelineCache


def clear_pipeline_caches() -> int:
    """Empty every device's pipeline cache through its ``clear_pipeline_cache()``
    (which also drops what the device keeps per kernel); the pipelines dropped."""
    return sum(owner.clear_pipeline_cache() for owner in list(_OWNERS))


class PipelineCache:
    """Everything compiled for one wgpu device, plus counters for tests.
    ``owner``: the device, whose ``clear_pipeline_cache()``
    :func:`clear_pipeline_caches` calls."""

    def __init__(self, wgpu_device, stats: dict, owner=None):
        self.wgpu_device = wgpu_device
        self.stats = stats
        self.modules: dict = {}
        self.layouts: dict = {}
        self.pipelines: dict = {}
        self.bind_groups: dict = {}
        # buffer id -> [(dict, key)] of every entry that holds that buffer.
        self._holders: dict[int, list] = {}
        if owner is not None:
            _OWNERS.add(owner)

    def clear(self) -> int:
        """Drop every module, pipeline and bind group (layouts are few and
        stay); the number of pipelines dropped. Call it between batches."""
        dropped = len(self.pipelines)
        for table in (self.modules, self.pipelines, self.bind_groups, self._holders):
            table.clear()
        return dropped

    def module(self, kernel):
        key = kernel.cache_key
        mod = self.modules.get(key)
        if mod is None:
            try:
                mod = self.wgpu_device.create_shader_module(label=kernel.name,
                                                            code=kernel.wgsl_for(COMPILER))
            except wgpu.GPUError as err:
                raise compile_error(kernel, err) from None
            self.modules[key] = mod
            self.stats["modules"] += 1
        return mod

    def layout(self, kernel, dynamic: bool = False):
        """(bind group layout, pipeline layout, key) from the binding table.

        Explicit, never ``layout="auto"``: auto drops bindings the entry point
        does not use, and the bind group then fails to match. ``dynamic``: the
        uniform bindings take dynamic offsets (the uniform ring's layout).
        """
        key = tuple((b.index, b.access) for b in kernel.bindings)
        if dynamic:
            key += ("dynamic",)
        hit = self.layouts.get(key)
        if hit is None:
            entries = [{"binding": b.index, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": _ACCESS_TO_TYPE[b.access]}} for b in kernel.bindings]
            if dynamic:
                for entry, b in zip(entries, kernel.bindings):
                    entry["buffer"]["has_dynamic_offset"] = b.access == "uniform"
            bgl = self.wgpu_device.create_bind_group_layout(entries=entries)
            pl = self.wgpu_device.create_pipeline_layout(bind_group_layouts=[bgl])
            hit = self.layouts[key] = (bgl, pl, key)
        return hit

    def pipeline(self, kernel, overrides: tuple, dynamic: bool = False):
        key = (kernel.cache_key, kernel.entry_point, overrides, dynamic)
        pipe = self.pipelines.get(key)
        if pipe is None:
            module = self.module(kernel)
            _, pl, _ = self.layout(kernel, dynamic)
            compute = {"module": module, "entry_point": kernel.entry_point}
            if overrides:
                compute["constants"] = dict(overrides)
            try:
                pipe = self.wgpu_device.create_compute_pipeline(layout=pl, compute=compute)
            except wgpu.GPUError as err:
                raise compile_error(kernel, err) from None
            self.pipelines[key] = pipe
            self.stats["pipelines"] += 1
        return pipe

    def bind_group(self, kernel, buffers: list):
        bgl, _, lkey = self.layout(kernel)
        key = (lkey, tuple(b.id for b in buffers))
        group = self.bind_groups.get(key)
        if group is None:
            entries = [{"binding": b.index, "resource": {"buffer": buf._wgpu_buffer, "offset": 0,
                                                         "size": buf._wgpu_buffer.size}}
                       for b, buf in zip(kernel.bindings, buffers)]
            group = self.wgpu_device.create_bind_group(layout=bgl, entries=entries)
            self.remember(self.bind_groups, key, group, buffers)
            self.stats["bind_groups"] += 1
        return group

    def dynamic_group(self, kernel, resources: list):
        """Bind group of the dynamic layout; ``resources``: (buffer or ring chunk,
        bytes bound) in binding order. Uniform offsets come with each dispatch."""
        bgl, _, lkey = self.layout(kernel, dynamic=True)
        holders = [r for r, _ in resources]
        key = (lkey, tuple(r.id for r in holders))
        group = self.bind_groups.get(key)
        if group is None:
            entries = [{"binding": b.index, "resource": {"buffer": r._wgpu_buffer, "offset": 0,
                                                         "size": size}}
                       for b, (r, size) in zip(kernel.bindings, resources)]
            group = self.wgpu_device.create_bind_group(layout=bgl, entries=entries)
            self.remember(self.bind_groups, key, group, holders)
            self.stats["bind_groups"] += 1
        return group

    def remember(self, table: dict, key, value, buffers) -> None:
        """Store ``table[key] = value`` and forget it when any buffer is released."""
        table[key] = value
        for buf in buffers:
            self._holders.setdefault(buf.id, []).append((table, key))

    def forget_buffer(self, buffer_id: int) -> None:
        for table, key in self._holders.pop(buffer_id, ()):
            table.pop(key, None)
