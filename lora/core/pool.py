"""An adapter pool on the device: many LoRA adapters of one layer shape in
one A buffer, one B buffer and a slot table, so one dispatch serves a batch
whose rows name different adapters (lora.kernels.many).

Adding an adapter finds room (first fit in the freed space, else the buffer
doubles with a device-side copy) and writes its A rows and B block in place
with a dispatch; removing one marks its slot free and its room reusable.
Neither recompiles anything nor moves another adapter: the kernels read
every offset, rank and scale from the table at run time. Every check of an
``add`` is made before any buffer is touched, so a refused adapter leaves
the pool as it was.
"""
from __future__ import annotations

import numbers

import numpy as np
from numpy.typing import DTypeLike

from shaderdsl.errors import BindingError

from .checks import check_f16, count, host_matrix, scale_value
from .many_plan import BASE, ManyPlan
from .plan import build_steps, launch
from .weight import Weight, storage_dtype, wgsl_dtype

TABLE_COLUMNS = 4  # a slot: first row of A, first element of B, rank (0: free), f32 bits of scale


class Extents:
    """Free room of one buffer as sorted (start, length) runs: first-fit
    ``take``, ``give`` back (merging neighbours), ``grow`` the end."""

    def __init__(self, size: int):
        self.size, self.runs = size, [(0, size)]

    def find(self, n: int) -> int | None:
        """The start of the first free run of at least n, or None."""
        return next((start for start, length in self.runs if length >= n), None)

    def take(self, start: int, n: int) -> None:
        k = next(k for k, (s, length) in enumerate(self.runs) if s <= start < s + length)
        s, length = self.runs[k]
        parts = [(s, start - s), (start + n, s + length - start - n)]
        self.runs[k:k + 1] = [(a, b) for a, b in parts if b > 0]

    def give(self, start: int, n: int) -> None:
        runs = sorted(self.runs + [(start, n)])
        merged = [runs[0]]
        for s, length in runs[1:]:
            last_s, last_len = merged[-1]
            if last_s + last_len == s:
                merged[-1] = (last_s, last_len + length)
            else:
                merged.append((s, length))
        self.runs = merged

    def grow(self, size: int) -> None:
        self.give(self.size, size - self.size)
        self.size = size

    def fit(self, n: int) -> int:
        """The size the buffer must grow to (doubling) for a run of n at its end."""
        tail = self.runs[-1][1] if self.runs and sum(self.runs[-1]) == self.size else 0
        size = max(self.size, 1)
        while size - self.size + tail < n:
            size *= 2
        return size


def refuse_non_layer(layer, what: str) -> None:
    """A TypeError unless ``layer`` has a LoRA layer's a, b and scale; for a
    dict (what ``load_adapter`` returns: one file's modules), how to pick one."""
    if all(hasattr(layer, k) for k in ("a", "b", "scale")):
        return
    hint = ""
    if isinstance(layer, dict):
        hint = (f" (load_adapter returns {{module name: LoraLayer}}: give one module's layer, "
                f"e.g. adapter[{next(iter(layer), 'name')!r}])")
    raise TypeError(f"{what}: expected a lora.LoraLayer, got {type(layer).__name__}{hint}")


def checked_layer(layer, what: str, pool) -> tuple[np.ndarray, np.ndarray, float]:
    """A layer's A and B (as ``pool.dtype``) and its scale, checked against
    ``pool``'s in_dim, out_dim and max_rank (read from it, so a check can run
    before the pool exists); each error names the layer as ``what``."""
    refuse_non_layer(layer, what)
    try:  # host_matrix's messages are a Weight's; here they name the layer
        a = host_matrix(layer.a, f"{what}: A", "[rank, in_dim]", pool.dtype)
        b = host_matrix(layer.b, f"{what}: B", "[out_dim, rank]", pool.dtype)
    except BindingError as e:
        raise BindingError(str(e).removeprefix("Weight: ")) from None
    rank = a.shape[0]
    if a.shape[1] != pool.in_dim or b.shape != (pool.out_dim, rank):
        raise BindingError(f"{what}: A {list(a.shape)} and B {list(b.shape)} do not fit "
                           f"{pool!r}: expected A [rank, {pool.in_dim}] and B "
                           f"[{pool.out_dim}, rank]")
    if rank > pool.max_rank:
        raise ValueError(f"{what}: rank {rank} is over the pool's max_rank {pool.max_rank}; "
                         f"make the pool with max_rank >= {rank}")
    try:
        return a, b, scale_value(layer.scale)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what}: {e}") from None


class AdapterPool:
    """Adapters of one layer (``in_dim -> out_dim``) on ``device``, stored as
    ``dtype`` (float32, or float16 with shader-f16), each of rank 1 to
    ``max_rank`` (a multiple of 4: the rows of the f32 scratch h). ``a``: the
    A rows of every adapter ``[rows, in_dim]``; ``b``: their B blocks
    ``[out_dim, rank]`` one after another (flat); ``table``: u32 ``[slots,
    4]``. Slots are the ids a batch names (``forward_plan``)."""

    def __init__(self, device, in_dim: int, out_dim: int, *, dtype: DTypeLike = np.float32,
                 max_rank: int = 64, slots: int = 4, rows: int = 64):
        self.device, self.dtype = device, storage_dtype(dtype)
        check_f16(device, self.dtype, "AdapterPool")
        self.in_dim = count(in_dim, "AdapterPool: in_dim")
        self.out_dim = count(out_dim, "AdapterPool: out_dim")
        self.max_rank = count(max_rank, "AdapterPool: max_rank", 4)
        if self.max_rank % 4:
            raise ValueError(f"AdapterPool: max_rank must be a multiple of 4 (the rows of h), "
                             f"got {max_rank}")
        slots, rows = count(slots, "AdapterPool: slots"), count(rows, "AdapterPool: rows")
        self._rows, self._elems = Extents(rows), Extents(rows * out_dim)
        self.host_table = np.zeros((slots, TABLE_COLUMNS), np.uint32)
        self.a = device.empty((rows, in_dim), self.dtype, name="pool.A")
        self.b = device.empty((rows * out_dim,), self.dtype, name="pool.B")
        self.table = device.buffer(self.host_table, name="pool.table")
        self.serials = np.zeros(slots, np.int64)  # which add put a slot's adapter (0: free)
        self.names: dict[str, int] = {}  # add's names -> slots, for routes by name
        self._adds = 0
        self._place = None

    def __repr__(self) -> str:
        return (f"<AdapterPool {len(self)} adapter(s) in={self.in_dim} out={self.out_dim} "
                f"{self.dtype.name} max_rank={self.max_rank}>")

    def __len__(self) -> int:
        return int(np.count_nonzero(self.host_table[:, 2]))

    @property
    def slots(self) -> list[int]:
        """The slots holding an adapter, in order."""
        return [int(s) for s in np.flatnonzero(self.host_table[:, 2])]

    def rank(self, slot: int | str) -> int:
        return int(self.host_table[self._used(slot), 2])

    def scale(self, slot: int | str) -> float:
        return float(self.host_table[self._used(slot), 3:4].view(np.float32)[0])

    def add(self, layer, name: str | None = None) -> int:
        """Put ``layer`` (an object with ``a`` [rank, in_dim], ``b`` [out_dim,
        rank] and ``scale``, as ``lora.LoraLayer``) in a free slot; returns the
        slot. ``name`` names it in messages and in routes (``plan.route`` takes
        names as peft's ``adapter_names``); unique. Refused (ValueError,
        BindingError) before anything on the device changes. Holds the
        device's lock: a record in another thread sees the pool before or after."""
        with self.device.lock:
            return self._add(layer, name)

    def _add(self, layer, name: str | None) -> int:
        self._check_name(name)
        a, b, scale = checked_layer(layer, name or "the adapter", self)
        rank = a.shape[0]
        slot = self._free_slot()
        rows = self._growth(self._rows, rank, "A rows", self.in_dim)
        elems = self._growth(self._elems, b.size, "B elements", 1)
        if slot == len(self.host_table):  # from here on the device changes
            self._grow_table()
        if rows:
            self.a = self._bigger(self.a, (rows, self.in_dim), self._rows, "pool.A")
        if elems:
            self.b = self._bigger(self.b, (elems,), self._elems, "pool.B")
        a_at, b_at = self._rows.find(rank), self._elems.find(b.size)
        assert a_at is not None and b_at is not None  # the growth made room
        self._rows.take(a_at, rank)
        self._elems.take(b_at, b.size)
        self._write(self.a, a.reshape(-1), a_at * self.in_dim)
        self._write(self.b, b.reshape(-1), b_at)
        entry = np.array([a_at, b_at, rank, 0], np.uint32)
        entry[3:4] = np.array([scale], np.float32).view(np.uint32)
        self.host_table[slot] = entry
        self._adds += 1
        self.serials[slot] = self._adds
        self.device.write(self.table, self.host_table)
        if name is not None:
            self.names[name] = slot
        return slot

    def _check_name(self, name) -> None:
        if name is None:
            return
        if not isinstance(name, str) or not name or name == BASE:
            raise ValueError(f"{self!r}: a name must be a non-empty str other than {BASE!r}, "
                             f"got {name!r}")
        if name in self.names:
            raise ValueError(f"{self!r}: the name {name!r} is taken by slot "
                             f"{self.names[name]}; remove it first")

    def remove(self, slot: int | str) -> None:
        """Free ``slot`` (or the slot of the name ``add`` gave) and its room;
        the other adapters stay where they are. Holds the device's lock."""
        with self.device.lock:
            self._remove(self._used(slot))

    def _remove(self, slot: int) -> None:
        a_at, b_at, rank, _ = (int(v) for v in self.host_table[slot])
        self._rows.give(a_at, rank)
        self._elems.give(b_at, rank * self.out_dim)
        self.host_table[slot] = 0
        self.serials[slot] = 0
        self.names = {n: s for n, s in self.names.items() if s != slot}
        self.device.write(self.table, self.host_table)

    def read(self, slot: int | str) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) of the adapter in ``slot``, read back from the device."""
        a_at, b_at, rank, _ = (int(v) for v in self.host_table[self._used(slot)])
        a = self.device.read(self.a)[a_at:a_at + rank]
        b = self.device.read(self.b)[b_at:b_at + rank * self.out_dim]
        return a.copy(), b.reshape(self.out_dim, rank).copy()

    def weight(self, slot: int | str) -> Weight:
        """A new ``Weight`` holding a copy of the adapter in ``slot`` (copied on
        the device), for ``lora.forward``'s own plans; the caller releases it."""
        a_at, b_at, rank, _ = (int(v) for v in self.host_table[self._used(slot)])
        a = self.device.empty((rank, self.in_dim), self.dtype, name="pool.weight.A")
        b = self.device.empty((self.out_dim, rank), self.dtype, name="pool.weight.B")
        self._place_run(self.a, a, a_at * self.in_dim, 0, rank * self.in_dim)
        self._place_run(self.b, b, b_at, 0, rank * self.out_dim)
        return Weight(self.device, a, b, self.in_dim, self.out_dim, rank)

    def forward_plan(self, max_tokens: int | None = None, **options) -> ManyPlan:
        """The plan of this pool's forward (:class:`lora.core.many_plan.ManyPlan`:
        ``segments``, ``fused``, ``tile_tokens``, ``threads``, ``lanes``,
        ``unroll``); it follows the pool as adapters come and go."""
        return ManyPlan(self, max_tokens, **options)

    def release(self) -> None:
        """Free the pool's buffers (its plans cannot record afterwards)."""
        for buf in (self.a, self.b, self.table):
            self.device.release(buf)

    # ------------------------------------------------------------ checks

    def _used(self, slot) -> int:
        """The slot ``slot`` names (a slot, or the name ``add`` gave) holding an
        adapter, else a ValueError naming what the pool holds."""
        if isinstance(slot, str):
            if slot not in self.names:
                raise ValueError(f"{self!r}: no adapter is named {slot!r} (names: "
                                 f"{sorted(self.names)}; slots in use: {self.slots})")
            return self.names[slot]
        if isinstance(slot, bool) or not isinstance(slot, numbers.Integral) or \
                not 0 <= int(slot) < len(self.host_table) or not self.host_table[int(slot), 2]:
            raise ValueError(f"{self!r}: slot {slot!r} holds no adapter (slots in use: "
                             f"{self.slots})")
        return int(slot)

    # ------------------------------------------------------------ room

    def _free_slot(self) -> int:
        free = np.flatnonzero(self.host_table[:, 2] == 0)
        return int(free[0]) if free.size else len(self.host_table)

    def _growth(self, extents: Extents, n: int, what: str, itemsize: int) -> int | None:
        """The size the buffer must grow to for n more, or None where it has
        room; checked against the binding limit now, before anything changes."""
        if extents.find(n) is not None:
            return None
        size = extents.fit(n)
        nbytes = size * itemsize * self.dtype.itemsize
        cap = self.device.limits.get("max-storage-buffer-binding-size")
        if cap is not None and nbytes > cap:
            raise BindingError(f"{self!r}: no room for {n} more {what}: the buffer would "
                               f"grow to {nbytes} bytes, over max-storage-buffer-binding-size "
                               f"= {cap}; remove adapters or make another pool")
        return size

    def _grow_table(self) -> None:
        self.host_table = np.concatenate([self.host_table, np.zeros_like(self.host_table)])
        self.serials = np.concatenate([self.serials, np.zeros_like(self.serials)])
        old, self.table = self.table, self.device.buffer(self.host_table, name="pool.table")
        self.device.release(old)

    def _bigger(self, old, shape: tuple, extents: Extents, name: str):
        """A buffer of ``shape`` holding ``old`` at its start (a device copy)."""
        new = self.device.empty(shape, self.dtype, name=name)
        self.device.copy(old, new)
        self.device.release(old)
        extents.grow(shape[0])
        return new

    def _write(self, dst, values: np.ndarray, at: int) -> None:
        """dst[at:at + n] = values (no other element moves)."""
        src = self.device.buffer(values, name="pool.staging")
        self._place_run(src, dst, 0, at, values.size)
        self.device.release(src)

    def _place_run(self, src, dst, src_at: int, at: int, n: int) -> None:
        """dst[at:at + n] = src[src_at:src_at + n], by the many_place kernel."""
        if self._place is None:
            params = dict(tokens=None, dtype=wgsl_dtype(self.dtype))
            self._place = build_steps(self.device, [("many_place", params)],
                                      {"src": 4, "dst": 4}, 1 << 30)[0]
        step = launch([self._place], n, self.device.limits[
            "max-compute-workgroups-per-dimension"])[0]
        given = {"src": src, "dst": dst, "at": np.uint32(at), "src_at": np.uint32(src_at),
                 "tokens": np.uint32(n)}
        self.device.dispatch(step.kernel, [given[r] for r in step.roles], step.grid)
