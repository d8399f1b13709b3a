"""LoRA hyper-parameters: ``Config(rank, alpha)`` and the scale ``alpha / rank``."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """The rank of a LoRA adapter and its alpha; ``scale = alpha / rank``.

    ``alpha`` defaults to ``rank`` (scale 1). peft and Hesper both multiply the
    low-rank update by ``alpha / rank``, so doubling the rank at a fixed alpha
    halves each rank's contribution.

    >>> Config(8, 16).scale
    2.0
    """

    rank: int
    alpha: float | None = None

    def __post_init__(self):
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise TypeError(f"Config: rank must be an int, got {type(rank).__name__} {rank!r}")
        if rank < 1:
            raise ValueError(f"Config: rank must be >= 1, got {rank}")
        object.__setattr__(self, "rank", int(rank))
        alpha = self.rank if self.alpha is None else self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
            raise TypeError(f"Config: alpha must be a real number, got "
                            f"{type(alpha).__name__} {alpha!r}")
        if not math.isfinite(alpha):
            raise ValueError(f"Config: alpha must be finite, got {alpha!r}")
        object.__setattr__(self, "alpha", float(alpha))

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor on ``B @ (A @ x)``."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank
