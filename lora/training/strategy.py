"""Backward strategies: how dh, dB, dA (and dx) are computed, one registry
entry each (the text form and its rules are lora.core.strategy's Entry):

``seed``: Hesper's four kernels, one thread per element of each result (4 dispatches);
``paired(threads=256)``: dh and dB from one read of g, then dA and dx from one read of x
(2 dispatches; up to PAIRED_TOKENS tokens);
``split(threads=256, chunk_tokens=0, rank_group=0, subgroups=False)``: dh
by a workgroup per token (and per rank_group ranks), dB and dA over chunks
of chunk_tokens tokens (0: as many as fill the GPU, then summed by a second
kernel), dx (3 to 6 dispatches; any token count);
``gemm(threads=256, chunk_tokens=0)``: dh, dB and dA as tiled matrix
products (4 x 4 results per thread from tiles in workgroup memory; dims and
rank multiples of 4), dx as split's (3 to 6 dispatches);
``matrix(chunk_tokens=0)``: the same products and dx on matrix units (f16
weights where the adapter has f16 -> f32 16x16x16 subgroup matrices).

The older positional texts (``split:256:8:sg``: threads, chunk_tokens,
rank_group) still parse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.shape import LayerShape
from ..core.strategy import Entry, registrar
from ..kernels.backward import outer_chunk, outer_tile, outer_tiled_fits
from ..kernels.gemm import gemm_chunk, gemm_tile_tokens
from ..kernels.matrix import a_tiling

PAIRED_TOKENS = 4  # the paired backward keeps tokens x rank sums per thread: for a few tokens
# From this many tokens x ranks, split computes dh with grad_dh_tiled (a vec4 of
# dh per thread, no reduction: 64K threads fill the GPU). On the H200 at rank 64,
# 4096 tokens it took 263 us against grad_dh's 918; at rank 8, 4096 tokens (8K
# threads) 222 us against 41.
TILED_DH_ELEMENTS = 1 << 18
PARTIAL_BYTES = 8 << 20  # at most this much of partial sums of dA or dB
# The default backward is gemm from rank GEMM_RANK, and from rank 16 at GEMM_TOKENS
# tokens. On the H200 (naga, 2560 -> 2560) gemm took the rank-64 step from 49 to 42 us
# at one token, 68 to 46 at 16, 304 to 107 at 512 and 969 to 480 at 4096; at rank 8
# split stays faster up to 512 tokens (24 against 42 us at one) and ties at 4096.
GEMM_RANK, GEMM_TOKENS = 32, 128

BACKWARD: dict[str, type] = {}
backward_strategy = registrar(BACKWARD)  # register a backward strategy entry


@dataclass(frozen=True)
class Backward(Entry):
    """A backward strategy: the base of every entry in :data:`BACKWARD`.
    Its methods take the layer as a :class:`~lora.core.shape.LayerShape`
    with a token count."""

    family: ClassVar[dict] = BACKWARD
    kind: ClassVar[str] = "backward strategy"
    renamed: ClassVar[dict] = {"fused": ("paired", "")}
    order: ClassVar[tuple] = ()  # the results kernels() computes one after another

    @classmethod
    def example(cls) -> "Backward":
        return cls() if cls is not Backward else Split()

    @classmethod
    def for_shape(cls, shape: LayerShape, subgroups: bool = False,
                  matrix: bool = False) -> "Backward":
        """The default: gemm (or, with ``matrix``, an f16 weight on an adapter
        with its subgroup matrices, matrix) where the shape fits it from rank
        GEMM_RANK, or from rank 16 at GEMM_TOKENS tokens; else split, over
        groups of 8 ranks when tokens are few and the rank high, with
        subgroup reductions where the adapter has them. (paired reads g once
        but runs in one workgroup: on the H200 its grad_dh_b took 15 us at
        one token, split's three kernels 11 us together.)"""
        rank, tokens = shape.rank, shape.token_count
        if (rank >= GEMM_RANK or rank >= 16 and tokens >= GEMM_TOKENS) and Gemm.fits(shape):
            return MatrixBackward() if matrix else Gemm()
        group = 8 if rank > 8 and rank % 8 == 0 and tokens <= 64 else 0
        return Split(subgroups=subgroups, rank_group=group)

    def scratch(self, shape: LayerShape) -> dict:
        """name -> f32 shape of the buffers between its dispatches, the one
        place their sizes are written: dh, dh's slices of out_dim where
        :meth:`dh_splits` makes several, and the partial sums of dB and dA
        where :meth:`chunk_of` cuts the tokens in several chunks."""
        tokens, rank = shape.token_count, shape.rank
        out = {"dh": (tokens, rank)}
        splits = self.dh_splits(shape)
        if splits > 1:
            out["dh_slices"] = (splits, tokens * rank)
        for role, n in (("partial_b", shape.out_dim), ("partial_a", shape.in_dim)):
            chunks = -(-tokens // self.chunk_of(shape, n))
            if chunks > 1:
                out[role] = (chunks, n * rank)
        return out

    def dh_splits(self, shape: LayerShape) -> int:
        """Slices of out_dim dh is summed over (1: dh is written whole)."""
        return 1

    def chunk_of(self, shape: LayerShape, columns: int) -> int:
        """Tokens per chunk of dB (``columns`` out_dim) or dA (in_dim); all the
        tokens: no partial sums."""
        return shape.token_count

    def kernels(self, shape: LayerShape, accumulate: bool = False, with_dx: bool = True,
                dh_parts: int = 0) -> list[tuple]:
        """(kernel name, parameters[, binding renames]) of each dispatch, in order.
        ``dh_parts`` (0: none): dh is given in that many parts (the mse
        kernel's, one token), which only split takes."""
        self._refuse_dh_parts(dh_parts)
        return [k for grad in self.order + (("dx",) if with_dx else ())
                for k in self.kernels_of(grad, shape, accumulate)]

    def _refuse_dh_parts(self, dh_parts: int) -> None:
        if dh_parts:
            raise ValueError(f"the {self.name} backward computes dh itself: only split at one "
                             f"token, without dx, takes dh in parts")

    def kernels_of(self, grad: str, shape: LayerShape, accumulate: bool = False) -> list[tuple]:
        """The dispatches of one result ("dh", "dB", "dA" or "dx"): Hesper's
        one-kernel execute functions."""
        raise ValueError(f"the {self.name} backward computes its results in pairs: use seed "
                         f"or split for one result")


def _outer_names(which: str) -> dict:
    """grad_outer's generic bindings for dB (g and h) or dA (x and dh)."""
    return {"G": "g" if which == "b" else "x", "H": "h" if which == "b" else "dh",
            "out": f"d{which.upper()}"}


def _outer_of(grad: str, shape: LayerShape) -> tuple[str, int, float]:
    """("b", out_dim, scale) for dB, ("a", in_dim, 1.0) for dA."""
    return ("b", shape.out_dim, shape.scale) if grad == "dB" else ("a", shape.in_dim, 1.0)


@backward_strategy
class Seed(Backward):
    """Hesper's four kernels, one thread per element of each result."""

    name: ClassVar[str] = "seed"
    order: ClassVar[tuple] = ("dB", "dh", "dA")

    def kernels_of(self, grad, shape, accumulate=False):
        acc, tokens, rank, dtype = bool(accumulate), shape.token_count, shape.rank, shape.dtype
        if grad == "dh":
            return [("grad_dh_seed", dict(out_dim=shape.out_dim, rank=rank, scale=shape.scale,
                                          tokens=tokens, dtype=dtype))]
        if grad == "dx":
            return [("grad_input_seed", dict(in_dim=shape.in_dim, rank=rank, tokens=tokens,
                                             accumulate=acc, dtype=dtype))]
        which, n, sc = _outer_of(grad, shape)
        return [("grad_outer_seed", dict(n=n, rank=rank, scale=sc, tokens=tokens,
                                         layout="jr" if which == "b" else "rj", accumulate=acc,
                                         dtype=dtype), _outer_names(which))]


@backward_strategy
class Paired(Backward):
    """dh and dB from one read of g, then dA and dx from one read of x."""

    name: ClassVar[str] = "paired"
    numbers: ClassVar[tuple] = ("threads",)
    threads: int = 256

    def kernels(self, shape, accumulate=False, with_dx=True, dh_parts=0) -> list[tuple]:
        self._refuse_dh_parts(dh_parts)
        tokens = shape.token_count
        if tokens > PAIRED_TOKENS:
            raise ValueError(f"the paired backward takes at most {PAIRED_TOKENS} tokens, got "
                             f"{tokens}; use split")
        acc, t, rank, dtype = bool(accumulate), self.threads, shape.rank, shape.dtype
        return [("grad_dh_b", dict(out_dim=shape.out_dim, rank=rank, scale=shape.scale,
                                   tokens=tokens, threads=t, accumulate=acc, dtype=dtype)),
                ("grad_a_input", dict(in_dim=shape.in_dim, rank=rank, tokens=tokens, threads=t,
                                      accumulate=acc, with_dx=with_dx, dtype=dtype))]


@backward_strategy
class Split(Backward):
    """dh by a workgroup per token (or grad_dh_tiled for many), dB and dA over
    chunks of ``chunk_tokens`` tokens (summed by a second kernel), dx."""

    name: ClassVar[str] = "split"
    numbers: ClassVar[tuple] = ("threads", "chunk_tokens", "rank_group")
    flags: ClassVar[tuple] = (("sg", "subgroups", True),)
    order: ClassVar[tuple] = ("dh", "dB", "dA")
    threads: int = 256
    chunk_tokens: int = 0  # tokens per chunk of dB and dA; 0: chunk_for's choice
    rank_group: int = 0
    subgroups: bool = False

    def validate(self) -> None:
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")
        if self.rank_group < 0 or self.rank_group % 4:
            raise ValueError(f"rank_group must be a multiple of 4, got {self.rank_group}")

    def chunk_of(self, shape, columns):
        return chunk_for(self.chunk_tokens, shape.token_count, columns, shape.rank, self.threads)

    def kernels(self, shape, accumulate=False, with_dx=True, dh_parts=0) -> list[tuple]:
        """dB and dA in one dispatch (grad_outer_pair) where each would be one
        chunk of tokens (a dispatch fewer: on the H200 each costs ~2 us at one
        token); otherwise one result after another. With ``dh_parts`` (one
        token, no dx) dh is given in parts, and the pair is all."""
        tokens = shape.token_count
        pairs = all(self.chunk_of(shape, n) >= tokens for n in (shape.in_dim, shape.out_dim))
        if not (pairs and tokens == 1 and not with_dx):
            self._refuse_dh_parts(dh_parts)
        if not pairs:
            return super().kernels(shape, accumulate, with_dx)
        pair = ("grad_outer_pair", dict(in_dim=shape.in_dim, rank=shape.rank,
                                        out_dim=shape.out_dim, scale=shape.scale, tokens=tokens,
                                        dh_parts=dh_parts, accumulate=bool(accumulate),
                                        dtype=shape.dtype, threads=self.threads))
        if dh_parts:
            return [pair]
        return [self._dh(shape), pair] + \
            (self.kernels_of("dx", shape, accumulate) if with_dx else [])

    def kernels_of(self, grad, shape, accumulate=False):
        if grad == "dh":
            return [self._dh(shape)]
        if grad == "dx":
            return [("grad_input", dict(in_dim=shape.in_dim, rank=shape.rank,
                                        tokens=shape.token_count, accumulate=bool(accumulate),
                                        dtype=shape.dtype, threads=self.threads))]
        which, n, sc = _outer_of(grad, shape)
        chunk = self.chunk_of(shape, n)
        names = dict(_outer_names(which), partial=f"partial_{which}")
        params = dict(n=n, rank=shape.rank, scale=sc, tokens=shape.token_count, chunk=chunk,
                      layout="jr" if which == "b" else "rj", accumulate=bool(accumulate),
                      dtype=shape.dtype, threads=self.threads)
        return [("grad_outer", params, names)] + \
            _reduce(-(-shape.token_count // chunk), n * shape.rank, bool(accumulate),
                    names["partial"], names["out"])

    def _dh(self, shape: LayerShape) -> tuple:
        rank, out_dim, tokens = shape.rank, shape.out_dim, shape.token_count
        params = dict(out_dim=out_dim, rank=rank, scale=shape.scale, tokens=tokens,
                      threads=self.threads, dtype=shape.dtype)
        if tokens * rank >= TILED_DH_ELEMENTS and rank % 4 == 0 and out_dim % 4 == 0 and \
                self.threads % (rank // 4) == 0:
            return ("grad_dh_tiled", params)
        group = self.rank_group if 0 < self.rank_group < rank and rank % self.rank_group == 0 \
            and rank % 4 == 0 else 0
        return ("grad_dh", dict(params, subgroups=self.subgroups, rank_group=group))


def chunk_for(chunk_tokens: int, tokens: int, columns: int, rank: int,
              per_workgroup: int) -> int:
    """Tokens per workgroup row of dA and dB (``chunk_tokens`` if given):
    enough rows to fill a big GPU (about 1024 workgroups of
    ``per_workgroup`` columns), at least 64 tokens each, and no more partial
    sums than PARTIAL_BYTES."""
    if chunk_tokens:
        return min(chunk_tokens, tokens)
    rows = max(1, 1024 // max(1, -(-columns // per_workgroup)))
    most = max(1, PARTIAL_BYTES // (4 * columns * rank))
    return max(64, -(-tokens // rows), -(-tokens // most))


def _reduce(chunks, size, accumulate, partial, out) -> list[tuple]:
    """The sum of ``chunks`` partial results (no step for one)."""
    return [("grad_outer_reduce", dict(size=size, chunks=chunks, accumulate=accumulate),
             {"partial": partial, "out": out})] if chunks > 1 else []


def _sliced_dh(kernel: tuple, splits: int, shape: LayerShape) -> list[tuple]:
    """dh = s g B by a projection kernel on B as it is stored, into dh or
    its slices of out_dim (then summed)."""
    name, params = kernel
    into = "dh_slices" if splits > 1 else "dh"
    return [(name, params, {"A": "B", "x": "g", "hp": into})] + \
        _reduce(splits, shape.token_count * shape.rank, False, "dh_slices", "dh")


def _chunked_outer(kernel: str, grad: str, shape: LayerShape, chunk: int, accumulate,
                   **extra) -> list[tuple]:
    """dB or dA by ``kernel`` over chunks of ``chunk`` tokens, then their sum."""
    which, n, sc = _outer_of(grad, shape)
    names = dict(_outer_names(which), partial=f"partial_{which}")
    tokens = shape.token_count
    return [(kernel, dict(n=n, rank=shape.rank, scale=sc, tokens=tokens, chunk=chunk,
                          layout="jr" if which == "b" else "rj", accumulate=bool(accumulate),
                          **extra), names)] + \
        _reduce(-(-tokens // chunk), n * shape.rank, bool(accumulate), names["partial"],
                names["out"])


DH_WORKGROUPS = 256  # gemm: dh's slices of out_dim fill about this many workgroups
DH_SPLITS = 16       # and at most this many


@backward_strategy
class Gemm(Backward):
    """dh = s g B by project_a_tiled on B as it is stored (slices of out_dim,
    summed by grad_outer_reduce when several), dB and dA by grad_outer_tiled
    over chunks of ``chunk_tokens`` tokens (0: as many as fill the GPU), dx as split's."""

    name: ClassVar[str] = "gemm"
    numbers: ClassVar[tuple] = ("threads", "chunk_tokens")
    order: ClassVar[tuple] = ("dh", "dB", "dA")
    threads: int = 256
    chunk_tokens: int = 0

    def validate(self) -> None:
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")

    @staticmethod
    def fits(shape: LayerShape) -> bool:
        """Dims and rank multiples of 4; rank at most 256 (dh's tiles, rank rows
        of B among them, in 16 KiB of workgroup memory)."""
        return outer_tiled_fits(shape.in_dim, shape.rank) and \
            outer_tiled_fits(shape.out_dim, shape.rank) and shape.rank <= 256

    def dh_splits(self, shape):
        tiles = -(-shape.token_count // gemm_tile_tokens(shape.rank, self.threads))
        steps = shape.out_dim // gemm_chunk(shape.rank, shape.out_dim, self.threads)
        return max(1, min(steps, DH_SPLITS, -(-DH_WORKGROUPS // tiles)))

    def chunk_of(self, shape, columns):
        tokens, rank = shape.token_count, shape.rank
        return outer_chunk(chunk_for(self.chunk_tokens, tokens, columns, rank,
                                     outer_tile(rank)[1]), tokens, rank)

    def kernels_of(self, grad, shape, accumulate=False):
        if not self.fits(shape):
            raise ValueError(f"the gemm backward needs rank, in_dim and out_dim multiples of 4 "
                             f"and rank at most 256, got rank {shape.rank}, in_dim "
                             f"{shape.in_dim}, out_dim {shape.out_dim}; use split")
        if grad == "dx":
            return Split(threads=self.threads).kernels_of(grad, shape, accumulate)
        if grad == "dh":
            splits = self.dh_splits(shape)
            return _sliced_dh(("project_a_tiled", dict(
                rank=shape.rank, in_dim=shape.out_dim, tokens=shape.token_count, splits=splits,
                threads=self.threads, dtype=shape.dtype, a_columns=True, scale=shape.scale)),
                splits, shape)
        chunk = self.chunk_of(shape, _outer_of(grad, shape)[1])
        return _chunked_outer("grad_outer_tiled", grad, shape, chunk, accumulate,
                              dtype=shape.dtype)


MATRIX_DH_WORKGROUPS = 256  # matrix: dh's slices of out_dim fill about this many workgroups


@backward_strategy
class MatrixBackward(Backward):
    """f16 on matrix units: dh = s g B by project_a_matrix on B as it is stored
    (slices of out_dim, summed by grad_outer_reduce when several), dB and dA
    by grad_outer_matrix over chunks of ``chunk_tokens`` tokens (0: as many
    as fill the GPU), dx = dh A by grad_input_matrix, h and dh rounded to f16
    as they are staged."""

    name: ClassVar[str] = "matrix"
    numbers: ClassVar[tuple] = ("chunk_tokens",)
    order: ClassVar[tuple] = ("dh", "dB", "dA")
    chunk_tokens: int = 0

    def validate(self) -> None:
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")

    def dh_splits(self, shape):
        tiles = -(-shape.token_count // a_tiling(16, 2).rows)  # project_a_matrix's fragments
        splits = 1
        while splits < DH_SPLITS and tiles * splits * 2 <= MATRIX_DH_WORKGROUPS and \
                shape.out_dim % (8 * splits) == 0:
            splits *= 2
        return splits

    def chunk_of(self, shape, columns):
        return chunk_for(self.chunk_tokens, shape.token_count, columns, shape.rank, 64)

    def kernels_of(self, grad, shape, accumulate=False):
        if shape.dtype != "f16" or not Gemm.fits(shape):
            raise ValueError(f"the matrix backward multiplies f16 on matrix units, with rank, "
                             f"in_dim and out_dim multiples of 4 (rank at most 256); got "
                             f"{shape.dtype}, rank {shape.rank}, in_dim {shape.in_dim}, out_dim "
                             f"{shape.out_dim}: use gemm or split")
        if grad == "dx":
            return [("grad_input_matrix", dict(in_dim=shape.in_dim, rank=shape.rank,
                                               tokens=shape.token_count,
                                               accumulate=bool(accumulate)))]
        if grad == "dh":
            splits = self.dh_splits(shape)
            return _sliced_dh(("project_a_matrix", dict(
                rank=shape.rank, in_dim=shape.out_dim, tokens=shape.token_count, splits=splits,
                a_columns=True, scale=shape.scale)), splits, shape)
        chunk = self.chunk_of(shape, _outer_of(grad, shape)[1])
        return _chunked_outer("grad_outer_matrix", grad, shape, chunk, accumulate)
