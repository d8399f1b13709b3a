"""Rows sorted by adapter on the GPU: the segments of lora.kernels.many built
from ids in a device buffer, by a counting sort that is stable (rows of one
adapter keep their order), so the result is the same in any order of
workgroups.

Three dispatches over blocks of ``threads`` rows (``tokens``: the row
count, a uniform): ``many_sort_count`` gives each row its rank among the
earlier rows of its block with its id (``local``) and each block its count
per slot (``counts[block, slot]``), checking each id as the rows form does
(a bad id: counted in ``flags``, the row left out); ``many_sort_scan`` (one
workgroup) turns the counts into each block's first position per slot and
writes the tiles (first index into ``order``, rows <= tile_tokens, slot, 0),
then empty tiles (0 rows) up to ``tile_bound``; ``many_sort_scatter`` puts
each row at its place in ``order``.
"""
from __future__ import annotations

from shaderdsl import atomic, collectives, i32, u32, vec4u
from shaderdsl import builtins as B

from .common import check_threads, token_count
from .many import FLAGS

LEFT_OUT = 0xFFFFFFFF  # ``local`` of a row with no adapter (-1, or a bad id)


def tile_bound(tokens: int, slots: int, tile_tokens: int) -> int:
    """Tiles the GPU-built segments may have: a partial tile per slot used at most."""
    return -(-tokens // tile_tokens) + min(tokens, slots)


def _check(threads, tile_tokens, tokens):
    check_threads(threads)
    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be an int >= 1, got {tile_tokens!r}")
    if tokens is not None:
        raise ValueError(f"the sort reads its row count at run time: tokens must be None, "
                         f"got {tokens!r}")


def many_sort_count(m, tokens=None, threads=256):
    """local[row] and counts[block, slot] of this block of rows (see the module)."""
    _check(threads, 1, tokens)
    table = m.declare_input_buffer("table", vec4u, None)
    ids = m.declare_input_buffer("ids", i32, None)
    local = m.declare_output_buffer("local", u32, None)
    counts = m.declare_output_buffer("counts", u32, None)
    flags = m.declare_output_buffer("flags", atomic(u32), FLAGS)
    n = token_count(m, None)
    tid, block = m.local_index(), m.workgroup_id().x
    slots = m.let(B.array_length(table), "slots")
    row = m.let(block * threads + tid, "row")
    idv = m.let(B.select(-1, ids[B.min(row, n - 1)], row < n), "id")
    slot = m.let(B.min(u32(B.max(idv, 0)), slots - 1), "slot")
    good = m.let((idv >= 0) & (u32(B.max(idv, 0)) < slots) & (table[slot].z > 0), "good")
    with m.if_((idv != -1) & ~good):
        B.atomic_add(flags[0], 1)
        B.atomic_max(flags[1], ~row)
        B.atomic_max(flags[2], B.bitcast(u32, idv))
    key = m.let(B.select(-1, idv, good), "key")  # -1: the row is left out
    keys = m.shared(i32, threads, "keys")
    keys[tid] = key
    with m.loop(tid, slots, threads, name="s") as s:
        counts[block * slots + s] = 0
    m.storage_barrier()
    m.barrier()
    rank = m.var(u32, 0, "rank")
    last = m.var(u32, 1, "last")
    with m.loop(0, threads, name="j") as j:
        same = m.let(keys[j] == key, "same")
        with m.if_(same & (j < tid)):
            m.assign(rank, rank + 1)
        with m.if_(same & (j > tid)):
            m.assign(last, 0)
    with m.if_(row < n):
        local[row] = B.select(LEFT_OUT, rank, good)
    with m.if_(good & (last == 1)):
        counts[block * slots + slot] = rank + 1


def many_sort_scan(m, tokens=None, threads=256, tile_tokens=8, block=256):
    """counts[b, s] = the first position in ``order`` of block b's rows of
    slot s; the tiles of each slot's rows, then empty ones up to tile_bound.
    One workgroup: a thread per slot (in chunks of ``threads``), looping over
    the ``block``-row blocks."""
    _check(threads, tile_tokens, tokens)
    table = m.declare_input_buffer("table", vec4u, None)
    counts = m.declare_output_buffer("counts", u32, None)
    tiles = m.declare_output_buffer("tiles", vec4u, None)
    n = token_count(m, None)
    tid = m.local_index()
    slots = m.let(B.array_length(table), "slots")
    blocks = m.let((n + (block - 1)) / block, "blocks")
    done_rows, done_tiles = m.var(u32, 0, "done_rows"), m.var(u32, 0, "done_tiles")
    sums = m.shared(u32, 2, "sums")
    with m.loop(0, slots, threads, name="s0") as s0:
        s = m.let(s0 + tid, "s")
        total = m.var(u32, 0, "total")
        with m.if_(s < slots):
            with m.loop(0, blocks, name="b") as b:
                c = m.let(counts[b * slots + s], "c")
                counts[b * slots + s] = total
                m.assign(total, total + c)
        ntiles = m.let((total + (tile_tokens - 1)) / tile_tokens, "ntiles")
        rows_in = collectives.scan(m, total, name="rows_in")
        tiles_in = collectives.scan(m, ntiles, name="tiles_in")
        first_row = m.let(done_rows + rows_in - total, "first_row")
        first_tile = m.let(done_tiles + tiles_in - ntiles, "first_tile")
        _slot_tiles(m, counts, tiles, s, slots, blocks, total, ntiles, first_row, first_tile,
                    tile_tokens)
        with m.if_(tid == threads - 1):
            sums[0], sums[1] = rows_in, tiles_in
        m.barrier()
        m.assign(done_rows, done_rows + sums[0])
        m.assign(done_tiles, done_tiles + sums[1])
        m.barrier()
    bound = m.let((n + (tile_tokens - 1)) / tile_tokens + B.min(n, slots), "bound")
    with m.loop(done_tiles + tid, bound, threads, name="t") as t:
        tiles[t] = vec4u(0, 0, 0, 0)


def _slot_tiles(m, counts, tiles, s, slots, blocks, total, ntiles, first_row, first_tile,
                tile_tokens):
    """Slot s's blocks offset by its first row, and its tiles written."""
    with m.if_(s < slots):
        with m.loop(0, blocks, name="b") as b:
            counts[b * slots + s] = counts[b * slots + s] + first_row
        with m.loop(0, ntiles, name="k") as k:
            at = m.let(k * tile_tokens, "at")
            tiles[first_tile + k] = vec4u(first_row + at, B.min(u32(tile_tokens), total - at),
                                          s, 0)


def many_sort_scatter(m, tokens=None, threads=256):
    """order[counts[block, slot] + local[row]] = row for every row with an adapter."""
    _check(threads, 1, tokens)
    table = m.declare_input_buffer("table", vec4u, None)
    ids = m.declare_input_buffer("ids", i32, None)
    local = m.declare_input_buffer("local", u32, None)
    counts = m.declare_input_buffer("counts", u32, None)
    order = m.declare_output_buffer("order", u32, None)
    n = token_count(m, None)
    row = m.let(m.workgroup_id().x * threads + m.local_index(), "row")
    with m.if_(row < n):
        place = m.let(local[row], "place")
        with m.if_(place != LEFT_OUT):
            slots = B.array_length(table)
            at = counts[m.workgroup_id().x * slots + u32(ids[row])]
            order[at + place] = row
