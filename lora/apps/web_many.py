"""Many adapters in one batch, for web pages: ``python -m lora export --many``.

The module is the Python pool's forward, not a rewrite of it: for each form
``lora.core.many_plan.chosen_form`` can name, a :class:`lora.AdapterPool`
and its :class:`lora.ManyPlan` with that form's CANDIDATES options are built
on a :class:`web_export.Recorder` (WebGPU's default limits, so every browser
takes the kernels; an option over them is cut to the nearest that fits, as
``forward_many`` cuts it, and the module says so in ``forms[name].fitted``),
and each plan's compiled steps give the module its kernels, the buffer at
each binding and the grid (the registry's rule, checked here to be one
workgroup per work item along one axis, so the page computes it for any row
count). The rule's constants and the form of each of its cases are read off
many_plan into ``config.rule``; the JavaScript (web_assets/many.mjs) keeps
the pool (``createPool``: add, remove) and records the forward
(``pool.record``), picking the form per batch as chosen_form does, checking
and routing the ids as ``many_plan`` does, with the same messages.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from shaderdsl.export import js_object, kernel_info

from ..core.many import form_options
from ..core.many_plan import (
    CANDIDATES,
    FUSED_RANK,
    FUSED_ROWS,
    SEGMENT_ROWS,
    ManyPlan,
    chosen_form,
    most_tokens,
)
from ..core.pool import AdapterPool
from ..kernels.many import shared_floats
from .web_export import Recorder, module_code, module_types

# buffers many.mjs binds: the pool's, the batch's, the route's (ids for rows, order and
# tiles for segments) and the split forms' f32 scratch h
ROLES = {"A", "B", "table", "x", "output", "tokens", "ids", "order", "tiles", "h"}


def rule() -> dict:
    """chosen_form's constants and the form it names in each of its three
    cases, read off it (tests/test_many_js.py checks the page's rule against
    chosen_form on a table of batches)."""
    return {"segmentRows": SEGMENT_ROWS, "fusedRows": FUSED_ROWS, "fusedRank": FUSED_RANK,
            "decode": chosen_form(1, 1, 0.0),  # fewer than segmentRows rows per adapter
            "prefill": chosen_form(SEGMENT_ROWS, 1, 0.0),
            "highRank": chosen_form(max(FUSED_ROWS, SEGMENT_ROWS), 1, float(FUSED_RANK))}


def shipped_forms() -> list[str]:
    """The forms the module ships: those chosen_form names, each once."""
    r = rule()
    return list(dict.fromkeys([r["decode"], r["prefill"], r["highRank"]]))


@dataclass(frozen=True)
class ManyShape:
    """The pool's layer, baked into the module's kernels: ``in_dim ->
    out_dim``, stored as ``dtype`` ("f32" or "f16"), ranks up to ``max_rank``."""

    in_dim: int
    out_dim: int
    dtype: str = "f32"
    max_rank: int = 64

    @property
    def rank_stride(self) -> int:
        """The kernels' max_rank (the f32s of h per row): max_rank rounded up
        to a multiple of the shipped forms' rank blocks, which must divide it
        (as forward_many rounds its pool's)."""
        blocks = [CANDIDATES[name].get("rank_block", 0) for name in shipped_forms()]
        step = math.lcm(4, *[b for b in blocks if b])
        return -(-self.max_rank // step) * step


def form_plan(shape: ManyShape, name: str) -> tuple[ManyPlan, dict, str]:
    """The plan of the form ``name`` on a pool of ``shape`` on a Recorder (its
    checks run here: dims, workgroup memory and binding sizes against
    WebGPU's default limits), its options, and what was cut of them to fit
    those limits ("" if nothing)."""
    if shape.dtype == "f16" and (shape.in_dim % 2 or shape.out_dim % 2):
        raise ValueError(f"--many with f16: in_dim ({shape.in_dim}) and out_dim "
                         f"({shape.out_dim}) must be even (the page writes adapters with "
                         f"queue.writeBuffer, at offsets of whole 4 bytes)")
    if not isinstance(shape.max_rank, int) or shape.max_rank < 4 or shape.max_rank % 4:
        raise ValueError(f"--many: max_rank must be a multiple of 4, got {shape.max_rank!r}")
    dev = Recorder(features=["shader-f16"] if shape.dtype == "f16" else [])
    dtype = {"f32": np.float32, "f16": np.float16}[shape.dtype]
    stride = shape.rank_stride
    pool = AdapterPool(dev, shape.in_dim, shape.out_dim, dtype=dtype, max_rank=stride,
                       slots=1, rows=stride)
    options = form_options(dev, name, stride)
    rows = min(most_tokens(dev, pool),  # rows whose x, output and h fit one binding
               dev.limits["max-storage-buffer-binding-size"] // (4 * stride))
    return pool.forward_plan(rows, **options), options, fitted(dev, name, options, stride)


def fitted(dev, name: str, options: dict, stride: int) -> str:
    """What form_options cut of CANDIDATES[name] to fit ``dev``, and why ("" if nothing)."""
    want = CANDIDATES[name].get("tile_tokens")
    if options.get("tile_tokens") == want:
        return ""
    floats = shared_floats(options.get("threads", 256), stride, want, options["fused"])
    return (f"tile_tokens {want} -> {options['tile_tokens']}: {want} rows' workgroup memory "
            f"({4 * floats} bytes) is over maxComputeWorkgroupStorageSize = "
            f"{dev.limits['max-compute-workgroup-storage-size']}")


def items_axis(step) -> tuple[list, int]:
    """(grid at one item, the axis that counts items) of a run-time step,
    refused unless its grid rule puts one workgroup per item on that axis."""
    base = list(step.rule(1))
    for axis in range(3):
        if all(list(step.rule(n)) == base[:axis] + [n] + base[axis + 1:] for n in (1, 2, 7, 300)):
            return base, axis
    raise ValueError(f"kernel {step.kernel.name!r}: its grid is not one workgroup per item along "
                     f"one axis; the page computes only such grids")


def many_steps(plan: ManyPlan, kernels: list) -> list:
    """The steps of the plan's form: per dispatch its kernel's index in
    ``kernels`` (added there if new), the grid at one item and the axis of
    the items, the role at each binding."""
    steps = []
    for step in plan.steps(plan.segments, False):
        unknown = set(step.roles) - ROLES
        if unknown:
            raise ValueError(f"kernel {step.kernel.name!r} binds {sorted(unknown)}; the page "
                             f"makes {sorted(ROLES)} only")
        if step.kernel not in kernels:
            kernels.append(step.kernel)
        grid, axis = items_axis(step)
        steps.append({"kernel": kernels.index(step.kernel), "grid": grid, "items": axis,
                      "buffers": {b.name: role for b, role in zip(step.kernel.bindings,
                                                                  step.roles)}})
    return steps


def module_forms(shape: ManyShape) -> tuple[list, dict]:
    """(kernels, forms): per shipped form its ManyPlan options as shipped,
    tile rows, whether it needs h, what was cut to fit, and its steps."""
    kernels: list = []
    forms = {}
    for name in shipped_forms():
        plan, options, cut = form_plan(shape, name)
        forms[name] = {"segments": plan.segments, "fused": plan.fused,
                       "tileTokens": plan.tile_tokens if plan.segments else 1,
                       "options": options,
                       "fitted": cut or None, "steps": many_steps(plan, kernels)}
    return kernels, forms


def module_js(shape: ManyShape, command: str = "") -> str:
    """The ES module: config, forms, kernels, the runtime, createPool."""
    kernels, forms = module_forms(shape)
    config = {"inDim": shape.in_dim, "outDim": shape.out_dim, "dtype": shape.dtype,
              "maxRank": shape.max_rank, "rankStride": shape.rank_stride, "rule": rule(),
              "features": sorted({f for k in kernels for f in kernel_info(k)["features"]})}
    body = ",\n".join("  " + js_object(kernel_info(k), "  ") for k in kernels)
    made = f"`{command}`" if command else "lora.apps.web_many"
    return (f"// lora_many.js: generated by {made}.\n"
            f"// output += scale_i * B_i @ (A_i @ x) for each row's adapter i of a pool, on "
            f"GPUBuffers; standard WebGPU only. See docs/browser.md.\n\n"
            f"export const config = {json.dumps(config)};\n"
            f"export const forms = {{\n" +
            "".join(f"  {json.dumps(n)}: {json.dumps(f)},\n" for n, f in forms.items()) +
            "};\n"
            f"export const kernels = [\n{body},\n];\n\n{module_code('many.mjs')}")


def module_dts(command: str = "") -> str:
    made = f"`{command}`" if command else "lora.apps.web_many"
    return f"// lora_many.d.ts: generated by {made}.\n{module_types('many.d.ts')}"
