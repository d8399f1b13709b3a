"""Plans: a LoRA forward resolved once to kernels, buffers and grids.

Recording a Plan is nothing but ``device.dispatch`` calls with arguments
fixed in advance: no WGSL generation, no kernel lookup, no shape logic. This
is the hot path when the same layer runs again and again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shaderdsl.errors import AliasingError, BindingError, FeatureError
from shaderdsl.runtime import Buffer

from . import kernels as K
from .weight import check_f16, wgsl_dtype

STRATEGIES = ("seed", "split", "fused", "tiled")


@dataclass(frozen=True)
class Strategy:
    """How to run one forward.

    ``seed``: Hesper's design, h by one thread per element, then fused B-add (2 dispatches).
    ``split``: h by one workgroup per token (or per token and ``rank_group``
    ranks) with a workgroup reduction, then fused B-add (2).
    ``fused``: one dispatch; each workgroup recomputes h and adds its slice of outputs.
    ``tiled``: one dispatch; each workgroup takes ``tile_tokens`` tokens and all outputs,
    each thread of its first phase ``token_block`` tokens at a time.
    """

    name: str = "fused"
    threads: int = 256
    outputs_per_thread: int = 1
    subgroups: bool = False
    tile_tokens: int = 16
    unroll: bool = True  # fused/tiled: unroll column loops in Python ("loop" in the text: don't)
    rank_group: int = 0  # split: ranks per workgroup of project_a (0: all)
    token_block: int = 1  # tiled: tokens per thread while computing h

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.name!r}")
        if self.threads < 1 or self.threads & (self.threads - 1):
            raise ValueError(f"threads must be a power of two, got {self.threads}")
        if self.outputs_per_thread < 1:
            raise ValueError(f"outputs_per_thread must be >= 1, got {self.outputs_per_thread}")
        if self.name == "tiled" and (self.tile_tokens < 1 or self.threads % self.tile_tokens):
            raise ValueError(f"tile_tokens must divide threads, got {self.tile_tokens} "
                             f"and {self.threads}")
        if self.rank_group < 0 or (self.rank_group and self.name != "split"):
            raise ValueError(f"rank_group applies to the split strategy only and must be >= 0, "
                             f"got {self.rank_group} for {self.name!r}")
        if self.token_block != 1 and (self.name != "tiled" or self.token_block < 1
                                      or self.tile_tokens % self.token_block):
            raise ValueError(f"token_block applies to the tiled strategy only and must divide "
                             f"tile_tokens, got {self.token_block} for {self.name!r} with "
                             f"tile_tokens {self.tile_tokens}")
        if self.name == "seed" and self.subgroups:
            raise ValueError("the seed strategy has no subgroup form")
        if self.name == "tiled" and self.subgroups:
            raise ValueError("the tiled strategy reduces in workgroup memory; it has no subgroup form")

    def __str__(self) -> str:
        if self.name == "seed":
            return "seed"
        text = f"{self.name}:{self.threads}"
        if self.name == "split" and self.rank_group:
            text += f":{self.rank_group}"
        if self.name == "fused":
            text += f":{self.outputs_per_thread}"
        if self.name == "tiled":
            text += f":{self.tile_tokens}" + (f":{self.token_block}" if self.token_block != 1 else "")
        if self.name in ("fused", "tiled") and not self.unroll:
            text += ":loop"
        return text + (":sg" if self.subgroups else "")

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Inverse of str(): 'seed', 'split:256', 'split:256:8:sg', 'fused:256:2:sg',
        'tiled:256:16:loop', 'tiled:512:16:4'."""
        parts = text.split(":")
        sg = parts[-1] == "sg"
        if sg:
            parts = parts[:-1]
        unroll = parts[-1] != "loop"
        if not unroll:
            parts = parts[:-1]
        try:
            name, nums = parts[0], [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"cannot parse strategy {text!r}; expected e.g. 'seed', "
                             f"'split:256', 'fused:256:1', 'fused:256:1:sg' or 'tiled:256:16'") from None
        if name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r} in {text!r}")
        keys = {"seed": (), "split": ("threads", "rank_group"),
                "fused": ("threads", "outputs_per_thread"),
                "tiled": ("threads", "tile_tokens", "token_block")}[name]
        if len(nums) > len(keys):
            raise ValueError(f"strategy {text!r}: {name!r} takes at most {len(keys)} number(s) "
                             f"({', '.join(keys) or 'none'})")
        return cls(name, subgroups=sg, unroll=unroll, **dict(zip(keys, nums)))


class Plan:
    """One forward ``output += scale * B @ (A @ x)`` for fixed shapes, ready to
    record. x and output are stored like the weight (float32 or float16)."""

    def __init__(self, device, weight, scale: float, tokens: int, strategy: Strategy):
        if strategy.subgroups and not device.has_feature("subgroup"):
            raise FeatureError(f"strategy {strategy} needs the 'subgroup' feature, which "
                               f"{device.name!r} ({device.backend}) lacks")
        check_f16(device, weight.dtype, f"Plan {strategy}")
        self.device, self.weight, self.scale = device, weight, float(scale)
        self.tokens, self.strategy, self.dtype = tokens, strategy, weight.dtype
        r, i, o, t, s = weight.rank, weight.in_dim, weight.out_dim, tokens, strategy
        dt = wgsl_dtype(weight.dtype)
        self.x_shape = (i,) if t == 1 else (t, i)
        self.out_shape = (o,) if t == 1 else (t, o)
        # (dim,) and (1, dim) both hold one token
        self._shapes = {"input": {(t, i)} | ({(i,)} if t == 1 else set()),
                        "output": {(t, o)} | ({(o,)} if t == 1 else set())}
        b_threads = 256
        b_grid = (-(-o // b_threads), t, 1)
        if s.name == "fused":
            k = K.fused_forward_kernel(r, i, o, self.scale, t, s.threads, s.outputs_per_thread,
                                       s.subgroups, s.unroll, dt)
            grid = (-(-o // (s.threads * s.outputs_per_thread)), t, 1)
            self.steps = [(k, ("A", "x", "B", "output"), grid)]
            self.h = None
        elif s.name == "tiled":
            k = K.tiled_forward_kernel(r, i, o, self.scale, t, s.threads, s.tile_tokens, s.unroll,
                                       dt, s.token_block)
            self.steps = [(k, ("A", "x", "B", "output"), (-(-t // s.tile_tokens), 1, 1))]
            self.h = None
        else:
            if s.name == "seed":
                ka = K.project_a_kernel(r, i, t, strategy="seed", dtype=dt)
                a_grid = (-(-r // ka.workgroup_size[0]), t, 1)
            else:
                ka = K.project_a_kernel(r, i, t, threads=s.threads, subgroups=s.subgroups, dtype=dt,
                                        rank_group=s.rank_group)
                a_grid = (t, -(-r // s.rank_group) if 0 < s.rank_group < r else 1, 1)
            kb = K.fused_b_add_kernel(o, r, self.scale, t, b_threads, dt)
            self.h = device.empty((t, r), np.float32, name="lora_h")
            self.steps = [(ka, ("A", "x", "h"), a_grid), (kb, ("B", "h", "output"), b_grid)]
        self.dispatches = len(self.steps)
        self._grids = {k.name: g for k, _, g in self.steps}
        for k, _, _ in self.steps:
            device.prepare(k)

    def __repr__(self) -> str:
        w = self.weight
        return (f"<Plan {self.strategy} rank={w.rank} in={w.in_dim} out={w.out_dim} "
                f"tokens={self.tokens} scale={self.scale} {self.dtype.name}>")

    def check(self, x_buf, out_buf) -> None:
        """Shapes and dtypes of the activation buffers, before anything is recorded."""
        for what, buf, shape in (("input", x_buf, self.x_shape), ("output", out_buf, self.out_shape)):
            if not isinstance(buf, Buffer) or buf.device is not self.device or buf.released:
                got = repr(buf) if isinstance(buf, Buffer) else type(buf).__name__
                raise BindingError(f"{self!r}: {what} buffer must be a live Buffer on "
                                   f"{self.device!r}, got {got}")
            if buf.dtype != self.dtype or \
                    getattr(buf, "shape", None) not in self._shapes[what]:
                got = f"{getattr(buf, 'dtype', type(buf).__name__)} {getattr(buf, 'shape', '')}"
                raise BindingError(f"{self!r}: {what} buffer must be {self.dtype.name} {shape} "
                                   f"(the weight's dtype), got {got}")
        for name, buf in (("input", x_buf), ("weight A", self.weight.a), ("weight B", self.weight.b)):
            if out_buf is buf:
                raise AliasingError(f"{self!r}: the output buffer is also the {name} buffer")

    def record(self, x_buf, out_buf) -> None:
        """Dispatch the forward; several dispatches go out in one submit (or join
        the open batch). Call check() first for buffers not used before; the
        runtime validates bindings it has not seen."""
        buffers = {"A": self.weight.a, "B": self.weight.b, "x": x_buf, "output": out_buf,
                   "h": self.h}
        dispatch = self.device.dispatch
        if len(self.steps) == 1 or self.device.in_batch:
            for kernel, roles, grid in self.steps:
                dispatch(kernel, [buffers[r] for r in roles], grid)
            return
        with self.device.batch():
            for kernel, roles, grid in self.steps:
                dispatch(kernel, [buffers[r] for r in roles], grid)

    def __call__(self, x_buf, out_buf) -> None:
        self.check(x_buf, out_buf)
        self.record(x_buf, out_buf)
