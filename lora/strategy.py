"""Strategies: the one vocabulary for how a LoRA forward runs.

A strategy names the kernels of a forward and their parameters; its text
form (``str``/``parse``) is what the autotuner caches, ``LORA_STRATEGY`` and
``--strategy`` take, and the benchmark tables print:

============================  ===========  =================================================
text                          dispatches   kernels
============================  ===========  =================================================
``seed``                      2            project_a_seed (Hesper's design), fused_b_add
``three:T[:sg|:seed]``        3            project_a, project_b, add_scaled (Hesper's three)
``split:T[:G][:sg|:seed]``    2            project_a (per token, G ranks per workgroup), fused_b_add
``fused:T:O[:loop][:sg]``     1            fused_forward (h recomputed by every workgroup)
``tiled:T:TT[:B][:loop][:q]`` 1            tiled_forward (TT tokens per workgroup, B per thread)
``gemm:T:TT:S``               2            project_a_tiled (4 x 4 per thread, S slices of in_dim),
                                           tiled_b_add (TT tokens x 256 columns per workgroup)
============================  ===========  =================================================

``T`` is the workgroup size, ``sg`` reduces with subgroup operations,
``loop`` keeps column loops as WGSL loops instead of unrolling them, ``q``
gives each thread four adjacent output columns (read and written as vec4), and
``:seed`` computes h with Hesper's one-thread-per-element kernel (``seed``
is Hesper's whole design: that kernel, then fused_b_add with 256 threads).
"""
from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("seed", "three", "split", "fused", "tiled", "gemm")
GEMM_TILE_TOKENS = 32  # gemm's tiled_b_add keeps a vec4 per token of its tile in registers
_NUMBERS = {"seed": (), "three": ("threads",), "split": ("threads", "rank_group"),
            "fused": ("threads", "outputs_per_thread"),
            "tiled": ("threads", "tile_tokens", "token_block"),
            "gemm": ("threads", "tile_tokens", "splits")}


@dataclass(frozen=True)
class Strategy:
    """How to run one forward (see the module docstring for each name)."""

    name: str = "fused"
    threads: int = 256
    outputs_per_thread: int = 1
    subgroups: bool = False
    tile_tokens: int = 16
    unroll: bool = True  # fused/tiled: unroll column loops in Python ("loop" in the text: don't)
    rank_group: int = 0  # split: ranks per workgroup of project_a (0: all)
    token_block: int = 1  # tiled: tokens per thread while computing h
    projection: str = "workgroup"  # three/split: project_a by a workgroup per token, or "seed"
    splits: int = 1  # gemm: slices of in_dim that project_a_tiled sums separately
    quad: bool = False  # tiled: four adjacent output columns per thread ("q" in the text)

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.name!r}")
        if self.threads < 1 or self.threads & (self.threads - 1):
            raise ValueError(f"threads must be a power of two, got {self.threads}")
        if self.outputs_per_thread < 1:
            raise ValueError(f"outputs_per_thread must be >= 1, got {self.outputs_per_thread}")
        if self.splits < 1 or (self.splits != 1 and self.name != "gemm"):
            raise ValueError(f"splits applies to the gemm strategy only and must be >= 1, "
                             f"got {self.splits} for {self.name!r}")
        if self.quad and self.name != "tiled":
            raise ValueError(f"quad columns apply to the tiled strategy (gemm always writes "
                             f"vec4s), not {self.name!r}")
        if self.name == "gemm" and not 1 <= self.tile_tokens <= GEMM_TILE_TOKENS:
            raise ValueError(f"gemm: tile_tokens must be 1 to {GEMM_TILE_TOKENS} (a vec4 "
                             f"accumulator per token and thread), got {self.tile_tokens}")
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
        if self.projection not in ("workgroup", "seed") or \
                (self.projection == "seed" and self.name not in ("three", "split")):
            raise ValueError(f"projection 'seed' applies to the three and split strategies only, "
                             f"got {self.projection!r} for {self.name!r}")
        if self.rank_group and self.projection == "seed":
            raise ValueError(f"rank_group applies to the workgroup projection, not to "
                             f"Hesper's seed projection (split:T:{self.rank_group}:seed)")
        if self.subgroups and (self.name in ("seed", "tiled", "gemm") or
                               self.projection == "seed"):
            raise ValueError(f"the {self} strategy has no subgroup form"
                             if self.name not in ("tiled", "gemm")
                             else f"the {self.name} strategy has no subgroup form (it does not "
                                  f"reduce across lanes, or does so in workgroup memory)")

    @property
    def dispatches(self) -> int:
        return {"seed": 2, "three": 3, "split": 2, "gemm": 2}.get(self.name, 1)

    def scratch(self, save_h: bool = False) -> tuple[str, ...]:
        """The f32 buffers between dispatches: h [tokens, rank], y [tokens, out_dim]
        (and h for the backward when ``save_h``: the one-dispatch kernels then write it);
        gemm's hp [splits * tokens, rank] holds the slices of h (it is h when splits is 1)."""
        if self.name == "gemm":
            return ("h",) if self.splits == 1 else ("hp", "h") if save_h else ("hp",)
        return {"seed": ("h",), "split": ("h",), "three": ("h", "y")}.get(
            self.name, ("h",) if save_h else ())

    def kernels(self, rank: int, in_dim: int, out_dim: int, scale: float, tokens: int | None,
                dtype: str, save_h: bool = False) -> list[tuple[str, dict]]:
        """(name in lora.kernels.KERNELS, parameters) of each dispatch, in order;
        ``save_h``: h is left in the "h" buffer for the backward. ``tokens``
        None: the run-time forms, which read the token count from a uniform."""
        t, s = (256 if self.name == "seed" else self.threads), float(scale)
        shape = dict(rank=rank, in_dim=in_dim, tokens=tokens, dtype=dtype)
        fused_b = ("fused_b_add", dict(out_dim=out_dim, rank=rank, scale=s, tokens=tokens,
                                       threads=t, dtype=dtype))
        if self.name == "seed" or self.projection == "seed":
            project_a = ("project_a_seed", shape)
        else:
            group = self.rank_group if 0 < self.rank_group < rank else 0
            project_a = ("project_a", dict(shape, threads=t, subgroups=self.subgroups,
                                           rank_group=group))
        if self.name in ("seed", "split"):
            return [project_a, fused_b]
        if self.name == "three":
            count = dict(num_elements=tokens * out_dim) if tokens is not None else \
                dict(num_elements=None, columns=out_dim)  # run time: tokens * out_dim
            return [project_a,
                    ("project_b", dict(out_dim=out_dim, rank=rank, tokens=tokens, threads=t,
                                       dtype=dtype)),
                    ("add_scaled", dict(count, scale=s, threads=t, dtype=dtype))]
        both = dict(rank=rank, in_dim=in_dim, out_dim=out_dim, scale=s, tokens=tokens, threads=t,
                    unroll=self.unroll, dtype=dtype, **({"save_h": True} if save_h else {}))
        if self.name == "fused":
            return [("fused_forward", dict(both, outputs_per_thread=self.outputs_per_thread,
                                           subgroups=self.subgroups))]
        if self.name == "gemm":
            return self._gemm(rank, in_dim, out_dim, s, tokens, dtype, save_h)
        return [("tiled_forward", dict(both, tile_tokens=self.tile_tokens,
                                       token_block=self.token_block, quad=self.quad))]

    def _gemm(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h) -> list[tuple]:
        """project_a_tiled into hp (h itself when splits is 1), then tiled_b_add."""
        hp = {"hp": "h" if self.splits == 1 else "hp"}
        return [("project_a_tiled", dict(rank=rank, in_dim=in_dim, tokens=tokens,
                                         threads=self.threads, splits=self.splits, dtype=dtype),
                 hp),
                ("tiled_b_add", dict(out_dim=out_dim, rank=rank, scale=scale, tokens=tokens,
                                     tile_tokens=self.tile_tokens, splits=self.splits,
                                     dtype=dtype, save_h=save_h and self.splits > 1), hp)]

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
        if self.name == "gemm":
            text += f":{self.tile_tokens}:{self.splits}"
        if self.name in ("fused", "tiled") and not self.unroll:
            text += ":loop"
        if self.quad:
            text += ":q"
        if self.projection == "seed":
            text += ":seed"
        return text + (":sg" if self.subgroups else "")

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Inverse of str(): 'seed', 'three:256:seed', 'split:256:8:sg', 'fused:256:2:sg',
        'tiled:256:16:loop', 'tiled:512:16:4'."""
        parts = text.split(":")
        flags = {}
        for flag, key, value in (("sg", "subgroups", True), ("seed", "projection", "seed"),
                                 ("q", "quad", True), ("loop", "unroll", False)):
            if len(parts) > 1 and parts[-1] == flag:
                parts, flags[key] = parts[:-1], value
        try:
            name, nums = parts[0], [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"cannot parse strategy {text!r}; expected e.g. 'seed', "
                             f"'split:256', 'fused:256:1', 'fused:256:1:sg' or 'tiled:256:16'") from None
        if name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r} in {text!r}")
        keys = _NUMBERS[name]
        if len(nums) > len(keys):
            raise ValueError(f"strategy {text!r}: {name!r} takes at most {len(keys)} number(s) "
                             f"({', '.join(keys) or 'none'})")
        return cls(name, **flags, **dict(zip(keys, nums)))


BACKWARDS = ("seed", "fused", "split")
FUSED_TOKENS = 4  # the fused backward keeps tokens x rank sums per thread: for a few tokens
# From this many tokens x ranks, split computes dh with grad_dh_tiled (a vec4 of
# dh per thread, no reduction: 64K threads fill the GPU). On the H200 at rank 64,
# 4096 tokens it took 263 us against grad_dh's 918; at rank 8, 4096 tokens (8K
# threads) 222 us against 41.
TILED_DH_ELEMENTS = 1 << 18
PARTIAL_BYTES = 8 << 20  # at most this much of partial sums of dA or dB


@dataclass(frozen=True)
class Backward:
    """How to run one backward (dh, dB, dA and, when wanted, dx):

    ``seed``: Hesper's four kernels, one thread per element of each result (4 dispatches);
    ``fused:T``: dh and dB from one read of g, then dA and dx from one read of x
    (2 dispatches; up to FUSED_TOKENS tokens);
    ``split:T[:C[:G]][:sg]``: dh by a workgroup per token (and per G ranks), dB
    and dA over chunks of C tokens (0: as many as fill the GPU, then summed by
    a second kernel), dx (3 to 6 dispatches; any token count).
    """

    name: str = "split"
    threads: int = 256
    chunk: int = 0
    subgroups: bool = False
    rank_group: int = 0

    def __post_init__(self):
        if self.name not in BACKWARDS:
            raise ValueError(f"backward strategy must be one of {BACKWARDS}, got {self.name!r}")
        if self.threads < 1 or self.threads & (self.threads - 1):
            raise ValueError(f"threads must be a power of two, got {self.threads}")
        if self.chunk < 0 or (self.chunk and self.name != "split"):
            raise ValueError(f"chunk applies to the split backward only and must be >= 0, "
                             f"got {self.chunk} for {self.name!r}")
        if self.subgroups and self.name != "split":
            raise ValueError(f"the {self.name} backward has no subgroup form")
        if self.rank_group and (self.name != "split" or self.rank_group % 4):
            raise ValueError(f"rank_group applies to the split backward and must be a multiple "
                             f"of 4, got {self.rank_group} for {self.name!r}")

    @classmethod
    def for_shape(cls, tokens: int, rank: int, subgroups: bool = False) -> "Backward":
        """The default: split, over groups of 8 ranks when tokens are few and the
        rank high, with subgroup reductions where the adapter has them. (fused
        reads g once but runs in one workgroup: on the H200 its grad_dh_b took
        15 us at one token, split's three kernels 11 us together.)"""
        group = 8 if rank > 8 and rank % 8 == 0 and tokens <= 64 else 0
        return cls("split", subgroups=subgroups, rank_group=group)

    def __str__(self) -> str:
        if self.name == "seed":
            return "seed"
        text = f"{self.name}:{self.threads}"
        if self.chunk or self.rank_group:
            text += f":{self.chunk}" + (f":{self.rank_group}" if self.rank_group else "")
        return text + (":sg" if self.subgroups else "")

    @classmethod
    def parse(cls, text: str) -> "Backward":
        """Inverse of str(): 'seed', 'fused:256', 'split:256:512:sg', 'split:256:0:8'."""
        parts = text.split(":")
        sg = len(parts) > 1 and parts[-1] == "sg"
        parts = parts[:-1] if sg else parts
        try:
            nums = [int(p) for p in parts[1:]]
        except ValueError:
            raise ValueError(f"cannot parse backward strategy {text!r}; expected e.g. 'seed', "
                             f"'fused:256' or 'split:256:512'") from None
        keys = {"seed": (), "fused": ("threads",),
                "split": ("threads", "chunk", "rank_group")}.get(parts[0])
        if keys is None or len(nums) > len(keys):
            raise ValueError(f"cannot parse backward strategy {text!r}: one of {BACKWARDS} "
                             f"with at most {len(keys or ())} number(s)")
        return cls(parts[0], subgroups=sg, **dict(zip(keys, nums)))

    def chunk_for(self, tokens: int, columns: int, rank: int) -> int:
        """Tokens per workgroup row of dA and dB: enough rows to fill a big GPU
        (about 1024 workgroups), at least 64 tokens each, and no more partial
        sums than PARTIAL_BYTES."""
        if self.chunk:
            return min(self.chunk, tokens)
        rows = max(1, 1024 // max(1, -(-columns // self.threads)))
        most = max(1, PARTIAL_BYTES // (4 * columns * rank))
        return max(64, -(-tokens // rows), -(-tokens // most))

    def scratch(self, tokens: int, rank: int, in_dim: int, out_dim: int) -> dict:
        """name -> f32 shape of the buffers between its dispatches."""
        out = {"dh": (tokens, rank)}
        if self.name == "split":
            for role, n in (("partial_b", out_dim), ("partial_a", in_dim)):
                chunks = -(-tokens // self.chunk_for(tokens, n, rank))
                if chunks > 1:
                    out[role] = (chunks, n * rank)
        return out

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False,
                with_dx=True) -> list[tuple]:
        """(kernel name, parameters[, binding renames]) of each dispatch, in order."""
        if self.name == "fused":
            if tokens > FUSED_TOKENS:
                raise ValueError(f"the fused backward takes at most {FUSED_TOKENS} tokens, got "
                                 f"{tokens}; use split")
            acc, t = bool(accumulate), self.threads
            return [("grad_dh_b", dict(out_dim=out_dim, rank=rank, scale=float(scale),
                                       tokens=tokens, threads=t, accumulate=acc, dtype=dtype)),
                    ("grad_a_input", dict(in_dim=in_dim, rank=rank, tokens=tokens, threads=t,
                                          accumulate=acc, with_dx=with_dx, dtype=dtype))]
        order = ("dB", "dh", "dA") if self.name == "seed" else ("dh", "dB", "dA")
        return [k for grad in order + (("dx",) if with_dx else ())
                for k in self.kernels_of(grad, rank, in_dim, out_dim, scale, tokens, dtype,
                                         accumulate)]

    def kernels_of(self, grad, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False):
        """The dispatches of one result ("dh", "dB", "dA" or "dx") of a seed or split
        backward (Hesper's one-kernel execute functions)."""
        s, t, acc = float(scale), self.threads, bool(accumulate)
        if self.name == "fused":
            raise ValueError("the fused backward makes dh with dB and dA with dx: use seed or "
                             "split for one result")
        if grad == "dh":
            if self.name == "seed":
                return [("grad_dh_seed", dict(out_dim=out_dim, rank=rank, scale=s, tokens=tokens,
                                              dtype=dtype))]
            if tokens * rank >= TILED_DH_ELEMENTS and rank % 4 == 0 and out_dim % 4 == 0 and \
                t % (rank // 4) == 0:
                return [("grad_dh_tiled", dict(out_dim=out_dim, rank=rank, scale=s, tokens=tokens,
                                               threads=t, dtype=dtype))]
            group = self.rank_group if 0 < self.rank_group < rank and rank % self.rank_group == 0 \
                and rank % 4 == 0 else 0
            return [("grad_dh", dict(out_dim=out_dim, rank=rank, scale=s, tokens=tokens,
                                     threads=t, subgroups=self.subgroups, dtype=dtype,
                                     rank_group=group))]
        if grad == "dx":
            name = "grad_input_seed" if self.name == "seed" else "grad_input"
            return [(name, dict(in_dim=in_dim, rank=rank, tokens=tokens, accumulate=acc,
                                dtype=dtype, **({} if self.name == "seed" else {"threads": t})))]
        which, n, sc = ("b", out_dim, s) if grad == "dB" else ("a", in_dim, 1.0)
        if self.name == "seed":
            return [("grad_outer_seed", dict(n=n, rank=rank, scale=sc, tokens=tokens,
                                             layout="jr" if which == "b" else "rj",
                                             accumulate=acc, dtype=dtype),
                     {"G": "g" if which == "b" else "x", "H": "h" if which == "b" else "dh",
                      "out": grad})]
        return self._outer(which, n, rank, sc, tokens, acc, dtype)

    def _outer(self, which, n, rank, scale, tokens, accumulate, dtype) -> list[tuple]:
        """dB (which "b": g and h, layout jr) or dA ("a": x and dh, layout rj), chunked."""
        chunk = self.chunk_for(tokens, n, rank)
        result, partial = f"d{which.upper()}", f"partial_{which}"
        names = {"G": "g" if which == "b" else "x", "H": "h" if which == "b" else "dh",
                 "out": result, "partial": partial}
        steps = [("grad_outer", dict(n=n, rank=rank, scale=scale, tokens=tokens,
                                     threads=self.threads, chunk=chunk,
                                     layout="jr" if which == "b" else "rj",
                                     accumulate=accumulate, dtype=dtype), names)]
        chunks = -(-tokens // chunk)
        if chunks > 1:
            steps.append(("grad_outer_reduce", dict(size=n * rank, chunks=chunks,
                                                    threads=self.threads, accumulate=accumulate),
                          {"partial": partial, "out": result}))
        return steps
