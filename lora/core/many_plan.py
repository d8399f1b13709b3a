"""The plan of a batch whose rows each name an adapter of a pool: the
routes (host ids checked and sorted into tiles, or device ids read by the
kernels) and ``ManyPlan``, which records the kernels of lora.kernels.many
(made by ``AdapterPool.forward_plan``).

Ids are slots of the pool; -1 gives a row no delta (peft's "__base__").
Host ids are checked before anything runs. Device ids (an int32 buffer)
are read by the kernels: a row naming no adapter gets no delta and is
counted in the plan's sticky flags, reported (ValueError) at the next
``plan.read`` or ``plan.check_ids``, as cross-entropy reports its labels.
Ids may be sorted into segments (tiles of up to ``tile_tokens`` rows of one
adapter, so each tile reads its adapter once): host ids on the host, device
ids by a counting sort on the GPU (lora.kernels.many_sort) in the same submit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shaderdsl import checks
from shaderdsl.devicebuffer import DeviceBuffer
from shaderdsl.errors import BindingError, FeatureError

from ..kernels.many import FLAGS
from ..kernels.many_matrix import hp_columns, matrix_layout
from ..kernels.many_sort import tile_bound
from ..kernels.matrix import FRAGMENT
from . import checks as C
from .auto import auto_plan
from .cache import clear_plan_cache
from .checks import count, host_values
from .plan import build_steps, launch, record_steps
from .weight import wgsl_dtype

ID_DTYPE = np.dtype(np.int32)
SORT_THREADS = 256  # rows per block of the GPU's sort (lora.kernels.many_sort)

# The ManyPlan options worth timing against each other (the bench's sweep):
# fused or split, segments or rows, tiles, lanes, rank blocks and rank rows, and the
# segments on matrix units. Tiles of 16 or more rows fit only where the device has over
# 16 KiB of workgroup memory (the matrix forms: 31-39 KiB at max_rank 64).
CANDIDATES = {
    "fused segments t4": dict(segments=True, fused=True, tile_tokens=4),
    "fused segments t8": dict(segments=True, fused=True, tile_tokens=8),
    "fused segments t8 l32": dict(segments=True, fused=True, tile_tokens=8, lanes=32),
    "fused segments t16": dict(segments=True, fused=True, tile_tokens=16),
    "fused segments t32": dict(segments=True, fused=True, tile_tokens=32),
    "fused segments t16 th128": dict(segments=True, fused=True, tile_tokens=16, threads=128),
    "fused segments t8 rr4 l32": dict(segments=True, fused=True, tile_tokens=8, rank_rows=4,
                                      lanes=32),
    "fused segments t16 rr4 l64": dict(segments=True, fused=True, tile_tokens=16, rank_rows=4,
                                       lanes=64),
    "fused rows": dict(segments=False, fused=True),
    "fused rows l64": dict(segments=False, fused=True, lanes=64),
    "split segments t8": dict(segments=True, fused=False, tile_tokens=8),
    "split segments t16": dict(segments=True, fused=False, tile_tokens=16),
    "split segments t8 rb16": dict(segments=True, fused=False, tile_tokens=8, rank_block=16),
    "split rows": dict(segments=False, fused=False),
    "split rows rb16": dict(segments=False, fused=False, rank_block=16),
    "split rows rr4 l64 rb16": dict(segments=False, fused=False, rank_rows=4, lanes=64,
                                    rank_block=16),
    # on matrix units (f16 pools, devices with f16 -> f32 16x16x16 subgroup matrices):
    # tiles of 16, 32 or 64 rows, one dispatch (one or two
    # workgroups per tile) or two (the shrink over slices of in_dim)
    "matrix fused t16": dict(segments=True, matrix=True, tile_tokens=16),
    "matrix fused t32": dict(segments=True, matrix=True, tile_tokens=32),
    "matrix fused t64": dict(segments=True, matrix=True, tile_tokens=64),
    "matrix fused t64 cs2": dict(segments=True, matrix=True, tile_tokens=64, column_splits=2),
    "matrix split t16 s2 cs8": dict(segments=True, matrix=True, fused=False, tile_tokens=16,
                                    splits=2, column_splits=8),
    "matrix split t32 s2 cs8": dict(segments=True, matrix=True, fused=False, tile_tokens=32,
                                    splits=2, column_splits=8),
    "matrix split t64 s4 cs8": dict(segments=True, matrix=True, fused=False, tile_tokens=64,
                                    splits=4, column_splits=8),
    "matrix split t32 s4": dict(segments=True, matrix=True, fused=False, tile_tokens=32,
                                splits=4),
}

# The rule forward_many follows (chosen_form), read off the H200's tables
# (docs/benchmarks.md; docs/bench/h200-many-tint.json, the SIMT forms, and
# h200-many-matrix-tint.json, with the matrix forms): among the SIMT forms the same won
# in f16 and f32, and at 4, 32 and 100 adapters; the rows per adapter, the batch's rows
# and the ranks the rows read pick one. Where the matrix forms run (f16 pools on devices
# with f16 16x16x16 subgroup matrices) they won every prefill and decode from 25 adapters.
SEGMENT_ROWS = 32  # rows per adapter from which segments won (decode: <= 16, prefill: >= 40)
FUSED_ROWS, FUSED_RANK = 1024, 40  # fused tiles of 16 won at 4096 rows of rank 64, not at 64
# rows (4 tiles: too few workgroups) nor where the ranks cycle 4-64 (a mean of 25)
MATRIX_DECODE_USED = 16  # decode on matrix units from this many adapters (won at 25 and 46
# used, lost 1.2x at 4)
MATRIX_FUSED_ROWS = 64  # fewer rows per adapter: one fused tile of 64 rows each (40: 186 us
# where the split form took 226); more: the split form (128 and 1024: 125-138 us)


def chosen_form(rows: int, used: int, rank: float, matrix: bool = False) -> str:
    """The name in CANDIDATES of the form fastest on the H200 for a batch of
    ``rows`` rows with an adapter, of ``used`` distinct adapters, whose rows'
    mean rank is ``rank`` (within 1.13x of the fastest on every batch there);
    ``matrix``: the matrix forms can run (an f16 pool on a device with them)."""
    decode = rows < SEGMENT_ROWS * max(used, 1)
    if matrix and not (decode and used < MATRIX_DECODE_USED):
        if decode:
            return "matrix split t16 s2 cs8"  # 25, 46 used: 29.6, 35.3 us; SIMT 33.3, 46.6
        return "matrix fused t64" if rows < MATRIX_FUSED_ROWS * max(used, 1) \
            else "matrix split t32 s2 cs8"  # 4, 32, 100 adapters: 121-186 us; SIMT 136-237
    if decode:
        return "split rows rr4 l64 rb16"  # decode: 19.7-46.4 us, fused segments t8 74-166
    if rows >= FUSED_ROWS and rank >= FUSED_RANK:
        return "fused segments t16"  # rank 64: 409-434 us, split segments t8 rb16 590-666
    return "split segments t8 rb16"  # prefill: 137-334 us, fused segments t8 145-439


BASE = "__base__"  # peft's adapter_names word for a row without an adapter


def ids_by_name(ids: np.ndarray, index: dict, where: str) -> np.ndarray:
    """Adapter names (peft's ``adapter_names``: a name per row, ``"__base__"``
    for none) as the ints ``index`` maps them to; ValueError naming the first
    unknown one and what ``where`` holds, before anything runs."""
    names = ids.astype(object)
    unknown = [n for n in names.reshape(-1) if n != BASE and n not in index]
    if unknown:
        raise ValueError(f"ids: {unknown[0]!r} names no adapter of {where} (expected one of "
                         f"{list(index)} or {BASE!r}; {len(unknown)} row(s) refused, nothing ran)")
    return np.vectorize({**index, BASE: -1}.get, otypes=[np.int64])(names)


def host_ids(ids, shape: tuple, slots: list[int], bound: int) -> np.ndarray:
    """``ids`` (one int per row: shaped ``shape``, x's leading dimensions, or
    flat; or, where x has sequences, one per sample, shaped ``shape[:1]``, as
    peft's ``adapter_names``) as int32 per row, each -1 or a slot in
    ``slots``; ``bound``: the end of the range [-1, bound) named in messages."""
    arr = host_values(ids)
    rows = int(np.prod(shape, dtype=np.int64))
    if arr.size and arr.dtype.kind not in "iu":  # [] is float64 to numpy
        raise BindingError(f"ids: expected integers (an adapter's index, or -1 for none), got "
                           f"dtype {arr.dtype.name}")
    samples = int(shape[0]) if shape else 1
    if len(shape) >= 2 and arr.shape == (samples,):  # every token of a sample takes its id
        arr = np.repeat(arr, rows // max(samples, 1))
    if arr.shape != shape and arr.shape != (rows,):
        flat = "" if shape == (rows,) else f" or ({rows},)"
        sample = f", or one per sample {shape[:1]} as peft's adapter_names" \
            if len(shape) >= 2 else ""
        raise BindingError(f"ids: expected one id per row of x, shape {shape} (x.shape[:-1])"
                           f"{flat}{sample}, got {arr.shape}")
    flat = arr.reshape(-1).astype(np.int64)
    known = np.zeros(max(bound, 1) + 1, bool)
    known[0] = True  # -1, shifted to 0
    known[np.asarray(slots, np.int64) + 1] = True
    outside = (flat < -1) | (flat >= bound)
    bad = np.flatnonzero(outside | ~known[np.clip(flat + 1, 0, bound)])
    if bad.size:
        r, v = int(bad[0]), int(flat[bad[0]])
        why = (f"is outside [-1, {bound})" if outside[r] else
               f"names slot {v}, which holds no adapter (slots in use: {list(slots)})")
        raise ValueError(f"ids: id {v} at row {r} {why}; -1 means no adapter ({bad.size} "
                         f"row(s) refused, nothing ran)")
    return flat.astype(ID_DTYPE)


def segments(ids: np.ndarray, tile_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by adapter (rows with -1 left out) and the tiles over them:
    (order u32 [rows with an adapter], tiles u32 [n, 4] of (first index into
    order, row count <= tile_tokens, slot, 0))."""
    order = np.argsort(ids, kind="stable")
    order = order[ids[order] >= 0]
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]) if order.size \
        else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], order.size].astype(np.int64)
    tiles = [(first, min(tile_tokens, end - first), sorted_ids[start], 0)
             for start, end in zip(starts, ends) for first in range(start, end, tile_tokens)]
    return order.astype(np.uint32), np.array(tiles, np.uint32).reshape(-1, 4)


@dataclass(frozen=True)
class Route:
    """Which rows go to which adapter for one record: ``items`` work items
    (rows, or tiles with ``segments``), their buffers by role, the token count,
    and whether the ids are checked on the device. A route from
    ``ManyPlan.route`` is valid until that plan's next ``route``."""

    tokens: int
    items: int
    segments: bool
    buffers: dict
    on_device: bool
    generation: int = -1
    sort: bool = False  # device ids sorted into segments on the GPU first
    single: int = -1  # the slot every row names (host ids): lora.forward's own plan for it
    adapters: tuple = ()  # (slot, the pool's serial of its adapter) of each slot the ids name


class ManyPlan:
    """The pool's forward for batches of up to ``max_tokens`` rows, each row
    naming an adapter: ``record(x, ids, output)`` adds each row's delta to
    the output in place (x ``[T, in_dim]``, output ``[T, out_dim]``, the
    pool's dtype). ``ids``: host ints (checked, then routed), a
    :class:`Route` from :meth:`route` (route before opening a batch: a route
    writes buffers, and a write ends the open batch's submit), or an int32
    device buffer ``[T]`` (checked on the device, :meth:`read`; sorted on
    the GPU with ``segments``).
    ``segments``: the rows sorted into tiles of ``tile_tokens`` rows of one
    adapter (else one row per work item); ``fused``: one dispatch, else
    shrink and expand; ``threads``, ``lanes``, ``unroll``, ``rank_block``,
    ``rank_rows``: the kernels' (lora.kernels.many). ``matrix``: segments on
    matrix units instead (lora.kernels.many_matrix: f16 pools on a device
    with f16 -> f32 16x16x16 subgroup matrices; tiles of 16, 32 or 64 rows;
    ``fused``: one dispatch, else shrink and expand, the shrink over
    ``splits`` slices of in_dim; ``column_splits`` workgroups share a tile's
    blocks of output columns (0: one in the one dispatch, one per block in
    the expand); the SIMT options ``threads``, ``lanes``,
    ``unroll``, ``rank_block`` and ``rank_rows`` do not apply). ``one_adapter``: where
    every host id names one adapter, record ``lora.forward``'s own plan for it
    (:func:`lora.core.auto.auto_plan` on a copy of it, kept per slot) instead
    of the many kernels. Token counts are run-time values: a new count
    compiles nothing, nor does an adapter added to the pool."""

    def __init__(self, pool, max_tokens: int | None = None, *, segments: bool = True,
                 fused: bool = True, tile_tokens: int = 8, threads: int = 256, lanes: int = 16,
                 unroll: bool = True, rank_block: int = 0, rank_rows: int = 1,
                 one_adapter: bool = True, matrix: bool = False, column_splits: int = 0,
                 splits: int = 1):
        self.pool, self.device = pool, pool.device
        self.one_adapter = bool(one_adapter)
        self._weights: dict = {}  # slot -> (the pool's serial of it, its Weight copy)
        self.segments, self.fused, self.unroll = bool(segments), bool(fused), bool(unroll)
        self.rank_block = count(rank_block, "rank_block", 0)
        self.rank_rows = count(rank_rows, "rank_rows")
        if self.rank_block and self.fused:
            raise ValueError("rank_block splits the shrink of the two-dispatch form over "
                             "workgroups; the fused form keeps h in one workgroup: give "
                             "fused=False")
        self.tile_tokens = count(tile_tokens, "tile_tokens")
        self.matrix, self.column_splits = bool(matrix), count(column_splits, "column_splits", 0)
        self.splits = count(splits, "splits")
        if self.matrix:
            check_matrix(self.device, pool, self.segments, self.tile_tokens)
        if self.splits > 1 and (self.fused or not self.matrix):
            raise ValueError("splits slices in_dim over the shrink's workgroups of the matrix "
                             "form's two dispatches: give matrix=True, fused=False")
        self.threads, self.lanes = count(threads, "threads"), count(lanes, "lanes")
        fit = most_tokens(self.device, pool)
        self.max_tokens = fit if max_tokens is None else count(max_tokens, "max_tokens")
        if self.max_tokens > fit:
            raise BindingError(f"{self!r}: max_tokens {self.max_tokens} is over the {fit} rows "
                               f"of x or output that fit max-storage-buffer-binding-size")
        self._cap = self.device.limits["max-compute-workgroups-per-dimension"]
        self._steps: dict = {}
        self._owned: dict = {}  # role -> buffer the plan owns (route buffers, h, flags)
        self._generation = 0
        self.steps(self.segments, False)  # compile now: a bad layout is refused here

    def __repr__(self) -> str:
        form = ("matrix " if self.matrix else "") + ("fused" if self.fused else "split")
        form += " segments" if self.segments else " rows"
        return f"<ManyPlan {form} tile_tokens={self.tile_tokens} of {self.pool!r}>"

    def kernels(self, segments: bool, on_device: bool) -> list[tuple]:
        """(kernel name, parameters) of each dispatch."""
        p = self.pool
        if self.matrix:
            return self._matrix_kernels()
        common = dict(max_rank=p.max_rank, tokens=None, threads=self.threads,
                      tile_tokens=self.tile_tokens if segments else 1, segments=segments,
                      dtype=wgsl_dtype(p.dtype))
        shrink = dict(common, in_dim=p.in_dim, lanes=self.lanes, rank_rows=self.rank_rows,
                      check_ids=on_device and not segments,
                      unroll=self.unroll)
        if self.fused:
            return [("many_fused", dict(shrink, out_dim=p.out_dim))]
        return [("many_shrink", dict(shrink, rank_block=self.rank_block)),
                ("many_expand", dict(common, out_dim=p.out_dim))]

    def _matrix_kernels(self) -> list[tuple]:
        p = self.pool
        common = dict(max_rank=p.max_rank, tokens=None, tile_tokens=self.tile_tokens)
        if self.fused:
            return [("many_matrix", dict(common, in_dim=p.in_dim, out_dim=p.out_dim,
                                         column_splits=self.column_splits or 1))]
        return [("many_matrix_shrink", dict(common, in_dim=p.in_dim, splits=self.splits)),
                ("many_matrix_expand", dict(common, out_dim=p.out_dim, splits=self.splits,
                                            column_splits=self.column_splits))]

    def steps(self, segments: bool, on_device: bool) -> list:
        """The compiled steps of a route's kind (built once each)."""
        key = (segments, on_device)
        if key not in self._steps:
            t, p, item = self.max_tokens, self.pool, self.dtype_size
            sizes = {"x": t * p.in_dim * item, "output": t * p.out_dim * item, "ids": 4 * t,
                     "order": 4 * t, "tiles": 16 * t, "h": 4 * t * p.max_rank,
                     "hp": 4 * t * hp_columns(p.max_rank, self.splits),
                     "flags": 4 * FLAGS, "A": p.a.bound_bytes, "B": p.b.bound_bytes,
                     "table": p.table.bound_bytes}
            self._steps[key] = build_steps(self.device, self.kernels(*key), sizes, t, self._cap)
        return self._steps[key]

    def sort_steps(self) -> list:
        """The GPU's counting sort of device ids into segments (built once)."""
        if "sort" not in self._steps:
            t = self.max_tokens
            blocks, slots = -(-t // SORT_THREADS), len(self.pool.host_table)
            sizes = {"table": self.pool.table.bound_bytes, "ids": 4 * t, "local": 4 * t,
                     "counts": 4 * blocks * slots, "flags": 4 * FLAGS, "order": 4 * t,
                     "tiles": 16 * tile_bound(t, slots, self.tile_tokens)}
            kernels = [("many_sort_count", dict(tokens=None, threads=SORT_THREADS)),
                       ("many_sort_scan", dict(tokens=None, threads=256,
                                               tile_tokens=self.tile_tokens,
                                               block=SORT_THREADS)),
                       ("many_sort_scatter", dict(tokens=None, threads=SORT_THREADS))]
            self._steps["sort"] = build_steps(self.device, kernels, sizes, t, self._cap)
        return self._steps["sort"]

    @property
    def dtype_size(self) -> int:
        return self.pool.dtype.itemsize

    # ------------------------------------------------------------ routes

    def route(self, ids) -> Route:
        """Host ids checked (ValueError naming the first bad one, before
        anything is written) and written to the plan's buffers: as rows, or
        sorted into tiles (``segments``). Valid until the next route. Slots,
        or the names given to ``pool.add`` (``"__base__"`` for none). Holds
        the device's lock (the pool's slots and the plan's buffers)."""
        with self.device.lock:
            return self._route(ids)

    def _route(self, ids) -> Route:
        arr = host_values(ids)
        if arr.dtype.kind in "USO":
            arr = ids_by_name(arr, self.pool.names, "the pool")
        flat = host_ids(arr, arr.shape, self.pool.slots, len(self.pool.host_table))
        tokens = flat.size
        if not 1 <= tokens <= self.max_tokens:
            raise BindingError(f"{self!r}: {tokens} ids; a batch has 1 to {self.max_tokens} rows")
        self._generation += 1
        named = tuple((int(k), int(self.pool.serials[k])) for k in np.unique(flat[flat >= 0]))
        if self.one_adapter and flat[0] >= 0 and np.all(flat == flat[0]):
            self.single_plan(int(flat[0]), tokens)  # copied and compiled now, not in a batch
            return Route(tokens, tokens, False, {}, False, self._generation,
                         single=int(flat[0]), adapters=named)
        if not self.segments:
            self._put("ids", flat)
            return Route(tokens, tokens, False, {"ids": self._owned["ids"]}, False,
                         self._generation, adapters=named)
        order, tiles = segments(flat, self.tile_tokens)
        self._put("order", order)
        self._put("tiles", tiles)
        return Route(tokens, len(tiles), True, {r: self._owned[r] for r in ("order", "tiles")},
                     False, self._generation, adapters=named)

    def single_plan(self, slot: int, tokens: int):
        """``lora.forward``'s own plan (``auto_plan``: the tuned or the model's
        strategy) for the adapter in ``slot`` on ``tokens`` rows, on a copy of
        it made once per adapter (a slot refilled since gets a new copy); None
        where the slot holds no adapter now."""
        serial = int(self.pool.serials[slot]) if slot < len(self.pool.serials) else 0
        for old in [k for k, (s, _) in self._weights.items() if s != self.pool.serials[k]]:
            self._drop_weight(old)
        if not serial:
            return None
        if slot not in self._weights:
            self._weights[slot] = (serial, self.pool.weight(slot))
        return auto_plan(self.device, self._weights[slot][1], self.pool.scale(slot), tokens)

    def _drop_weight(self, slot: int) -> None:
        weight = self._weights.pop(slot)[1]
        clear_plan_cache(weight)
        for buf in (weight.a, weight.b):
            self.device.release(buf)

    def _buffer(self, role: str, rows: int, columns: tuple, dtype):
        """The plan's buffer for ``role``, of at least ``rows`` rows (grown to
        the next power of two where smaller)."""
        buf = self._owned.get(role)
        rows = max(1, rows)
        if buf is None or buf.shape[0] < rows:
            if buf is not None:
                self.device.release(buf)
            shape = (1 << (rows - 1).bit_length(),) + columns
            buf = self._owned[role] = self.device.empty(shape, dtype, name=f"many.{role}")
        return buf

    def _put(self, role: str, values: np.ndarray) -> None:
        """Write ``values`` at the start of the plan's buffer for ``role``."""
        buf = self._buffer(role, len(values), values.shape[1:], values.dtype)
        padded = np.zeros(buf.shape, buf.dtype)
        padded[:len(values)] = values
        self.device.write(buf, padded)

    def device_route(self, ids) -> Route:
        """A route of device ids: an int32 buffer [T], read by the kernels row by row."""
        checks.live_buffer(ids, self.device, "ids", "storage", ID_DTYPE,
                           " (one id per row: int32, -1 for none)")
        if len(ids.shape) != 1 or not 1 <= ids.shape[0] <= self.max_tokens:
            raise BindingError(f"ids: expected an int32 buffer of shape (T,) with 1 <= T <= "
                               f"{self.max_tokens}, got {ids.shape}")
        if "flags" not in self._owned:
            self._owned["flags"] = self.device.empty((FLAGS,), np.uint32, name="many.flags")
        t = ids.shape[0]
        given = {"ids": ids, "flags": self._owned["flags"]}
        if not self.segments:
            return Route(t, t, False, given, True)
        self._generation += 1  # the GPU rewrites order and tiles: earlier host routes go
        slots = len(self.pool.host_table)
        bound = tile_bound(t, slots, self.tile_tokens)
        given.update(local=self._buffer("local", t, (), np.uint32),
                     counts=self._buffer("counts", -(-t // SORT_THREADS) * slots, (), np.uint32),
                     order=self._buffer("order", t, (), np.uint32),
                     tiles=self._buffer("tiles", bound, (4,), np.uint32))
        return Route(t, bound, True, given, True, sort=True)

    # ------------------------------------------------------------ recording

    def check(self, x, ids, output) -> Route:
        """Every buffer: live, on this device, the pool's dtype, T rows of
        in_dim / out_dim as the ids say, none aliasing another; the route.
        x and output are checked before host ids are routed, so a refused
        call leaves the plan's last route as it was."""
        p, given = self.pool, _ids_per_row(x, ids, output)
        bufs = (("x", x, p.in_dim), ("output", output, p.out_dim))
        for what, buf, dim in bufs:
            C.storage(self.device, buf, what, p.dtype, " (the pool's dtype)")
            if given is not None:
                C.shaped(buf, given, dim, what, f"{'in' if what == 'x' else 'out'}_dim")
        mine = (("pool A", p.a, False), ("pool B", p.b, False), ("pool table", p.table, False))
        checks.distinct(("x", x, False), ("output", output, True), *mine)
        route = self._route_of(ids)
        for what, buf, dim in bufs:
            C.shaped(buf, route.tokens, dim, what, f"{'in' if what == 'x' else 'out'}_dim")
        checks.distinct(("x", x, False), ("output", output, True), *mine,
                        *((role, b, False) for role, b in route.buffers.items()
                          if role != "flags"))
        return route

    def _route_of(self, ids) -> Route:
        if isinstance(ids, Route):
            if not ids.on_device and ids.generation != self._generation:
                raise BindingError(f"{self!r}: this route was replaced by a later route(); "
                                   f"route the ids again")
            gone = [k for k, serial in ids.adapters if self.pool.serials[k] != serial]
            if gone:
                raise BindingError(f"{self!r}: this route names slot(s) {gone}, whose adapter "
                                   f"was removed (or replaced) since the route was made; route "
                                   f"the ids again")
            return ids
        return self.device_route(ids) if isinstance(ids, DeviceBuffer) else self.route(ids)

    def record(self, x, ids, output) -> None:
        """Check, then dispatch (joining the open batch, or one submit). Holds
        the device's lock: threads sharing the plan share its buffers."""
        with self.device.lock:
            self._record(x, ids, output)

    def _record(self, x, ids, output) -> None:
        route = self.check(x, ids, output)
        if route.single >= 0:
            plan = self.single_plan(route.single, route.tokens)
            if plan is not None:  # (the route's adapters were checked: it is not)
                plan(x, output)
            return
        if not route.items:  # host ids all -1 ("__base__"): no tile, and nothing to add
            return
        steps = launch(self.steps(route.segments, route.on_device), route.items, self._cap)
        p = self.pool
        buffers = {"A": p.a, "B": p.b, "table": p.table, "x": x, "output": output,
                   "tokens": np.uint32(route.items), **route.buffers}
        if not self.fused:
            role, columns = ("hp", hp_columns(p.max_rank, self.splits)) if self.matrix else \
                ("h", p.max_rank)
            buffers[role] = self._buffer(role, route.tokens, (columns,), np.float32)
        if not route.sort:
            record_steps(self.device, steps, buffers)
            return
        with self.device.batch():  # the sort, then the forward: one submit
            sort = launch(self.sort_steps(), route.tokens, self._cap)
            record_steps(self.device, sort, dict(buffers, tokens=np.uint32(route.tokens)))
            record_steps(self.device, steps, buffers)

    __call__ = record

    def with_ids(self, ids) -> "WithIds":
        """This plan with its ids fixed (a route of them, made now): something
        that records ``(x, output)``, as ``lora.core.tuning.time_plan`` times."""
        route = ids if isinstance(ids, Route) else self._route_of(ids)
        return WithIds(self, route)

    def check_ids(self) -> None:
        """ValueError if a recorded row's device id named no adapter since the
        last check (the flags are sticky until read; reading waits for the GPU)."""
        flags = self._owned.get("flags")
        if flags is None:
            return
        bad, first, bits = (int(v) for v in self.device.read(flags))
        if bad:
            self.device.write(flags, np.zeros(FLAGS, np.uint32))
            ident = int(np.array([bits], np.uint32).view(np.int32)[0])
            raise ValueError(f"ids: {bad} row(s) named no adapter of {self.pool!r} (expected -1 "
                             f"or a slot in use: {self.pool.slots}), the first at row "
                             f"{0xFFFFFFFF - first}, one of their ids {ident}; those rows got "
                             f"no delta")

    def read(self, output) -> np.ndarray:
        """``output`` read back, after :meth:`check_ids`."""
        self.check_ids()
        return self.device.read(output)

    def release(self) -> None:
        """Free the plan's own buffers (routes, h, flags, adapter copies)."""
        for buf in self._owned.values():
            self.device.release(buf)
        self._owned = {}
        for slot in list(self._weights):
            self._drop_weight(slot)


def _ids_per_row(x, ids, output) -> int | None:
    """How many ids there are (None where a device buffer's shape says no
    count); a BindingError naming ``ids`` where x and output agree on a row
    count and the ids give another (else the shape checks name x or output)."""
    if isinstance(ids, Route):
        n = ids.tokens
    elif isinstance(ids, DeviceBuffer):
        n = ids.shape[0] if len(ids.shape) == 1 else None
    else:
        n = host_values(ids).size
    rows = {len(b.shape) and b.shape[0] for b in (x, output) if isinstance(b, DeviceBuffer)}
    if n is not None and len(rows) == 1 and (t := rows.pop()) and t != n:
        raise BindingError(f"ids: {n} id(s) for x and output of {t} rows; expected one id per "
                           f"row (-1 or '__base__' for none)")
    return n


def check_matrix(device, pool, segments: bool, tile_tokens: int) -> None:
    """What the matrix form (lora.kernels.many_matrix) needs, refused with
    what is missing: segments, an f16 pool, f16 -> f32 16x16x16 subgroup
    matrices on the device, tiles of 16, 32 or 64 rows, in_dim and out_dim
    multiples of 4."""
    if not segments:
        raise ValueError("matrix=True multiplies tiles of rows of one adapter: give "
                         "segments=True (decode's scattered rows take the SIMT forms)")
    if pool.dtype != np.float16:
        raise ValueError(f"matrix=True multiplies f16 fragments: it needs a pool of dtype "
                         f"float16, got {pool.dtype.name} ({pool!r}); f32 pools take the SIMT "
                         f"forms (matrix=False)")
    if FRAGMENT not in getattr(device, "subgroup_matrix_configs", ()):
        raise FeatureError(f"matrix=True needs {FRAGMENT} subgroup matrices on subgroups of "
                           f"{FRAGMENT.subgroup_sizes[0]} (chromium-experimental-subgroup-"
                           f"matrix); device {device.name!r} has none")
    matrix_layout(tile_tokens, pool.max_rank, pool.in_dim, pool.out_dim)  # tiles, dims


def most_tokens(device, pool) -> int:
    """The rows of x and of the output that fit one storage binding."""
    cap = device.limits.get("max-storage-buffer-binding-size") or (1 << 31)
    return max(1, cap // (max(pool.in_dim, pool.out_dim) * pool.dtype.itemsize))


class WithIds:
    """A :class:`ManyPlan` and a route: ``record(x, output)``."""

    def __init__(self, plan: ManyPlan, route: Route):
        self.plan, self.route = plan, route
        self.device, self.tokens = plan.device, route.tokens

    def __repr__(self) -> str:
        return f"<{self.plan!r} with the ids of {self.route.tokens} rows>"

    def record(self, x, output) -> None:
        self.plan.record(x, self.route, output)

    __call__ = record
