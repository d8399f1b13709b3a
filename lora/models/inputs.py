"""A language model's inputs, checked and put in the form the GPU reads,
before any buffer is touched: token ids, labels (shifted as transformers
shifts them), the attention mask and the positions RoPE rotates by.

transformers' meaning throughout: ``labels`` default to the input ids, the
label of position s is the token at s + 1 (the last position has none), -100
is ignored, and the loss is the mean over the counted positions;
``attention_mask`` 1 marks a real token and 0 padding. The GPU reads ids,
labels, the mask and positions as u32 per token, row-major over [batch, seq].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.checks import host_values

IGNORE_INDEX = -100          # transformers' ignore_index in its causal-LM loss
IGNORED = np.uint32(0xFFFFFFFF)  # how an ignored label is stored for the GPU


@dataclass(frozen=True)
class Batch:
    """A checked batch: ``ids``, ``keep`` (the mask) and ``positions`` u32
    [batch * seq]; ``labels`` u32 [batch * seq] already shifted (IGNORED where
    nothing is counted) or None; ``counted`` the number of counted labels."""

    batch: int
    seq: int
    ids: np.ndarray
    keep: np.ndarray
    positions: np.ndarray
    labels: np.ndarray | None
    counted: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _integers(value, what: str, call: str) -> np.ndarray:
    """``value`` as a 2-D int64 array [batch, seq], or ValueError naming it."""
    arr = host_values(value)
    if arr.ndim == 1 and what == "input_ids":
        arr = arr[None, :]
    if arr.dtype == bool and what == "attention_mask":
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(f"{call}: {what} must be integers [batch, seq] (a 1-D row is one "
                         f"sequence for input_ids), got {arr.dtype.name} {list(arr.shape)}")
    return arr.astype(np.int64)


def check_batch(input_ids, labels=None, attention_mask=None, *, vocab: int, max_positions: int,
                call: str, with_labels: bool = True, generate_positions: bool = False) -> Batch:
    """The batch checked against the model (``vocab`` ids, ``max_positions``
    positions); ``with_labels``: labels default to input_ids (a training step);
    ``generate_positions``: positions as transformers' generate makes them
    (cumsum(mask) - 1, 0 at padding) instead of its forward's 0..seq-1."""
    ids = _integers(input_ids, "input_ids", call)
    batch, seq = ids.shape
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        b, s = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{call}: input_ids[{b}, {s}] = {ids[b, s]} is outside the vocabulary "
                         f"(ids 0..{vocab - 1})")
    if seq > max_positions:
        raise ValueError(f"{call}: sequences of {seq} tokens are longer than the model's "
                         f"max_position_embeddings ({max_positions})")
    keep = _mask(attention_mask, ids.shape, call)
    positions = _positions(keep, generate_positions)
    shifted, counted = None, 0
    if with_labels or labels is not None:
        shifted, counted = _labels(ids if labels is None else labels, ids.shape, vocab, call)
    return Batch(batch, seq, _u32(ids), _u32(keep), _u32(positions), shifted, counted)


def _u32(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr.reshape(-1), np.uint32)


def _mask(attention_mask, shape: tuple, call: str) -> np.ndarray:
    """The mask as 0/1 int64 [batch, seq] (all ones when None)."""
    if attention_mask is None:
        return np.ones(shape, np.int64)
    keep = _integers(attention_mask, "attention_mask", call)
    if keep.shape != shape:
        raise ValueError(f"{call}: attention_mask must have input_ids' shape {list(shape)}, got "
                         f"{list(keep.shape)}")
    if not np.isin(keep, (0, 1)).all():
        raise ValueError(f"{call}: attention_mask must hold 0 (padding) and 1 (a token), got "
                         f"the values {sorted(set(np.unique(keep).tolist()) - {0, 1})[:5]}")
    return keep


def _positions(keep: np.ndarray, generate: bool) -> np.ndarray:
    """RoPE's position of each token [batch, seq]."""
    if generate:
        return np.where(keep == 1, np.cumsum(keep, axis=1) - 1, 0)
    return np.broadcast_to(np.arange(keep.shape[1]), keep.shape)


def _labels(labels, shape: tuple, vocab: int, call: str) -> tuple[np.ndarray, int]:
    """Labels [batch, seq] shifted left by one (position s learns token s + 1),
    as u32 with IGNORED for -100 and for each sequence's last position, and
    how many are counted."""
    lab = _integers(labels, "labels", call)
    if lab.shape != shape:
        raise ValueError(f"{call}: labels must have input_ids' shape {list(shape)}, got "
                         f"{list(lab.shape)}")
    bad = ((lab < 0) | (lab >= vocab)) & (lab != IGNORE_INDEX)
    if bad.any():
        b, s = map(int, np.argwhere(bad)[0])
        raise ValueError(f"{call}: labels[{b}, {s}] = {lab[b, s]} is neither a token id "
                         f"(0..{vocab - 1}) nor {IGNORE_INDEX} (ignored)")
    shifted = np.full(shape, IGNORE_INDEX, np.int64)
    shifted[:, :-1] = lab[:, 1:]
    counted = int((shifted != IGNORE_INDEX).sum())
    out = np.where(shifted == IGNORE_INDEX, int(IGNORED), shifted)
    return np.ascontiguousarray(out.reshape(-1), np.uint32), counted
