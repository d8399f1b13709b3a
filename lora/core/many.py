"""``forward_many``: the LoRA forward of a batch whose rows each name one of
several adapters, numpy in and numpy out (a pool and its plan made, run and
freed per call; a server keeps an ``AdapterPool`` instead)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shaderdsl.errors import BindingError

from ..kernels.many import shared_floats
from ..kernels.many_matrix import TILES, matrix_shared_bytes
from ..kernels.matrix import FRAGMENT
from . import checks as C
from .auto import forward
from .many_plan import CANDIDATES, chosen_form, host_ids, ids_by_name
from .pool import AdapterPool, checked_layer, refuse_non_layer
from .weight import storage_dtype


class _Shape:
    """What checked_layer reads of a pool, before the pool exists."""

    def __init__(self, in_dim, out_dim, max_rank, dtype):
        self.in_dim, self.out_dim, self.max_rank, self.dtype = in_dim, out_dim, max_rank, dtype

    def __repr__(self) -> str:
        return f"the first layer's shape {self.in_dim} -> {self.out_dim}"


def checked_layers(layers, dtype, labels=None) -> tuple[list, _Shape]:
    """Each layer checked against the first one's in and out dims, naming it
    ``labels[k]`` (default ``layers[k]``); the shape the pool will have (max_rank: the largest rank,
    rounded up to 16, which the chosen forms' rank blocks divide)."""
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__len__") or not len(layers):
        raise TypeError(f"layers: expected a non-empty sequence of lora.LoraLayer, got "
                        f"{type(layers).__name__}")
    labels = labels or [f"layers[{k}]" for k in range(len(layers))]
    first = layers[0]
    refuse_non_layer(first, labels[0])
    ranks = [np.shape(getattr(layer, "a", ()))[:1] or (1,) for layer in layers]
    top = max(int(r[0]) for r in ranks)
    shape = _Shape(np.shape(first.a)[-1], np.shape(first.b)[0], max(16, -(-top // 16) * 16), dtype)
    return [checked_layer(layer, labels[k], shape) for k, layer in enumerate(layers)], shape


def by_index(layers, ids) -> tuple[list, object, list | None]:
    """``layers`` as a list, ``ids`` as indices into it and the layers' labels
    in messages (None: ``layers[k]``): a mapping ``{name: layer}`` lets rows
    name their adapter as peft's ``adapter_names`` does (``"__base__"`` for
    none), labelled ``layers['name']``; ints index the mapping's order."""
    ids = C.host_values(ids)
    named = ids.dtype.kind in "USO"
    if not isinstance(layers, Mapping):
        if named:
            raise BindingError("ids: adapter names need layers as a mapping {name: "
                               "lora.LoraLayer}; with a sequence of layers, ids are indices "
                               "(-1 for none)")
        return layers, ids, None
    index = {name: k for k, name in enumerate(layers)}
    return (list(layers.values()), ids_by_name(ids, index, "layers") if named else ids,
            [f"layers[{name!r}]" for name in layers])


def forward_many(x, layers, ids, base=None, *, dtype=None, device=None) -> np.ndarray:
    """``base + scale_i * B_i @ (A_i @ x)`` for each row of x, i = its id.

    ``x``: ``(in_dim,)``, ``(tokens, in_dim)`` or with more leading dimensions,
    as :func:`lora.forward` takes it; ``layers``: a sequence of
    ``lora.LoraLayer`` (each its own rank and scale: alpha / rank, or rslora's
    alpha / sqrt(rank)), all of one in_dim and out_dim, or a mapping
    ``{name: layer}``; ``ids``: one per row (shaped ``x.shape[:-1]``, or
    flat), an index into ``layers`` or -1 for no delta, or with a mapping
    its names and ``"__base__"`` (peft's ``adapter_names``); ``base``: shaped like the result
    (``x.shape[:-1] + (out_dim,)``), default zeros. Stored on the GPU and
    returned as ``dtype`` (float32 by default, or float16); sums are f32.
    Everything is checked before any GPU buffer exists. Where every row names
    one adapter this is ``lora.forward`` of it; else the many kernels in the
    form :func:`lora.core.many_plan.chosen_form` picks."""
    from shaderdsl.runtime import get_device

    dt = storage_dtype(np.float32 if dtype is None else dtype)
    layers, ids, labels = by_index(layers, ids)
    checked, shape = checked_layers(layers, dt, labels)
    first = checked[0]
    p = C.host_problem(x, first[0], first[1], base, dt)
    flat = host_ids(ids, p.shape[:-1], list(range(len(checked))), len(checked))
    dev = get_device() if device is None else C.device_of(device)
    if p.tokens == 0:
        return p.out.reshape(p.shape).copy()
    if flat[0] >= 0 and np.all(flat == flat[0]):
        a, b, scale = checked[int(flat[0])]
        return forward(x, a, b, base, scale=scale, device=dev, dtype=dt.type)
    return _many(dev, p, checked, layers, flat, shape)


def plan_options(device, flat: np.ndarray, ranks: list[int], shape) -> dict:
    """ManyPlan's options for these ids (of adapters of ``ranks``, in a pool
    of ``shape``): the form chosen_form names, its tiles cut to fit the
    device's workgroup memory."""
    named = flat[flat >= 0]
    rank = float(np.mean(np.asarray(ranks)[named])) if named.size else 0.0
    matrix = matrix_runs(device, shape.dtype, shape.in_dim, shape.out_dim, shape.max_rank)
    name = chosen_form(named.size, np.unique(named).size, rank, matrix)
    return form_options(device, name, shape.max_rank)


def matrix_runs(device, dtype, in_dim: int, out_dim: int, max_rank: int) -> bool:
    """Whether the matrix forms run for a pool of these on ``device``: f16,
    f16 16x16x16 subgroup matrices, and workgroup memory for every tile."""
    room = device.limits.get("max-compute-workgroup-storage-size", 16384)
    return (np.dtype(dtype) == np.float16 and device.has_feature("shader-f16")
            and FRAGMENT in getattr(device, "subgroup_matrix_configs", ())
            and all(matrix_shared_bytes(t, max_rank, in_dim, out_dim) <= room for t in TILES))


def form_options(device, name: str, max_rank: int) -> dict:
    """ManyPlan's options of the form ``name`` (a key of CANDIDATES), its
    tiles cut to fit the device's workgroup memory (the nearest that fits)."""
    options = dict(CANDIDATES[name])
    if options["segments"] and not options.get("matrix"):  # matrix tiles: matrix_runs
        room = device.limits.get("max-compute-workgroup-storage-size", 16384) // 4
        threads = options.get("threads", 256)
        per_tile = shared_floats(threads, max_rank, 1, options["fused"])
        options["tile_tokens"] = max(1, min(options["tile_tokens"], room // per_tile))
    return options


def _many(dev, p, checked, layers, flat, shape) -> np.ndarray:
    """The many kernels on a pool made, run and freed for this call."""
    pool = AdapterPool(dev, shape.in_dim, shape.out_dim, dtype=shape.dtype,
                       max_rank=shape.max_rank, slots=len(checked),
                       rows=sum(a.shape[0] for a, _, _ in checked))
    made: list = [pool]  # what to free, whatever happens
    try:
        for k, layer in enumerate(layers):
            pool.add(layer, f"layers[{k}]")
        ranks = [a.shape[0] for a, _, _ in checked]
        plan = pool.forward_plan(p.tokens, **plan_options(dev, flat, ranks, shape))
        made.append(plan)
        x_buf = dev.buffer(p.x.reshape(p.tokens, -1), name="many.x")
        out_buf = dev.buffer(p.out.reshape(p.tokens, -1), name="many.output")
        made += [x_buf, out_buf]
        plan.record(x_buf, flat, out_buf)
        return dev.read(out_buf).reshape(p.shape).copy()
    finally:
        for thing in reversed(made):  # buffers, the plan's own, the pool's
            thing.release()
