"""safetensors files read with numpy alone, for adapter files and model folders alike.

The format's reader (``safetensors``) keeps the last of a key named twice and numpy
has no bfloat16; here a header naming a key twice is refused, a BF16 tensor is
widened to float32 exactly from its bits, and a value that does not fit the dtype
it is read as is refused by name. Every problem raises the caller's ``error`` class
(``AdapterFileError``, ``ModelError``) naming the file and the tensor.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np


def read_header(file: Path, error: type[Exception]) -> tuple[int, dict]:
    """(the header's length, the header) of a safetensors file, refusing a key named
    twice: the format forbids it, but the reader keeps the last silently. A header that
    is not readable at all gives (0, {}), left to safetensors' own message."""
    twice: list[str] = []

    def pairs_to_dict(pairs: list) -> dict:
        twice.extend(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        return dict(pairs)

    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > file.stat().st_size - 8:
            return 0, {}
        try:
            header = json.loads(f.read(length), object_pairs_hook=pairs_to_dict)
        except (ValueError, RecursionError):
            return 0, {}
    if twice:
        raise error(f"{file}: the header names {min(twice)!r} twice (duplicate keys "
                    f"are not allowed in safetensors)")
    return length, header if isinstance(header, dict) else {}


def bfloat16_values(file: Path, start: int, shape: list) -> np.ndarray:
    """A BF16 tensor's values as float32, exactly: each value's 16 bits are the top
    half of the float32 of the same value (numpy has no bfloat16 to read them as)."""
    size = math.prod(shape)
    with open(file, "rb") as f:
        f.seek(start)
        bits = np.frombuffer(f.read(2 * size), "<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def narrowed(file: Path, key: str, values: np.ndarray, dtype,
             error: type[Exception]) -> np.ndarray:
    """``values`` rounded to ``dtype``; refused, naming the first value, where a finite
    value is beyond the dtype's range (it would become infinite)."""
    with np.errstate(over="ignore"):
        out = values.astype(dtype)
    lost = np.isfinite(values) & ~np.isfinite(out)
    if lost.any():
        value = float(values[lost].flat[0])
        raise error(f"{file}: {key} holds {value!r}, which does not fit "
                    f"{np.dtype(dtype).name} (largest finite "
                    f"{float(np.finfo(dtype).max)!r}); {int(lost.sum())} of "
                    f"{values.size} values are beyond it")
    return out


def read_values(file: Path, opened, key: str, length: int, header: dict, dtype,
                error: type[Exception]) -> np.ndarray:
    """Tensor ``key`` of ``file`` (``opened``: its safetensors handle; ``length`` and
    ``header``: what read_header gave) as ``dtype``: BF16 widened from its bits, any
    other stored dtype converted, a value beyond ``dtype``'s range refused."""
    entry = header[key]
    values = (bfloat16_values(file, 8 + length + entry["data_offsets"][0], entry["shape"])
              if entry["dtype"] == "BF16" else opened.get_tensor(key))
    return values if values.dtype == dtype else narrowed(file, key, values, dtype, error)
