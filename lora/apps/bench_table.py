"""The summary tables ``python -m lora bench`` prints after its rows: each
forward and training row's time beside PyTorch's CUDA graph and, for training,
beside PyTorch's strongest step (lora.apps.bench_train), with the ratios
PyTorch / ours (above 1: ours is faster). The JSON rows carry the same fields.
"""
from __future__ import annotations

FORWARD_HEAD = ("dtype", "T", "rank", "in->out", "ours us", "torch graph us", "vs graph")
TRAIN_HEAD = FORWARD_HEAD + ("torch strongest us", "vs strongest")


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _torch_key(row) -> str:
    """The prefix of the PyTorch times in the row's own dtype (a training f16
    row's PyTorch is its fp16 autocast step)."""
    return "torch_fp16_" if row.get("kind") == "train" and row["dtype"] == "f16" else "torch_"


def _cells(row, ours: float) -> list[str]:
    key = _torch_key(row)
    return [row["dtype"], str(row["tokens"]), str(row["rank"]),
            f"{row['in_dim']}->{row['out_dim']}", _us(ours), _us(row.get(f"{key}graph_us")),
            _ratio(row.get("vs_torch_graph"))]


def _aligned(head: tuple, body: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in column) for column in zip(head, *body)]
    return ["  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in [list(head), *body]]


def tables(result: dict) -> list[str]:
    """The lines of the forward table and the training table of a bench run's
    ``result``, each followed by why PyTorch is missing where it is."""
    lines = []
    forwards = result.get("rows", [])
    if forwards:
        lines += ["forward: GPU us per forward, PyTorch in the row's dtype; vs: PyTorch / ours"]
        lines += _aligned(FORWARD_HEAD, [_cells(r, r["best_gpu_us"]) for r in forwards])
        lines += _why_missing(forwards, "graph", "torch")
    trains = result.get("train_rows", [])
    if trains:
        lines += ["training: GPU us per step (f16 rows beside PyTorch's fp16 autocast step); "
                  "vs: PyTorch / ours"]
        lines += _aligned(TRAIN_HEAD, [
            _cells(r, r["gpu_us"]) + [_us(r.get(f"{_torch_key(r)}strongest_us")),
                                      _ratio(r.get("vs_torch_strongest"))] for r in trains])
        lines += _why_missing(trains, "graph", "torch")
        lines += _why_missing(trains, "strongest", "torch_strongest")
    return lines


def _why_missing(rows: list[dict], what: str, reason: str) -> list[str]:
    """One line per distinct reason that a PyTorch column is empty."""
    reasons = sorted({str(r.get(reason)) for r in rows if f"{_torch_key(r)}{what}_us" not in r})
    return [f"  no torch {what}: {why}" for why in reasons]
