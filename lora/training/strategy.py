"""Backward strategies: how dh, dB, dA (and dx) are computed, one registry
entry each (the text form and its rules are lora.core.strategy's Entry):

``seed``: Hesper's four kernels, one thread per element of each result (4 dispatches);
``paired:T``: dh and dB from one read of g, then dA and dx from one read of x
(2 dispatches; up to PAIRED_TOKENS tokens);
``split:T[:C[:G]][:sg][:q]``: dh by a workgroup per token (and per G ranks), dB
and dA over chunks of C tokens (0: as many as fill the GPU, then summed by a
second kernel; ``q``: 4 columns x 16 ranks per thread), dx (3 to 6
dispatches; any token count).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.strategy import Entry, registrar
from ..kernels.backward import quad_fits

PAIRED_TOKENS = 4  # the paired backward keeps tokens x rank sums per thread: for a few tokens
# From this many tokens x ranks, split computes dh with grad_dh_tiled (a vec4 of
# dh per thread, no reduction: 64K threads fill the GPU). On the H200 at rank 64,
# 4096 tokens it took 263 us against grad_dh's 918; at rank 8, 4096 tokens (8K
# threads) 222 us against 41.
TILED_DH_ELEMENTS = 1 << 18
PARTIAL_BYTES = 8 << 20  # at most this much of partial sums of dA or dB

BACKWARD: dict[str, type] = {}
backward_strategy = registrar(BACKWARD)  # register a backward strategy entry


@dataclass(frozen=True)
class Backward(Entry):
    """A backward strategy: the base of every entry in :data:`BACKWARD`."""

    family: ClassVar[dict] = BACKWARD
    kind: ClassVar[str] = "backward strategy"
    renamed: ClassVar[dict] = {"fused": ("paired", "")}

    @classmethod
    def example(cls) -> "Backward":
        return cls() if cls is not Backward else Split()

    @classmethod
    def for_shape(cls, tokens: int, rank: int, subgroups: bool = False) -> "Backward":
        """The default: split, over groups of 8 ranks when tokens are few and the
        rank high, with subgroup reductions where the adapter has them. (paired
        reads g once but runs in one workgroup: on the H200 its grad_dh_b took
        15 us at one token, split's three kernels 11 us together.)"""
        group = 8 if rank > 8 and rank % 8 == 0 and tokens <= 64 else 0
        return Split(subgroups=subgroups, rank_group=group)

    def scratch(self, tokens: int, rank: int, in_dim: int, out_dim: int) -> dict:
        """name -> f32 shape of the buffers between its dispatches."""
        return {"dh": (tokens, rank)}

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False,
                with_dx=True) -> list[tuple]:
        """(kernel name, parameters[, binding renames]) of each dispatch, in order."""
        return [k for grad in self.order + (("dx",) if with_dx else ())
                for k in self.kernels_of(grad, rank, in_dim, out_dim, scale, tokens, dtype,
                                         accumulate)]

    def kernels_of(self, grad, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False):
        """The dispatches of one result ("dh", "dB", "dA" or "dx"): Hesper's
        one-kernel execute functions."""
        raise ValueError(f"the {self.name} backward computes its results in pairs: use seed "
                         f"or split for one result")


def _outer_names(which: str) -> dict:
    """grad_outer's generic bindings for dB (g and h) or dA (x and dh)."""
    return {"G": "g" if which == "b" else "x", "H": "h" if which == "b" else "dh",
            "out": f"d{which.upper()}"}


@backward_strategy
class Seed(Backward):
    """Hesper's four kernels, one thread per element of each result."""

    name: ClassVar[str] = "seed"
    order: ClassVar[tuple] = ("dB", "dh", "dA")

    def kernels_of(self, grad, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False):
        s, acc = float(scale), bool(accumulate)
        if grad == "dh":
            return [("grad_dh_seed", dict(out_dim=out_dim, rank=rank, scale=s, tokens=tokens,
                                          dtype=dtype))]
        if grad == "dx":
            return [("grad_input_seed", dict(in_dim=in_dim, rank=rank, tokens=tokens,
                                             accumulate=acc, dtype=dtype))]
        which, n, sc = ("b", out_dim, s) if grad == "dB" else ("a", in_dim, 1.0)
        return [("grad_outer_seed", dict(n=n, rank=rank, scale=sc, tokens=tokens,
                                         layout="jr" if which == "b" else "rj", accumulate=acc,
                                         dtype=dtype), _outer_names(which))]


@backward_strategy
class Paired(Backward):
    """dh and dB from one read of g, then dA and dx from one read of x."""

    name: ClassVar[str] = "paired"
    numbers: ClassVar[tuple] = ("threads",)
    shown: ClassVar[int] = 1
    threads: int = 256

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False,
                with_dx=True) -> list[tuple]:
        if tokens > PAIRED_TOKENS:
            raise ValueError(f"the paired backward takes at most {PAIRED_TOKENS} tokens, got "
                             f"{tokens}; use split")
        acc, t = bool(accumulate), self.threads
        return [("grad_dh_b", dict(out_dim=out_dim, rank=rank, scale=float(scale),
                                   tokens=tokens, threads=t, accumulate=acc, dtype=dtype)),
                ("grad_a_input", dict(in_dim=in_dim, rank=rank, tokens=tokens, threads=t,
                                      accumulate=acc, with_dx=with_dx, dtype=dtype))]


@backward_strategy
class Split(Backward):
    """dh by a workgroup per token (or grad_dh_tiled for many), dB and dA over
    chunks of tokens (summed by a second kernel), dx."""

    name: ClassVar[str] = "split"
    numbers: ClassVar[tuple] = ("threads", "chunk", "rank_group")
    shown: ClassVar[int] = 1
    flags: ClassVar[tuple] = (("sg", "subgroups", True), ("q", "quad", True))
    order: ClassVar[tuple] = ("dh", "dB", "dA")
    threads: int = 256
    chunk: int = 0
    rank_group: int = 0
    subgroups: bool = False
    quad: bool = False  # dA and dB by grad_outer_quad where the shape fits (quad_fits)

    def validate(self) -> None:
        if self.chunk < 0:
            raise ValueError(f"chunk must be >= 0, got {self.chunk}")
        if self.rank_group < 0 or self.rank_group % 4:
            raise ValueError(f"rank_group must be a multiple of 4, got {self.rank_group}")

    def chunk_for(self, tokens: int, columns: int, rank: int) -> int:
        """Tokens per workgroup row of dA and dB: enough rows to fill a big GPU
        (about 1024 workgroups), at least 64 tokens each, and no more partial
        sums than PARTIAL_BYTES."""
        if self.chunk:
            return min(self.chunk, tokens)
        rows = max(1, 1024 // max(1, -(-columns // self.threads)))
        most = max(1, PARTIAL_BYTES // (4 * columns * rank))
        return max(64, -(-tokens // rows), -(-tokens // most))

    def scratch(self, tokens, rank, in_dim, out_dim) -> dict:
        out = {"dh": (tokens, rank)}
        for role, n in (("partial_b", out_dim), ("partial_a", in_dim)):
            chunks = -(-tokens // self.chunk_for(tokens, n, rank))
            if chunks > 1:
                out[role] = (chunks, n * rank)
        return out

    def kernels_of(self, grad, rank, in_dim, out_dim, scale, tokens, dtype, accumulate=False):
        s, t = float(scale), self.threads
        if grad == "dh":
            return [self._dh(rank, out_dim, s, tokens, dtype)]
        if grad == "dx":
            return [("grad_input", dict(in_dim=in_dim, rank=rank, tokens=tokens,
                                        accumulate=bool(accumulate), dtype=dtype, threads=t))]
        which, n, sc = ("b", out_dim, s) if grad == "dB" else ("a", in_dim, 1.0)
        return self._outer(which, n, rank, sc, tokens, bool(accumulate), dtype)

    def _dh(self, rank, out_dim, scale, tokens, dtype) -> tuple:
        shape = dict(out_dim=out_dim, rank=rank, scale=scale, tokens=tokens, threads=self.threads,
                     dtype=dtype)
        if tokens * rank >= TILED_DH_ELEMENTS and rank % 4 == 0 and out_dim % 4 == 0 and \
                self.threads % (rank // 4) == 0:
            return ("grad_dh_tiled", shape)
        group = self.rank_group if 0 < self.rank_group < rank and rank % self.rank_group == 0 \
            and rank % 4 == 0 else 0
        return ("grad_dh", dict(shape, subgroups=self.subgroups, rank_group=group))

    def _outer(self, which, n, rank, scale, tokens, accumulate, dtype) -> list[tuple]:
        """dB (which "b": g and h, layout jr) or dA ("a": x and dh, layout rj), chunked."""
        chunk = self.chunk_for(tokens, n, rank)
        names = dict(_outer_names(which), partial=f"partial_{which}")
        shape = dict(n=n, rank=rank, scale=scale, tokens=tokens, chunk=chunk,
                     layout="jr" if which == "b" else "rj", accumulate=accumulate, dtype=dtype)
        if self.quad and quad_fits(n, rank):
            steps = [("grad_outer_quad", shape, names)]
        else:
            steps = [("grad_outer", dict(shape, threads=self.threads), names)]
        chunks = -(-tokens // chunk)
        if chunks > 1:
            steps.append(("grad_outer_reduce", dict(size=n * rank, chunks=chunks,
                                                    threads=self.threads, accumulate=accumulate),
                          {"partial": names["partial"], "out": names["out"]}))
        return steps


BACKWARDS = tuple(BACKWARD)
