"""Strategies: how a LoRA forward runs, one registry entry per strategy.

An entry is a frozen dataclass registered with :func:`forward_strategy`: its
fields are its parameters, its text form (``str``/``Strategy.parse``) is what
the autotuner caches and ``LORA_STRATEGY`` and ``--strategy`` take;
``kernels()`` names its dispatches, ``scratch()`` the f32 buffers between
them, and ``candidates()`` what the autotuner times for a shape. Adding a
strategy is one entry here; :class:`lora.core.plan.Plan` builds it and
:mod:`lora.core.tuning` reads the registry.

============================  ===========  =================================================
text                          dispatches   kernels
============================  ===========  =================================================
``seed``                      2            project_a_seed (Hesper's design), fused_b_add
``three:T[:seed][:sg]``       3            project_a, project_b, add_scaled (Hesper's three)
``split:T[:G][:seed][:sg]``   2            project_a (per token, G ranks per workgroup), fused_b_add
``single:T:O[:loop][:sg]``    1            fused_forward (h recomputed by every workgroup)
``tiled:T:TT[:B][:loop][:q]`` 1            tiled_forward (TT tokens per workgroup, B per thread)
``gemm:T:TT:S[:BL]``          2            project_a_tiled (BL = 4 or 8 tokens x 4 ranks per
                                           thread, S slices of in_dim), tiled_b_add (TT
                                           tokens x 256 columns per workgroup)
``matrix:S:F:R:C:D[:direct]`` 2            f16 on matrix units: project_a_matrix (S slices),
                                           b_add_matrix (R x C fragments per subgroup), or
                                           b_add_direct (f16 output fragments as accumulators)
============================  ===========  =================================================

``T`` is the workgroup size, ``sg`` reduces with subgroup operations,
``loop`` keeps column loops as WGSL loops instead of unrolling them, ``q``
gives each thread four adjacent output columns (read and written as vec4), and
``:seed`` computes h with Hesper's one-thread-per-element kernel (``seed``
is Hesper's whole design: that kernel, then fused_b_add with 256 threads).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from ..kernels import tiled_fits
from ..kernels.gemm import GEMM_BLOCKS

GEMM_TILE_TOKENS = 32  # gemm's tiled_b_add keeps a vec4 per token of its tile in registers


@dataclass(frozen=True)
class Entry:
    """What every strategy entry (forward or backward) shares: a power-of-two
    workgroup size where it has one, and the text form ``name:numbers:flags``.

    ``numbers``: the int fields in text order, trailing defaults left out
    after the first ``shown``; ``flags``: (text, field, value) for the
    fields written as a word (``sg``, ``loop``, ...)."""

    name: ClassVar[str] = ""
    family: ClassVar[dict]  # name -> entry class, on each family's base
    kind: ClassVar[str] = "strategy"  # how messages name the family
    renamed: ClassVar[dict] = {}  # former name -> (today's, what it is)
    numbers: ClassVar[tuple[str, ...]] = ()
    shown: ClassVar[int] = 0
    flags: ClassVar[tuple[tuple[str, str, object], ...]] = ()
    subgroups = False  # (not a field here: the entries with a subgroup form have one)

    def __post_init__(self):
        if not self.name:
            raise TypeError(f"{type(self).__name__} is the base of the registry's entries: use "
                            f"{type(self).__name__}.parse(text) or an entry class")
        threads = getattr(self, "threads", 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1 or \
                threads & (threads - 1):
            raise ValueError(f"threads must be a power of two, got {threads!r}")
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for fields that do not go together."""

    def __str__(self) -> str:
        defaults = {f.name: f.default for f in fields(self)}
        values = [getattr(self, n) for n in self.numbers]
        keep = len(values)
        while keep > self.shown and values[keep - 1] == defaults[self.numbers[keep - 1]]:
            keep -= 1
        text = ":".join([self.name, *map(str, values[:keep])])
        return text + "".join(f":{flag}" for flag, field, value in self.flags
                              if getattr(self, field) == value)

    @classmethod
    def parse(cls, text: str) -> "Entry":
        """Inverse of str(): e.g. 'seed', 'split:256:8:sg', 'tiled:512:16:4:loop'."""
        if not isinstance(text, str):
            raise TypeError(f"{cls.kind}: expected a text such as {str(cls.example())!r}, got "
                            f"{text!r}")
        name, *parts = text.split(":")
        entry = cls.family.get(name)
        if entry is None:
            raise ValueError(cls._unknown(name, text))
        nums = []
        while parts and parts[0].lstrip("-").isdigit():
            nums.append(int(parts.pop(0)))
        words = {flag: (field, value) for flag, field, value in entry.flags}
        foreign = [p for p in parts if p not in words]
        owners = [other.name for other in cls.family.values()
                  if any(flag in foreign for flag, _, _ in other.flags)]
        if owners:
            raise ValueError(f"cannot parse {cls.kind} {text!r}: {name!r} takes no word "
                             f"{foreign[0]!r}; it belongs to {' and '.join(owners)}")
        if foreign or len(set(parts)) < len(parts) or len(nums) > len(entry.numbers):
            words_said = f" then any of the words {list(words)}" if words else " and no words"
            raise ValueError(f"cannot parse {cls.kind} {text!r}: {name!r} takes up to "
                             f"{len(entry.numbers)} number(s) ({', '.join(entry.numbers) or 'none'})"
                             f"{words_said}; e.g. {str(entry.example())!r}")
        return entry(**dict(zip(entry.numbers, nums)), **dict(words[p] for p in parts))

    @classmethod
    def _unknown(cls, name: str, text: str) -> str:
        if name in cls.renamed:
            new, what = cls.renamed[name]
            return (f"{cls.kind} {name!r} is now called {new!r}{what}; write "
                    f"{text.replace(name, new, 1)!r}")
        return f"{cls.kind} must be one of {tuple(cls.family)}, got {name!r} in {text!r}"

    @classmethod
    def example(cls) -> "Entry":
        """The entry with its defaults (for messages)."""
        return cls()


def registrar(family: dict):
    """The decorator that makes a class body an entry of ``family``."""
    def register(cls):
        cls = dataclass(frozen=True)(cls)
        family[cls.name] = cls
        return cls
    return register


FORWARD: dict[str, type] = {}
forward_strategy = registrar(FORWARD)  # register a forward strategy entry


@dataclass(frozen=True)
class Strategy(Entry):
    """A forward strategy: the base of every entry in :data:`FORWARD`.

    ``Strategy.parse(text)`` gives the entry of that text."""

    family: ClassVar[dict] = FORWARD
    renamed: ClassVar[dict] = {"fused": ("single", " (one dispatch)")}

    @classmethod
    def example(cls) -> "Strategy":
        return cls() if cls is not Strategy else Tiled()

    def kernels(self, rank: int, in_dim: int, out_dim: int, scale: float, tokens: int | None,
                dtype: str, save_h: bool = False) -> list[tuple]:
        """(name in lora.kernels.KERNELS, parameters[, binding renames]) of each
        dispatch, in order; ``save_h``: h is left in the "h" buffer for the
        backward. ``tokens`` None: the run-time forms (token count in a uniform)."""
        raise NotImplementedError

    def scratch(self, save_h: bool = False) -> dict[str, int]:
        """The f32 buffers between dispatches: role -> rows per token (h is
        [tokens, rank], y [tokens, out_dim], gemm's hp [splits * tokens, rank])."""
        return {"h": 1} if save_h else {}

    @classmethod
    def candidates(cls, rank: int, in_dim: int, out_dim: int, tokens: int,
                   subgroups: bool, matrices: tuple = ()) -> list["Strategy"]:
        """The forms of this strategy worth timing for a shape (``subgroups``:
        whether the adapter has them; ``matrices``: its subgroup-matrix
        shapes for this storage dtype, shaderdsl.types.MatrixConfig)."""
        return []


def _sgs(subgroups: bool) -> tuple:
    return (False, True) if subgroups else (False,)


def _projection(projection: str, rank: int, in_dim: int, tokens, dtype: str, threads: int,
                subgroups: bool, rank_group: int = 0) -> tuple:
    """project_a: a workgroup per token (and per group of ranks), or Hesper's seed."""
    shape = dict(rank=rank, in_dim=in_dim, tokens=tokens, dtype=dtype)
    if projection == "seed":
        return ("project_a_seed", shape)
    group = rank_group if 0 < rank_group < rank else 0
    return ("project_a", dict(shape, threads=threads, subgroups=subgroups, rank_group=group))


def _fused_b(out_dim, rank, scale, tokens, dtype, threads) -> tuple:
    return ("fused_b_add", dict(out_dim=out_dim, rank=rank, scale=float(scale), tokens=tokens,
                                threads=threads, dtype=dtype))


class _Projected:
    """three and split: project_a by a workgroup per token, or Hesper's seed."""

    def validate(self) -> None:
        if self.projection not in ("workgroup", "seed"):
            raise ValueError(f"projection: expected one of ('workgroup', 'seed'), got "
                             f"{self.projection!r}")
        if self.subgroups and self.projection == "seed":
            raise ValueError(f"the {self.name} strategy with Hesper's seed projection has no "
                             f"subgroup form")


@forward_strategy
class Seed(Strategy):
    """Hesper's design: project_a_seed (a thread per element of h), fused_b_add."""

    name: ClassVar[str] = "seed"

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        return [_projection("seed", rank, in_dim, tokens, dtype, 256, False),
                _fused_b(out_dim, rank, scale, tokens, dtype, 256)]

    def scratch(self, save_h=False):
        return {"h": 1}

    @classmethod
    def candidates(cls, rank, in_dim, out_dim, tokens, subgroups, matrices=()):
        return [cls()]  # wins on some adapters (CPU ones: few, long threads)


@forward_strategy
class Three(_Projected, Strategy):
    """Hesper's three dispatches: project_a, project_b into y, add_scaled."""

    name: ClassVar[str] = "three"
    numbers: ClassVar[tuple] = ("threads",)
    shown: ClassVar[int] = 1
    flags: ClassVar[tuple] = (("seed", "projection", "seed"), ("sg", "subgroups", True))
    threads: int = 256
    projection: str = "workgroup"
    subgroups: bool = False

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        t = self.threads
        count = dict(num_elements=tokens * out_dim) if tokens is not None else \
            dict(num_elements=None, columns=out_dim)  # run time: tokens * out_dim
        return [_projection(self.projection, rank, in_dim, tokens, dtype, t, self.subgroups),
                ("project_b", dict(out_dim=out_dim, rank=rank, tokens=tokens, threads=t,
                                   dtype=dtype)),
                ("add_scaled", dict(count, scale=float(scale), threads=t, dtype=dtype))]

    def scratch(self, save_h=False):
        return {"h": 1, "y": 1}


@forward_strategy
class Split(_Projected, Strategy):
    """project_a (a workgroup per token, or per token and group of ranks), then fused_b_add."""

    name: ClassVar[str] = "split"
    numbers: ClassVar[tuple] = ("threads", "rank_group")
    shown: ClassVar[int] = 1
    flags: ClassVar[tuple] = (("seed", "projection", "seed"), ("sg", "subgroups", True))
    threads: int = 256
    rank_group: int = 0
    projection: str = "workgroup"
    subgroups: bool = False

    def validate(self) -> None:
        super().validate()
        if self.rank_group < 0:
            raise ValueError(f"rank_group must be >= 0, got {self.rank_group}")
        if self.rank_group and self.projection == "seed":
            raise ValueError(f"rank_group applies to the workgroup projection, not to "
                             f"Hesper's seed projection (split:T:{self.rank_group}:seed)")

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        return [_projection(self.projection, rank, in_dim, tokens, dtype, self.threads,
                            self.subgroups, self.rank_group),
                _fused_b(out_dim, rank, scale, tokens, dtype, self.threads)]

    def scratch(self, save_h=False):
        return {"h": 1}

    @classmethod
    def candidates(cls, rank, in_dim, out_dim, tokens, subgroups, matrices=()):
        out = []
        if rank > 8 and tokens <= 64:  # share A's rows among workgroups: per rank group
            out += [cls(256, group, subgroups=sg) for group in (4, 8) for sg in _sgs(subgroups)]
        return out + [cls(256, subgroups=sg) for sg in _sgs(subgroups)]


def _both(rank, in_dim, out_dim, scale, tokens, dtype, threads, unroll, save_h) -> dict:
    """The parameters fused_forward and tiled_forward share."""
    return dict(rank=rank, in_dim=in_dim, out_dim=out_dim, scale=float(scale), tokens=tokens,
                threads=threads, unroll=unroll, dtype=dtype, **({"save_h": True} if save_h else {}))


@forward_strategy
class Single(Strategy):
    """One dispatch, fused_forward: every workgroup recomputes h for its token."""

    name: ClassVar[str] = "single"
    numbers: ClassVar[tuple] = ("threads", "outputs_per_thread")
    shown: ClassVar[int] = 2
    flags: ClassVar[tuple] = (("loop", "unroll", False), ("sg", "subgroups", True))
    threads: int = 256
    outputs_per_thread: int = 1
    unroll: bool = True
    subgroups: bool = False

    def validate(self) -> None:
        if self.outputs_per_thread < 1:
            raise ValueError(f"outputs_per_thread must be >= 1, got {self.outputs_per_thread}")

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        both = _both(rank, in_dim, out_dim, scale, tokens, dtype, self.threads, self.unroll, save_h)
        return [("fused_forward", dict(both, outputs_per_thread=self.outputs_per_thread,
                                       subgroups=self.subgroups))]

    @classmethod
    def candidates(cls, rank, in_dim, out_dim, tokens, subgroups, matrices=()):
        if tokens == 1:
            return [cls(t, 1, unroll, sg) for sg in _sgs(subgroups) for t in (256, 512, 1024)
                    for unroll in (True, False)]
        return [cls(256, -(-out_dim // 256), False, sg) for sg in _sgs(subgroups)]


@forward_strategy
class Tiled(Strategy):
    """One dispatch, tiled_forward: a tile of tokens per workgroup, h in workgroup memory."""

    name: ClassVar[str] = "tiled"
    numbers: ClassVar[tuple] = ("threads", "tile_tokens", "token_block")
    shown: ClassVar[int] = 2
    flags: ClassVar[tuple] = (("loop", "unroll", False), ("q", "quad", True))
    threads: int = 256
    tile_tokens: int = 16
    token_block: int = 1
    unroll: bool = True
    quad: bool = False  # four adjacent output columns per thread

    def validate(self) -> None:
        if self.tile_tokens < 1 or self.threads % self.tile_tokens:
            raise ValueError(f"tile_tokens must divide threads, got {self.tile_tokens} "
                             f"and {self.threads}")
        if self.token_block < 1 or self.tile_tokens % self.token_block:
            raise ValueError(f"token_block must divide tile_tokens, got {self.token_block} "
                             f"with tile_tokens {self.tile_tokens}")

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        both = _both(rank, in_dim, out_dim, scale, tokens, dtype, self.threads, self.unroll, save_h)
        return [("tiled_forward", dict(both, tile_tokens=self.tile_tokens,
                                       token_block=self.token_block, quad=self.quad))]

    @classmethod
    def candidates(cls, rank, in_dim, out_dim, tokens, subgroups, matrices=()):
        if tokens == 1:
            return []
        out = []
        for threads in (256, 512):
            for tile in (t for t in (4, 8, 16) if t <= max(4, tokens)):
                for unroll in (True, False):
                    out.append(cls(threads, tile, unroll=unroll))
                    if tile >= 8 and tokens >= 64 and tiled_fits(rank, threads, tile, 4):
                        out.append(cls(threads, tile, 4, unroll=unroll))
        # vec4 output columns where the shape allows, up to rank 16 (four rows of B
        # per thread; on the H200 f16 rank 8, T = 4096: 29.7 us against 32.6)
        if rank <= 16 and not (rank % 4 or in_dim % 4 or out_dim % 4):
            out += [cls(threads, tile, quad=True) for threads in (256, 512) for tile in (8, 16)
                    if tile <= max(4, tokens)]
        return out


@forward_strategy
class Gemm(Strategy):
    """Two dispatches: project_a_tiled (h as a matrix product, in ``splits``
    slices of in_dim, ``block`` tokens per thread), then tiled_b_add (a tile of
    tokens x 256 columns)."""

    name: ClassVar[str] = "gemm"
    numbers: ClassVar[tuple] = ("threads", "tile_tokens", "splits", "block")
    shown: ClassVar[int] = 3
    threads: int = 128
    tile_tokens: int = 16
    splits: int = 1
    block: int = 4

    def validate(self) -> None:
        if not 1 <= self.tile_tokens <= GEMM_TILE_TOKENS:
            raise ValueError(f"gemm: tile_tokens must be 1 to {GEMM_TILE_TOKENS} (a vec4 "
                             f"accumulator per token and thread), got {self.tile_tokens}")
        if self.splits < 1:
            raise ValueError(f"gemm: splits must be >= 1, got {self.splits}")
        if self.block not in GEMM_BLOCKS:
            raise ValueError(f"gemm: block (tokens per thread of project_a_tiled) must be one "
                             f"of {GEMM_BLOCKS}, got {self.block}")

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        hp = {"hp": "h" if self.splits == 1 else "hp"}  # the slices of h (h itself when one)
        return [("project_a_tiled", dict(rank=rank, in_dim=in_dim, tokens=tokens,
                                         threads=self.threads, splits=self.splits, dtype=dtype,
                                         block=self.block), hp),
                ("tiled_b_add", dict(out_dim=out_dim, rank=rank, scale=float(scale),
                                     tokens=tokens, tile_tokens=self.tile_tokens,
                                     splits=self.splits, dtype=dtype,
                                     save_h=save_h and self.splits > 1), hp)]

    def scratch(self, save_h=False):
        if self.splits == 1:
            return {"h": 1}
        return {"hp": self.splits, "h": 1} if save_h else {"hp": self.splits}

    @classmethod
    def candidates(cls, rank, in_dim, out_dim, tokens, subgroups, matrices=()):
        """From rank 16 and 64 tokens where the shape is a multiple of 4 (rank 64:
        T = 512 30-32 us against tiled's 57 on the H200; optimisation notes 22-23);
        8 tokens per thread from 512 tokens."""
        if rank < 16 or tokens < 64 or rank % 4 or in_dim % 4 or out_dim % 4:
            return []
        return [cls(threads, 16, splits, block)
                for threads in ((64, 128) if rank <= 16 else (128, 256))
                for splits in (4, 8, 16) if splits * 32 <= in_dim
                for block in ((4, 8) if tokens >= 512 else (4,))]


@forward_strategy
class Matrix(Strategy):
    """f16 on matrix units, two dispatches: project_a_matrix (h in ``splits``
    slices of in_dim, 2 x ``fragments`` fragments of tokens per workgroup,
    ``depth`` columns of x per staged slice), then b_add_matrix (2 x 2
    subgroups of ``rows`` x ``cols`` fragments) or, with ``direct``,
    b_add_direct (``rows`` fragments of tokens per workgroup, ``cols``
    fragments of columns per subgroup, the output's f16 fragments as the
    accumulators)."""

    name: ClassVar[str] = "matrix"
    numbers: ClassVar[tuple] = ("splits", "fragments", "rows", "cols", "depth")
    shown: ClassVar[int] = 1
    flags: ClassVar[tuple] = (("direct", "direct", True),)
    splits: int = 1
    fragments: int = 2
    rows: int = 2
    cols: int = 4
    depth: int = 32
    direct: bool = False

    def validate(self) -> None:
        for f in self.numbers:
            if getattr(self, f) < 1:
                raise ValueError(f"matrix: {f} must be >= 1, got {getattr(self, f)}")
        if self.depth % 16:
            raise ValueError(f"matrix: depth must be a multiple of 16 (the fragments' K), "
                             f"got {self.depth}")

    def kernels(self, rank, in_dim, out_dim, scale, tokens, dtype, save_h=False):
        if dtype != "f16":
            raise ValueError(f"the matrix strategy multiplies f16 on matrix units; the "
                             f"weight is {dtype} (use an f16 weight, or another strategy)")
        hp = {"hp": "h" if self.splits == 1 else "hp"}
        b_add = "b_add_direct" if self.direct else "b_add_matrix"
        return [("project_a_matrix", dict(rank=rank, in_dim=in_dim, tokens=tokens,
                                          splits=self.splits, fragments=self.fragments,
                                          depth=self.depth), hp),
                (b_add, dict(out_dim=out_dim, rank=rank, scale=float(scale), tokens=tokens,
                             splits=self.splits, rows=self.rows, cols=self.cols,
                             save_h=save_h and self.splits > 1), hp)]

    scratch = Gemm.scratch

    @classmethod
    def candidates(cls, rank, in_dim, out_dim, tokens, subgroups, matrices=()):
        """Where the adapter multiplies f16 16x16x16 into f32, from rank 16 and
        16 tokens (at rank 8 on the H200 they ran 45-200 us against tiled's
        29 at T = 4096; optimisation note 30), then the direct forms where it
        also has f16 results (on the H200 their b_add took 83 us against 55
        at rank 64, 4096 tokens, and 14.4 against 16.3 at 512; note 34)."""
        from ..kernels.matrix import DIRECT, FRAGMENT
        if FRAGMENT not in matrices or rank < 16 or tokens < 16 or rank % 4 or in_dim % 4 \
                or out_dim % 4:
            return []
        splits = [s for s in (1, 2, 4, 8, 16) if in_dim % (4 * s) == 0 and s * tokens <= 8192]
        direct = [cls(s, 1, r, c, direct=True) for s in splits for r, c in ((1, 2), (2, 2))
                  if DIRECT in matrices and rank % 16 == 0 and out_dim % (16 * c) == 0]
        return [cls(s, 1, r, c) for s in splits for r, c in ((2, 2), (1, 2), (1, 4))] + direct


STRATEGIES = tuple(FORWARD)
