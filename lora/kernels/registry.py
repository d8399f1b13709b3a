"""The registry of LoRA kernels: each DSL function with its binding roles,
workgroup size and grid, so plans, the command line and the tests name a
kernel and its parameters, and nothing else computes a grid."""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

import shaderdsl as sd

from .common import ceil_div
from .forward import (add_scaled, fused_b_add, fused_forward, project_a_seed, project_a_workgroup,
                      project_b, tiled_forward)


@dataclass(frozen=True)
class KernelSpec:
    """One LoRA kernel: its DSL function, the role of each binding, its
    workgroup size and its grid, both computed from the parameters alone.

    ``kernel(**params)`` compiles it (cached by ``shaderdsl.compile``);
    ``grid(**params)`` is the workgroup count a dispatch needs. Parameters
    are the function's keyword parameters (defaults filled in), plus
    ``threads`` wherever the workgroup size is not one of them.
    """

    name: str
    function: Callable
    roles: tuple[str, ...]
    workgroup: Callable[[dict], int]
    grid_rule: Callable[[dict], tuple[int, int, int]]
    doc: str

    @property
    def parameter_names(self) -> set[str]:
        return set(inspect.signature(self.function).parameters) - {"m"} | {"threads"}

    def params(self, **given) -> dict:
        """``given`` over the function's defaults (and threads=256)."""
        sig = inspect.signature(self.function)
        out = {"threads": 256}
        out.update({k: p.default for k, p in sig.parameters.items()
                    if p.default is not inspect.Parameter.empty})
        unknown = set(given) - self.parameter_names
        if unknown:
            raise TypeError(f"kernel {self.name!r} takes no parameter(s) {sorted(unknown)}; "
                            f"it takes {sorted(self.parameter_names)}")
        out.update(given)
        return out

    def kernel(self, **given) -> sd.Kernel:
        p = self.params(**given)
        sig = inspect.signature(self.function).parameters
        name = self.name if p.get("dtype", "f32") == "f32" else f"{self.name}_{p['dtype']}"
        return sd.compile(self.function, self.workgroup(p), name=name,
                          **{k: v for k, v in p.items() if k in sig})

    def grid(self, **given) -> tuple[int, int, int]:
        return self.grid_rule(self.params(**given))


KERNELS = {spec.name: spec for spec in (
    KernelSpec("project_a_seed", project_a_seed, ("A", "x", "h"), lambda p: 64,
               lambda p: (ceil_div(p["rank"], 64), p["tokens"], 1),
               "h = A @ x, Hesper's design: one thread per element of h"),
    KernelSpec("project_a", project_a_workgroup, ("A", "x", "h"), lambda p: p["threads"],
               lambda p: (p["tokens"], ceil_div(p["rank"], p["rank_group"])
                          if 0 < p["rank_group"] < p["rank"] else 1, 1),
               "h = A @ x: one workgroup per token (and per group of ranks)"),
    KernelSpec("project_b", project_b, ("B", "h", "y"), lambda p: p["threads"],
               lambda p: (ceil_div(p["out_dim"], p["threads"]), p["tokens"], 1),
               "y = B @ h: one thread per element of y"),
    KernelSpec("add_scaled", add_scaled, ("y", "output"), lambda p: p["threads"],
               lambda p: (ceil_div(p["num_elements"], p["threads"]), 1, 1),
               "output += scale * y"),
    KernelSpec("fused_b_add", fused_b_add, ("B", "h", "output"), lambda p: p["threads"],
               lambda p: (ceil_div(p["out_dim"], p["threads"]), p["tokens"], 1),
               "output += scale * B @ h"),
    KernelSpec("fused_forward", fused_forward, ("A", "x", "B", "output"), lambda p: p["threads"],
               lambda p: (ceil_div(p["out_dim"], p["threads"] * p["outputs_per_thread"]),
                          p["tokens"], 1),
               "output += scale * B @ (A @ x), one dispatch, h recomputed per workgroup"),
    KernelSpec("tiled_forward", tiled_forward, ("A", "x", "B", "output"), lambda p: p["threads"],
               lambda p: (ceil_div(p["tokens"], p["tile_tokens"]), 1, 1),
               "output += scale * B @ (A @ x), one dispatch, a tile of tokens per workgroup"),
)}


def _deprecated(old: str, spec: str, adapt=lambda **kw: kw):
    def fn(*args, **kw):
        params = adapt(**dict(zip(_OLD_ORDER[old], args)), **kw)
        target = KERNELS[params.pop("spec", spec)]
        warnings.warn(f"lora.kernels.{old} is deprecated; use lora.kernels.KERNELS"
                      f"[{target.name!r}].kernel(...)", DeprecationWarning, stacklevel=2)
        return target.kernel(**{k: v for k, v in params.items() if k in target.parameter_names})
    fn.__name__ = old
    return fn


_OLD_ORDER = {
    "project_a_kernel": ("rank", "in_dim", "tokens", "strategy", "threads", "subgroups", "dtype",
                         "rank_group"),
    "project_b_kernel": ("out_dim", "rank", "tokens", "threads", "dtype"),
    "add_scaled_kernel": ("num_elements", "scale", "threads", "dtype"),
    "fused_b_add_kernel": ("out_dim", "rank", "scale", "tokens", "threads", "dtype"),
    "fused_forward_kernel": ("rank", "in_dim", "out_dim", "scale", "tokens", "threads",
                             "outputs_per_thread", "subgroups", "unroll", "dtype"),
    "tiled_forward_kernel": ("rank", "in_dim", "out_dim", "scale", "tokens", "threads",
                             "tile_tokens", "unroll", "dtype", "token_block"),
}


def _project_a_args(strategy="workgroup", rank_group=0, **kw):
    if strategy == "seed":
        return dict(kw, spec="project_a_seed")
    return dict(kw, rank_group=rank_group if 0 < rank_group < kw["rank"] else 0)


# The wrappers of the previous release, kept as aliases that warn.
project_a_kernel = _deprecated("project_a_kernel", "project_a", _project_a_args)
project_b_kernel = _deprecated("project_b_kernel", "project_b")
add_scaled_kernel = _deprecated("add_scaled_kernel", "add_scaled")
fused_b_add_kernel = _deprecated("fused_b_add_kernel", "fused_b_add")
fused_forward_kernel = _deprecated("fused_forward_kernel", "fused_forward")
tiled_forward_kernel = _deprecated("tiled_forward_kernel", "tiled_forward")
