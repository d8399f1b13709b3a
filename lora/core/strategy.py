"""Strategies: how a LoRA forward runs, one registry entry per strategy.

An entry is a frozen dataclass registered with :func:`forward_strategy`: its
fields are its parameters, its text form (``str``/``Strategy.parse``:
``name(field=value, ...)``, fields at their defaults left out) is what the
autotuner caches and ``LORA_STRATEGY`` and ``--strategy`` take;
``kernels()`` names its dispatches for a :class:`~lora.core.shape.LayerShape`,
``scratch()`` the f32 buffers between them, and ``candidates()`` what the
autotuner times for a shape. Adding a strategy is one entry here;
:class:`lora.core.plan.Plan` builds it and :mod:`lora.core.tuning` reads
the registry.

========================================================  ==========  =============================
entry and its fields (defaults)                           dispatches  kernels
========================================================  ==========  =============================
``seed``                                                  2           project_a_seed (Hesper's
                                                                      design), fused_b_add
``three(threads=256, projection="workgroup",              3           project_a, project_b,
subgroups=False)``                                                    add_scaled (Hesper's three)
``split(threads=256, rank_group=0,                        2           project_a (per token,
projection="workgroup", subgroups=False)``                            rank_group ranks per
                                                                      workgroup), fused_b_add
``single(threads=256, outputs_per_thread=1,               1           fused_forward (h recomputed
unroll=True, subgroups=False)``                                       by every workgroup)
``tiled(threads=256, tile_tokens=16, token_block=1,       1           tiled_forward (tile_tokens
unroll=True, quad=False, half=False)``                                per workgroup, token_block
                                                                      per thread in phase 1)
``gemm(threads=128, tile_tokens=16, splits=1, block=4)``  2           project_a_tiled (block = 4
                                                                      or 8 tokens x 4 ranks per
                                                                      thread, splits slices of
                                                                      in_dim), tiled_b_add
                                                                      (tile_tokens x 256 columns
                                                                      per workgroup)
``matrix(splits=1, fragments=2, rows=2, cols=4,           2           f16 on matrix units:
depth=32, direct=False, group=0)``                                    project_a_matrix, then
                                                                      b_add_matrix (direct: in
                                                                      the output's fragments)
========================================================  ==========  =============================

``subgroups`` reduces with subgroup operations, ``unroll=False`` keeps
column loops as WGSL loops, ``quad`` gives each thread four adjacent output
columns (read and written as vec4), ``half`` (f16 weights; never a
candidate) sums the products of A and x in f16 four at a time, and
``projection="seed"`` computes h
with Hesper's one-thread-per-element kernel (``seed`` is Hesper's whole
design: that kernel, then fused_b_add with 256 threads). The older
positional texts (``split:256:8:sg``, ``tiled:512:16:loop``) still parse.
"""
from __future__ import annotations

import ast
import numbers
from dataclasses import dataclass, fields
from typing import ClassVar, Self, dataclass_transform

import numpy as np

from ..kernels import tiled_fits
from ..kernels.gemm import GEMM_BLOCKS
from ..kernels.tiled import QUAD_MAX_RANK
from .shape import LayerShape

GEMM_TILE_TOKENS = 32  # gemm's tiled_b_add keeps a vec4 per token of its tile in registers


@dataclass_transform(frozen_default=True)  # each entry class is made a frozen dataclass
@dataclass(frozen=True)
class Entry:
    """What every strategy entry (forward or backward) shares: fields checked
    against their defaults' types, a power-of-two workgroup size where it has
    one, and the keyed text form ``name(field=value, ...)``.

    ``str()`` writes the fields that differ from their defaults (an entry
    with all its defaults is its bare name); ``parse()`` reads that and the
    older positional form ``name:numbers:words``, whose layout ``numbers``
    (the int fields in text order) and ``flags`` ((word, field, value) of
    each word) describe."""

    name: ClassVar[str] = ""
    family: ClassVar[dict]  # name -> entry class, on each family's base
    kind: ClassVar[str] = "strategy"  # how messages name the family
    renamed: ClassVar[dict] = {}  # former name -> (today's, what it is)
    numbers: ClassVar[tuple[str, ...]] = ()
    flags: ClassVar[tuple[tuple[str, str, object], ...]] = ()
    subgroups = False  # (not a field here: the entries with a subgroup form have one)

    def __post_init__(self):
        if not self.name:
            raise TypeError(f"{type(self).__name__} is the base of the registry's entries: use "
                            f"{type(self).__name__}.parse(text) or an entry class")
        for f in fields(self):
            object.__setattr__(self, f.name, _field_value(self.name, f.name, f.default,
                                                          getattr(self, f.name)))
        threads = getattr(self, "threads", 1)
        if threads < 1 or threads & (threads - 1):
            raise ValueError(f"threads must be a power of two, got {threads!r}")
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for fields that do not go together."""

    def __str__(self) -> str:
        changed = [f"{f.name}={_value_text(getattr(self, f.name))}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return f"{self.name}({', '.join(changed)})" if changed else self.name

    @classmethod
    def parse(cls, text: str) -> Self:
        """Inverse of str(): e.g. 'seed', 'split(rank_group=8, subgroups=True)',
        'tiled(threads=512, tile_tokens=16, unroll=False)'; the positional
        form ('split:256:8:sg', 'tiled:512:16:loop') is read too."""
        if not isinstance(text, str):
            raise TypeError(f"{cls.kind}: expected a text such as {cls.full_text()!r}, "
                            f"got {text!r}")
        name = text.split("(", 1)[0].split(":", 1)[0].strip()
        entry = cls.family.get(name)
        if entry is None:
            raise ValueError(cls._unknown(name, text))
        if "(" in text or ":" not in text:
            return entry._parse_keyed(text)
        return entry._parse_positional(text)

    @classmethod
    def _parse_keyed(cls, text: str) -> Self:
        """``name(field=value, ...)``: values are Python literals (ints,
        True/False, quoted words), each field at most once."""
        rest = text.strip()[len(cls.name):].strip() or "()"
        try:
            call = ast.parse(f"_{rest}", mode="eval").body
        except SyntaxError:  # (a field given twice is one too)
            call = None
        if not (rest.startswith("(") and isinstance(call, ast.Call) and
                isinstance(call.func, ast.Name) and not call.args and
                all(k.arg is not None for k in call.keywords)):
            raise ValueError(f"cannot parse {cls.kind} {text!r}: expected {cls.name}(field=value, "
                             f"...), each field once and by name, e.g. {cls.full_text()!r}")
        known = [f.name for f in fields(cls)]
        values = {}
        for keyword in call.keywords:
            if keyword.arg not in known:
                has = f"its fields (defaults): {cls.full_text()}" if known else "it has none"
                raise ValueError(f"cannot parse {cls.kind} {text!r}: {cls.name} has no field "
                                 f"{keyword.arg!r}; {has}")
            if keyword.arg in values:
                raise ValueError(f"cannot parse {cls.kind} {text!r}: {keyword.arg} is given twice")
            try:
                values[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError:
                raise ValueError(f"cannot parse {cls.kind} {text!r}: {keyword.arg}= takes a "
                                 f"number, True or False, or a quoted word") from None
        return cls._made(text, values)

    @classmethod
    def _made(cls, text: str, values: dict) -> Self:
        try:
            return cls(**values)
        except TypeError as e:  # a value of the wrong type: a bad text, said as one
            raise ValueError(f"cannot parse {cls.kind} {text!r}: {e}") from None

    @classmethod
    def _parse_positional(cls, text: str) -> Self:
        """The older form: the name, ints in ``numbers`` order, then words."""
        _, *parts = text.split(":")
        nums = []
        while parts and parts[0].lstrip("-").isdigit():
            nums.append(int(parts.pop(0)))
        words = {flag: (field, value) for flag, field, value in cls.flags}
        foreign = [p for p in parts if p not in words]
        owners = [other.name for other in cls.family.values()
                  if any(flag in foreign for flag, _, _ in other.flags)]
        if owners:
            raise ValueError(f"cannot parse {cls.kind} {text!r}: {cls.name!r} takes no word "
                             f"{foreign[0]!r}; it belongs to {' and '.join(owners)}")
        if foreign or len(set(parts)) < len(parts) or len(nums) > len(cls.numbers):
            words_said = f" then any of the words {list(words)}" if words else " and no words"
            raise ValueError(f"cannot parse {cls.kind} {text!r}: {cls.name!r} takes up to "
                             f"{len(cls.numbers)} number(s) ({', '.join(cls.numbers) or 'none'})"
                             f"{words_said}; or write its fields by name, e.g. "
                             f"{cls.full_text()!r}")
        return cls._made(text, {**dict(zip(cls.numbers, nums)), **dict(words[p] for p in parts)})

    @classmethod
    def _unknown(cls, name: str, text: str) -> str:
        if name in cls.renamed:
            new, what = cls.renamed[name]
            return (f"{cls.kind} {name!r} is now called {new!r}{what}; write "
                    f"{text.replace(name, new, 1)!r}")
        return f"{cls.kind} must be one of {tuple(cls.family)}, got {name!r} in {text!r}"

    @classmethod
    def example(cls) -> Self:
        """The entry with its defaults (for messages)."""
        return cls()

    @classmethod
    def full_text(cls) -> str:
        """The keyed text with every field at its default (for messages)."""
        entry = cls.example()
        shown = ", ".join(f"{f.name}={_value_text(getattr(entry, f.name))}"
                          for f in fields(entry))
        return f"{entry.name}({shown})"


def _value_text(value) -> str:
    """A field's value as the keyed text writes it: 8, True, "seed"."""
    return f'"{value}"' if isinstance(value, str) else str(value)


def _field_value(entry: str, field: str, default, value):
    """``value`` checked against the type of the field's default: an int
    (not a bool), True or False, or a word; numpy's ints and bools become Python's."""
    if isinstance(default, bool):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{entry}: {field} must be True or False, got {value!r}")
        return bool(value)
    if isinstance(default, int):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{entry}: {field} must be an int, got {value!r}")
        return int(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise TypeError(f"{entry}: {field} must be a word (a str), got {value!r}")
    return value


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

    def kernels(self, shape: LayerShape, save_h: bool = False) -> list[tuple]:
        """(name in lora.kernels.KERNELS, parameters[, binding renames]) of each
        dispatch, in order; ``save_h``: h is left in the "h" buffer for the
        backward. ``shape.tokens`` None: the run-time forms (token count in a
        uniform)."""
        raise NotImplementedError

    def scratch(self, shape: LayerShape, save_h: bool = False) -> dict[str, tuple[int, int]]:
        """The f32 buffers between dispatches, the one place their sizes are
        written: role -> (rows per token, columns); h is [tokens, rank], y
        [tokens, out_dim], gemm's and matrix's hp [splits * tokens, rank]."""
        return {"h": (1, shape.rank)} if save_h else {}

    @classmethod
    def candidates(cls, shape: LayerShape, subgroups: bool,
                   matrices: tuple = ()) -> list["Strategy"]:
        """The forms of this strategy worth timing for a shape with a token
        count (``subgroups``: whether the adapter has them; ``matrices``: its
        subgroup-matrix shapes for this storage dtype, shaderdsl.types.MatrixConfig)."""
        return []


def _sgs(subgroups: bool) -> tuple:
    return (False, True) if subgroups else (False,)


def _projection(projection: str, shape: LayerShape, threads: int, subgroups: bool,
                rank_group: int = 0) -> tuple:
    """project_a: a workgroup per token (and per group of ranks), or Hesper's seed."""
    params = dict(rank=shape.rank, in_dim=shape.in_dim, tokens=shape.tokens, dtype=shape.dtype)
    if projection == "seed":
        return ("project_a_seed", params)
    group = rank_group if 0 < rank_group < shape.rank else 0
    return ("project_a", dict(params, threads=threads, subgroups=subgroups, rank_group=group))


def _fused_b(shape: LayerShape, threads: int) -> tuple:
    return ("fused_b_add", dict(out_dim=shape.out_dim, rank=shape.rank, scale=shape.scale,
                                tokens=shape.tokens, threads=threads, dtype=shape.dtype))


def _check_projection(name: str, projection: str, subgroups: bool) -> None:
    """three and split: project_a by a workgroup per token, or Hesper's seed."""
    if projection not in ("workgroup", "seed"):
        raise ValueError(f"projection: expected one of ('workgroup', 'seed'), got "
                         f"{projection!r}")
    if subgroups and projection == "seed":
        raise ValueError(f"the {name} strategy with Hesper's seed projection has no "
                         f"subgroup form")


@forward_strategy
class Seed(Strategy):
    """Hesper's design: project_a_seed (a thread per element of h), fused_b_add."""

    name: ClassVar[str] = "seed"

    def kernels(self, shape, save_h=False):
        return [_projection("seed", shape, 256, False), _fused_b(shape, 256)]

    def scratch(self, shape, save_h=False):
        return {"h": (1, shape.rank)}

    @classmethod
    def candidates(cls, shape, subgroups, matrices=()):
        return [cls()]  # wins on some adapters (CPU ones: few, long threads)


@forward_strategy
class Three(Strategy):
    """Hesper's three dispatches: project_a, project_b into y, add_scaled."""

    name: ClassVar[str] = "three"
    numbers: ClassVar[tuple] = ("threads",)
    flags: ClassVar[tuple] = (("seed", "projection", "seed"), ("sg", "subgroups", True))
    threads: int = 256
    projection: str = "workgroup"
    subgroups: bool = False

    def validate(self) -> None:
        _check_projection(self.name, self.projection, self.subgroups)

    def kernels(self, shape, save_h=False):
        t, tokens, out_dim = self.threads, shape.tokens, shape.out_dim
        count = dict(num_elements=tokens * out_dim) if tokens is not None else \
            dict(num_elements=None, columns=out_dim)  # run time: tokens * out_dim
        return [_projection(self.projection, shape, t, self.subgroups),
                ("project_b", dict(out_dim=out_dim, rank=shape.rank, tokens=tokens, threads=t,
                                   dtype=shape.dtype)),
                ("add_scaled", dict(count, scale=shape.scale, threads=t, dtype=shape.dtype))]

    def scratch(self, shape, save_h=False):
        return {"h": (1, shape.rank), "y": (1, shape.out_dim)}


@forward_strategy
class Split(Strategy):
    """project_a (a workgroup per token, or per token and group of ranks), then fused_b_add."""

    name: ClassVar[str] = "split"
    numbers: ClassVar[tuple] = ("threads", "rank_group")
    flags: ClassVar[tuple] = (("seed", "projection", "seed"), ("sg", "subgroups", True))
    threads: int = 256
    rank_group: int = 0
    projection: str = "workgroup"
    subgroups: bool = False

    def validate(self) -> None:
        _check_projection(self.name, self.projection, self.subgroups)
        if self.rank_group < 0:
            raise ValueError(f"rank_group must be >= 0, got {self.rank_group}")
        if self.rank_group and self.projection == "seed":
            raise ValueError(f"rank_group applies to the workgroup projection, not to "
                             f"Hesper's seed projection ({self})")

    def kernels(self, shape, save_h=False):
        return [_projection(self.projection, shape, self.threads, self.subgroups,
                            self.rank_group),
                _fused_b(shape, self.threads)]

    def scratch(self, shape, save_h=False):
        return {"h": (1, shape.rank)}

    @classmethod
    def candidates(cls, shape, subgroups, matrices=()):
        out = []
        if shape.rank > 8 and shape.token_count <= 64:  # A's rows shared: per rank group
            out += [cls(256, group, subgroups=sg) for group in (4, 8) for sg in _sgs(subgroups)]
        return out + [cls(256, subgroups=sg) for sg in _sgs(subgroups)]


def _both(shape: LayerShape, threads: int, unroll: bool, save_h: bool) -> dict:
    """The parameters fused_forward and tiled_forward share."""
    return dict(rank=shape.rank, in_dim=shape.in_dim, out_dim=shape.out_dim, scale=shape.scale,
                tokens=shape.tokens, threads=threads, unroll=unroll, dtype=shape.dtype,
                **({"save_h": True} if save_h else {}))


@forward_strategy
class Single(Strategy):
    """One dispatch, fused_forward: every workgroup recomputes h for its token."""

    name: ClassVar[str] = "single"
    numbers: ClassVar[tuple] = ("threads", "outputs_per_thread")
    flags: ClassVar[tuple] = (("loop", "unroll", False), ("sg", "subgroups", True))
    threads: int = 256
    outputs_per_thread: int = 1
    unroll: bool = True
    subgroups: bool = False

    def validate(self) -> None:
        if self.outputs_per_thread < 1:
            raise ValueError(f"outputs_per_thread must be >= 1, got {self.outputs_per_thread}")

    def kernels(self, shape, save_h=False):
        both = _both(shape, self.threads, self.unroll, save_h)
        return [("fused_forward", dict(both, outputs_per_thread=self.outputs_per_thread,
                                       subgroups=self.subgroups))]

    @classmethod
    def candidates(cls, shape, subgroups, matrices=()):
        if shape.token_count == 1:
            return [cls(t, 1, unroll, sg) for sg in _sgs(subgroups) for t in (256, 512, 1024)
                    for unroll in (True, False)]
        return [cls(256, -(-shape.out_dim // 256), False, sg) for sg in _sgs(subgroups)]


@forward_strategy
class Tiled(Strategy):
    """One dispatch, tiled_forward: a tile of tokens per workgroup, h in workgroup memory."""

    name: ClassVar[str] = "tiled"
    numbers: ClassVar[tuple] = ("threads", "tile_tokens", "token_block")
    flags: ClassVar[tuple] = (("loop", "unroll", False), ("q", "quad", True),
                              ("half", "half", True))
    threads: int = 256
    tile_tokens: int = 16
    token_block: int = 1
    unroll: bool = True
    quad: bool = False  # four adjacent output columns per thread
    half: bool = False  # f16 weights: A . x summed in f16 four products at a time

    def validate(self) -> None:
        if self.tile_tokens < 1 or self.threads % self.tile_tokens:
            raise ValueError(f"tile_tokens must divide threads, got {self.tile_tokens} "
                             f"and {self.threads}")
        if self.token_block < 1 or self.tile_tokens % self.token_block:
            raise ValueError(f"token_block must divide tile_tokens, got {self.token_block} "
                             f"with tile_tokens {self.tile_tokens}")

    def kernels(self, shape, save_h=False):
        both = _both(shape, self.threads, self.unroll, save_h)
        return [("tiled_forward", dict(both, tile_tokens=self.tile_tokens,
                                       token_block=self.token_block, quad=self.quad,
                                       half=self.half))]

    @classmethod
    def candidates(cls, shape, subgroups, matrices=()):
        rank, in_dim, out_dim, tokens = shape.rank, shape.in_dim, shape.out_dim, shape.token_count
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
        return out + cls._streaming_candidates(shape)

    @classmethod
    def _streaming_candidates(cls, shape: LayerShape) -> list[Self]:
        """The memory-bound forward up to rank 16 from 64 tokens (f16 rank 8,
        4096 tokens on the H200: 29.4 us with quad columns where a copy of its
        bytes takes 15; phase 1 alone 16.1 us for 21 MB of x, bound by the
        loads and f16 -> f32 conversions of A that every token repeats):
        2 tokens per thread in phase 1 of 16-token tiles, so that each load
        (and conversion) of A serves two (27.6 us at 256 threads, which the
        autotuner chose; optimisation note 39). Not offered: ``half``, whose
        f16 sums leave the f16 bound of lora.core.reference (an explicit
        choice only)."""
        rank, tokens = shape.rank, shape.token_count
        if rank > QUAD_MAX_RANK or tokens < 64 or rank % 4 or shape.in_dim % 4 \
                or shape.out_dim % 4:
            return []
        return [cls(threads, 16, 2, quad=True) for threads in (256, 512)
                if tiled_fits(rank, threads, 16, 2)]


@forward_strategy
class Gemm(Strategy):
    """Two dispatches: project_a_tiled (h as a matrix product, in ``splits``
    slices of in_dim, ``block`` tokens per thread), then tiled_b_add (a tile of
    tokens x 256 columns)."""

    name: ClassVar[str] = "gemm"
    numbers: ClassVar[tuple] = ("threads", "tile_tokens", "splits", "block")
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

    def kernels(self, shape, save_h=False):
        hp = {"hp": "h" if self.splits == 1 else "hp"}  # the slices of h (h itself when one)
        return [("project_a_tiled", dict(rank=shape.rank, in_dim=shape.in_dim,
                                         tokens=shape.tokens, threads=self.threads,
                                         splits=self.splits, dtype=shape.dtype,
                                         block=self.block), hp),
                ("tiled_b_add", dict(out_dim=shape.out_dim, rank=shape.rank, scale=shape.scale,
                                     tokens=shape.tokens, tile_tokens=self.tile_tokens,
                                     splits=self.splits, dtype=shape.dtype,
                                     save_h=save_h and self.splits > 1), hp)]

    def scratch(self, shape, save_h=False):
        """h, or its ``splits`` slices (hp) and, with ``save_h``, their sum (h)."""
        h = {"h": (1, shape.rank)}
        if self.splits == 1:
            return h
        return {"hp": (self.splits, shape.rank), **(h if save_h else {})}

    @classmethod
    def candidates(cls, shape, subgroups, matrices=()):
        """From rank 16 and 64 tokens where the shape is a multiple of 4 (rank 64:
        T = 512 30-32 us against tiled's 57 on the H200; optimisation notes 22-23);
        8 tokens per thread from 512 tokens."""
        rank, in_dim, out_dim, tokens = shape.rank, shape.in_dim, shape.out_dim, shape.token_count
        if rank < 16 or tokens < 64 or rank % 4 or in_dim % 4 or out_dim % 4:
            return []
        return [cls(threads, 16, splits, block)
                for threads in ((64, 128) if rank <= 16 else (128, 256))
                for splits in (4, 8, 16) if splits * 32 <= in_dim
                for block in ((4, 8) if tokens >= 512 else (4,))]


@forward_strategy
class Matrix(Strategy):
    """f16 on matrix units (shaderdsl.matmul's engine), two dispatches:
    project_a_matrix (h in ``splits`` slices of in_dim, 2 x ``fragments``
    fragments of tokens per workgroup, ``depth`` columns of x per staged
    slice), then b_add_matrix (2 x 2 subgroups of ``rows`` x ``cols``
    fragments; ``group``: row blocks per group of its workgroup order, 0:
    off; ``direct``: the output's own f16 fragments as the accumulators, the
    engine's in-place epilogue): lora.kernels.matrix. What the autotuner
    tries, and why: ``candidates``."""

    name: ClassVar[str] = "matrix"
    numbers: ClassVar[tuple] = ("splits", "fragments", "rows", "cols", "depth", "group")
    flags: ClassVar[tuple] = (("direct", "direct", True),)
    splits: int = 1
    fragments: int = 2
    rows: int = 2
    cols: int = 4
    depth: int = 32
    direct: bool = False
    group: int = 0

    def validate(self) -> None:
        for f in ("splits", "fragments", "rows", "cols", "depth"):
            if getattr(self, f) < 1:
                raise ValueError(f"matrix: {f} must be >= 1, got {getattr(self, f)}")
        if self.depth % 16:
            raise ValueError(f"matrix: depth must be a multiple of 16 (the fragments' K), "
                             f"got {self.depth}")
        if self.group < 0:
            raise ValueError(f"matrix: group must be >= 0 (0: off), got {self.group}")

    def kernels(self, shape, save_h=False):
        if shape.dtype != "f16":
            raise ValueError(f"the matrix strategy multiplies f16 on matrix units; the "
                             f"weight is {shape.dtype} (use an f16 weight, or another strategy)")
        hp = {"hp": "h" if self.splits == 1 else "hp"}
        return [("project_a_matrix", dict(rank=shape.rank, in_dim=shape.in_dim,
                                          tokens=shape.tokens, splits=self.splits,
                                          fragments=self.fragments, depth=self.depth), hp),
                ("b_add_matrix", dict(out_dim=shape.out_dim, rank=shape.rank, scale=shape.scale,
                                      tokens=shape.tokens, splits=self.splits, rows=self.rows,
                                      cols=self.cols, save_h=save_h and self.splits > 1,
                                      group=self.group, direct=self.direct), hp)]

    scratch = Gemm.scratch

    @classmethod
    def candidates(cls, shape, subgroups, matrices=()):
        """Where the adapter multiplies f16 16x16x16 into f32, from rank 16 and
        16 tokens (at rank 8 on the H200 they ran 45-200 us against tiled's
        29 at T = 4096; optimisation note 30): one fragment of tokens per
        project_a workgroup, every split of in_dim up to 8192 rows of hp, and
        b_add tilings (rows, cols) = (2, 2), (1, 2), (1, 4), which measured
        best (note 30); up to 1024 tokens also depth 64 (17.55 against 18.03
        us at rank 64, T = 512; note 37); then the direct forms where it also
        has f16 results (the engine's in-place epilogue; the kernel it replaced,
        b_add_direct, took 83 us against 55 on the H200 at rank 64, 4096
        tokens, and 14.4 against 16.3 at 512; note 34). Not tried: ``group``,
        within 1.7 % either way on the H200 (note 37)."""
        from ..kernels.matrix import DIRECT, FRAGMENT
        rank, in_dim, out_dim, tokens = shape.rank, shape.in_dim, shape.out_dim, shape.token_count
        if FRAGMENT not in matrices or rank < 16 or tokens < 16 or rank % 4 or in_dim % 4 \
                or out_dim % 4:
            return []
        splits = [s for s in (1, 2, 4, 8, 16) if in_dim % (4 * s) == 0 and s * tokens <= 8192]
        direct = [cls(s, 1, r, c, direct=True) for s in splits for r, c in ((1, 2), (2, 2))
                  if DIRECT in matrices]
        tilings = ((2, 2), (1, 2), (1, 4))
        # few tokens: project_a's workgroups each walk a long slice; 64 columns per staged
        # slice halve its barriers (faster at T = 512, slower at 4096: note 37)
        deep = [cls(s, 1, 2, 2, depth=64) for s in splits] if tokens <= 1024 else []
        return [cls(s, 1, r, c) for s in splits for r, c in tilings] + deep + direct

