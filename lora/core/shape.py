"""``LayerShape``: the one description of a LoRA layer's problem that strategies,
kernels and exports are given, instead of seven positional numbers."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .checks import count, scale_value

DTYPES = ("f32", "f16")  # the kernels' storage dtypes (wgsl_dtype's names)


@dataclass(frozen=True)
class LayerShape:
    """``out[tokens, out_dim] += scale * B[out_dim, rank] @ (A[rank, in_dim] @ x)``.

    ``tokens`` None: the run-time forms, which read the token count from a
    uniform; ``dtype``: the storage of A, B, x and out ("f32" or "f16").

    >>> LayerShape(rank=8, in_dim=64, out_dim=32, tokens=4).with_tokens(None).tokens is None
    True
    """

    rank: int
    in_dim: int
    out_dim: int
    tokens: int | None = None
    dtype: str = "f32"
    scale: float = 1.0

    def __post_init__(self):
        for name in ("rank", "in_dim", "out_dim"):
            object.__setattr__(self, name, count(getattr(self, name), f"LayerShape.{name}"))
        if self.tokens is not None:
            object.__setattr__(self, "tokens", count(self.tokens, "LayerShape.tokens"))
        if self.dtype not in DTYPES:
            raise ValueError(f"LayerShape.dtype: expected one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "scale", scale_value(self.scale))

    @property
    def token_count(self) -> int:
        """``tokens``, for the work that needs a count (tuning, a backward);
        ValueError for the run-time forms' None."""
        if self.tokens is None:
            raise ValueError("this needs a token count, got LayerShape.tokens None (the "
                             "run-time forms)")
        return self.tokens

    def with_tokens(self, tokens: int | None) -> LayerShape:
        """The same layer for another token count (None: the run-time forms)."""
        return dataclasses.replace(self, tokens=tokens)
