"""The text ``python -m lora finetune-lm`` fine-tunes a causal LM on: tokenized with
the model folder's ``tokenizer.json`` (through the ``tokenizers`` package) or, where
the folder has none, read as bytes (ids 0-255); packed into sequences of equal
length, the last part held out for evaluation; drawn in seeded batches; and ids
decoded back to text for the samples.

    codec = text_codec(folder, config.vocab_size)     # TextError where it cannot be
    ids = codec.encode_file(path)                     # int64 [tokens]
    packed = pack(ids, seq=128, held_out=0.1)         # train [n, 128], held_out [m, 128]
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_NAME = "tokenizer.json"
BYTE_IDS = 256
REPLACEMENT = "\ufffd"  # what a byte codec shows for an id that is no byte


class TextError(ValueError):
    """A text or tokenizer that cannot be fine-tuned on: the message names the file
    and what was expected."""


@dataclass(frozen=True)
class TextCodec:
    """Text to ids and back: a ``tokenizers.Tokenizer`` (``tokenizer`` given), or
    UTF-8 bytes as ids 0-255. ``source``: what the messages call it."""

    source: str
    vocab_size: int
    tokenizer: Any = None

    @property
    def is_bytes(self) -> bool:
        return self.tokenizer is None

    def encode(self, text: str) -> np.ndarray:
        """int64 ids of ``text``, no special tokens added; TextError for an id the
        model does not have (a tokenizer that is not the model's)."""
        if self.is_bytes:
            return self._ids(text.encode("utf-8"))
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
        return self._checked(ids)

    def encode_file(self, path: Path) -> np.ndarray:
        """The ids of the file at ``path``: its bytes, or its UTF-8 text tokenized."""
        raw = path.read_bytes()
        if self.is_bytes:
            return self._ids(raw)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                            f"{self.source} tokenizes UTF-8 text") from None
        return self.encode(text)

    def decode(self, ids) -> str:
        """The text of ``ids`` (special tokens left in; a byte codec shows an id past
        255 as U+FFFD and bytes that are not UTF-8 likewise)."""
        ids = [int(i) for i in ids]
        if not self.is_bytes:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        raw = b"".join(bytes([i]) if i < BYTE_IDS else REPLACEMENT.encode() for i in ids)
        return raw.decode("utf-8", errors="replace")

    def _ids(self, raw: bytes) -> np.ndarray:
        return np.frombuffer(raw, np.uint8).astype(np.int64)

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        if ids.size and ids.max() >= self.vocab_size:
            raise TextError(f"{self.source} gives the id {int(ids.max())}, but the model's "
                            f"vocab_size is {self.vocab_size}: it is not this model's "
                            f"tokenizer")
        return ids


def text_codec(folder: Path, vocab_size: int) -> TextCodec:
    """The folder's tokenizer.json, or bytes where it has none (TextError where the
    model has fewer than 256 ids, or the tokenizer cannot be read)."""
    path = Path(folder) / TOKENIZER_NAME
    if not path.is_file():
        if vocab_size < BYTE_IDS:
            raise TextError(f"{folder} has no {TOKENIZER_NAME}, so the text would be read as "
                            f"bytes (ids 0-255), but the model's vocab_size is {vocab_size}, "
                            f"fewer than 256 ids; put the model's {TOKENIZER_NAME} in the "
                            f"folder")
        return TextCodec("bytes", vocab_size)
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:
        raise TextError(f"{path}: reading it needs the tokenizers package "
                        f"(pip install tokenizers)") from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the package's own error type is a bare Exception
        raise TextError(f"{path}: the tokenizers package cannot read it: {e}") from None
    return TextCodec(str(path), vocab_size, tokenizer)


@dataclass(frozen=True)
class Packed:
    """The text's tokens in sequences of ``seq``: ``train`` [n, seq] from the start,
    ``held_out`` [m, seq] from the end (what does not fill a sequence is dropped)."""

    tokens: int
    train_tokens: int
    train: np.ndarray
    held_out: np.ndarray


def pack(ids: np.ndarray, seq: int, held_out: float) -> Packed:
    """Split ``ids`` into the first (1 - held_out) for training and the rest held
    out, each cut into sequences of ``seq`` tokens; TextError where either part
    holds less than one sequence."""
    split = len(ids) - int(round(len(ids) * held_out))
    train, rest = ids[:split], ids[split:]
    if len(train) < seq or len(rest) < seq:
        raise TextError(f"the text gave {len(ids)} tokens, {len(train)} for training and "
                        f"{len(rest)} held out; --seq {seq} needs at least {seq} in each: give "
                        f"a longer text, a smaller --seq or another --held-out")
    n, m = len(train) // seq, len(rest) // seq
    return Packed(len(ids), split, train[:n * seq].reshape(n, seq),
                  rest[:m * seq].reshape(m, seq))


def batches(count: int, batch: int, steps: int, seed: int) -> Iterator[np.ndarray]:
    """The sequence indices of each of ``steps`` batches: seeded passes over the
    ``count`` sequences, each in a fresh order, one running on into the next (so
    every batch holds ``batch`` rows, even where there are fewer sequences)."""
    rng = np.random.default_rng(seed)
    order = np.empty(0, np.int64)
    for _ in range(steps):
        while len(order) < batch:
            order = np.concatenate([order, rng.permutation(count)])
        yield order[:batch]
        order = order[batch:]
