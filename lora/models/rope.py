"""Rotary position embeddings as transformers computes them: the settings read from a
config.json (transformers 5's ``rope_parameters`` or the older ``rope_theta`` and
``rope_scaling``), and the cos / sin tables, computed on the host in float32 with
torch's order of operations (transformers' modeling_rope_utils.py and
LlamaRotaryEmbedding.forward), to upload once.

Only static tables are computed (the same angle for a position whatever the sequence):
"default", "linear", "llama3" (Llama 3.1 / 3.2) and "yarn". "dynamic" rescales with the
sequence length and "longrope" switches factors with it; they are refused by name.

One step is not torch's: ``base ** x``, which torch computes with its vectorised
float32 pow (within 1 ulp, not correctly rounded), is computed here in float64 and
rounded once, so an entry of ``inv_freq`` may differ from torch's by an ulp or two (its
reciprocal's): none do for Llama 3's, Qwen2.5-0.5B's or SmolLM2's theta and head_dim;
about 2 in 5 other pairs have one such entry, which moves a table's angles by position
times that ulp (2.4e-7 at position 8192 for theta 1e6, head_dim 128).
``rope_tables(..., inv_freq=...)`` takes torch's own (a model's ``rotary_emb.inv_freq``)
for tables within 1 ulp of transformers' (tested at positions up to 8192).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .checks import MISSING, ModelError, boolean, integer, number

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")
DEFAULT_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
MAX_POSITIONS = 2**24     # positions are float32 in the tables: exact up to 2^24


@dataclass(frozen=True)
class RopeConfig:
    """The rotary settings of a model: ``rope_type`` one of SUPPORTED_ROPE, ``theta``
    the base; ``factor`` (linear, llama3, yarn), ``low_freq_factor`` /
    ``high_freq_factor`` (llama3), ``original_max_position_embeddings`` (llama3, yarn),
    ``beta_fast`` / ``beta_slow`` / ``truncate`` (yarn); ``attention_factor`` scales cos
    and sin (1.0 but for yarn)."""

    rope_type: str = "default"
    theta: float = DEFAULT_THETA
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    attention_factor: float = 1.0


def _rope_dict(d: dict, where: str) -> tuple[dict, str]:
    """(the rope settings, the key they came from): ``rope_scaling`` where it says
    anything (transformers reads it first), else ``rope_parameters``, else {}."""
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if value is not None and not isinstance(value, dict):
            raise ModelError(f"{where}: {key} must be an object or null, got {value!r}")
        if value:
            if {"full_attention", "sliding_attention"} & set(value):
                raise ModelError(f"{where}: {key} holds rope settings per layer type "
                                 f"({sorted(value)}); lora takes one set for every layer")
            return value, key
    return {}, "rope_parameters"


def rope_from_dict(d: dict, where: str, max_position_embeddings: int) -> RopeConfig:
    """The RopeConfig of a config.json's dict, as transformers standardises it: the
    type from ``rope_type`` (or the older ``type``), theta from the rope dict, else
    the top-level ``rope_theta``, else 10000; anything but SUPPORTED_ROPE refused."""
    params, key = _rope_dict(d, where)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE:
        why = {"dynamic": " ('dynamic' rescales the angles with each sequence's length)",
               "longrope": " ('longrope' switches its factors with the sequence's length)"}
        raise ModelError(f"{where}: {key}.rope_type {rope_type!r} is not supported; lora "
                         f"computes {SUPPORTED_ROPE}, static tables{why.get(rope_type, '')}")
    scoped = f"{where}: {key}"
    theta = (number(params, "rope_theta", None, scoped, positive=True) if "rope_theta" in params
             else number(d, "rope_theta", DEFAULT_THETA, where, positive=True))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise ModelError(f"{where}: partial_rotary_factor {partial!r}: lora rotates the whole "
                         f"head (1.0)")
    base = RopeConfig(rope_type, theta)
    if rope_type == "linear":
        return replace(base, factor=number(params, "factor", MISSING, scoped, positive=True))
    if rope_type == "llama3":
        return _llama3(params, scoped, base, max_position_embeddings)
    if rope_type == "yarn":
        return _yarn(params, scoped, base, max_position_embeddings)
    return base


def _original(params: dict, where: str, max_position_embeddings: int) -> int:
    return integer(params, "original_max_position_embeddings", max_position_embeddings, where,
                   high=MAX_POSITIONS)


def _llama3(params: dict, where: str, base: RopeConfig, max_positions: int) -> RopeConfig:
    low = number(params, "low_freq_factor", MISSING, where, positive=True)
    high = number(params, "high_freq_factor", MISSING, where, positive=True)
    if high <= low:
        raise ModelError(f"{where}: high_freq_factor ({high}) must be greater than "
                         f"low_freq_factor ({low}) (the smoothing divides by their difference)")
    return replace(base, factor=number(params, "factor", MISSING, where, positive=True),
                 low_freq_factor=low, high_freq_factor=high,
                 original_max_position_embeddings=_original(params, where, max_positions))


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, where: str, base: RopeConfig, max_positions: int) -> RopeConfig:
    """yarn's settings resolved as _compute_yarn_parameters does: a null factor is the
    ratio of the context lengths, the attention factor from factor and the mscales."""
    original = _original(params, where, max_positions)
    if "factor" not in params:  # transformers requires the key (null: the ratio below)
        raise ModelError(f"{where}: factor is missing (yarn's scaling factor, or null for "
                         f"max_position_embeddings / original_max_position_embeddings)")
    factor = number(params, "factor", max_positions / original, where, positive=True,
                    nullable=True)
    attention = params.get("attention_factor")
    if attention is None:
        mscale = number(params, "mscale", 0.0, where, nullable=True)
        all_dim = number(params, "mscale_all_dim", 0.0, where, nullable=True)
        attention = (_mscale(factor, mscale) / _mscale(factor, all_dim) if mscale and all_dim
                     else _mscale(factor))
    attention = number({"attention_factor": attention}, "attention_factor", None, where,
                       low=0.0)
    # `params.get("beta_fast") or 32`: null and 0 alike take the default
    fast = number(params, "beta_fast", 32.0, where, nullable=True) or 32.0
    slow = number(params, "beta_slow", 1.0, where, nullable=True) or 1.0
    return replace(base, factor=factor, original_max_position_embeddings=original,
                 beta_fast=fast, beta_slow=slow, attention_factor=attention,
                 truncate=boolean(params, "truncate", True, where))


# ---------------------------------------------------------------- the tables

F32 = np.float32


def _powers(theta: float, dim: int) -> np.ndarray:
    """``theta ** (arange(0, dim, 2) / dim)`` in float32: torch casts the base to
    float32; the power is rounded once from float64 (torch's is within 1 ulp)."""
    exponents = np.arange(0, dim, 2, dtype=F32) / F32(dim)
    return np.power(np.float64(F32(theta)), exponents.astype(np.float64)).astype(F32)


def _recip(x: np.ndarray) -> np.ndarray:
    """torch's ``scalar / tensor``: ``tensor.reciprocal() * scalar``; here the reciprocal."""
    return F32(1) / x


def _llama3_inv_freq(rope: RopeConfig, inv: np.ndarray) -> np.ndarray:
    """_compute_llama3_parameters, step for step in float32 (scalars cast to float32)."""
    assert rope.factor and rope.low_freq_factor and rope.high_freq_factor
    old = rope.original_max_position_embeddings
    assert old is not None
    low, high = F32(old / rope.low_freq_factor), F32(old / rope.high_freq_factor)
    wavelen = _recip(inv) * F32(2 * math.pi)
    scaled = np.where(wavelen > low, inv / F32(rope.factor), inv)
    smooth = ((_recip(wavelen) * F32(old) - F32(rope.low_freq_factor))
              / F32(rope.high_freq_factor - rope.low_freq_factor))
    smoothed = (F32(1) - smooth) * scaled / F32(rope.factor) + smooth * scaled
    medium = ~(wavelen < high) & ~(wavelen > low)
    return np.where(medium, smoothed, scaled).astype(F32)


def _yarn_inv_freq(rope: RopeConfig, powers: np.ndarray, dim: int) -> np.ndarray:
    """_compute_yarn_parameters' inverse frequencies, step for step in float32."""
    original = rope.original_max_position_embeddings
    assert rope.factor and rope.beta_fast and rope.beta_slow and original

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1)
    extrapolation = F32(1) - ramp
    interpolated = _recip(F32(rope.factor) * powers)
    return (interpolated * (F32(1) - extrapolation) + _recip(powers) * extrapolation).astype(F32)


def rope_inv_freq(config) -> np.ndarray:
    """The float32 inverse frequencies [head_dim / 2] transformers' rotary embedding
    holds for ``config`` (an LMConfig), by its rope type."""
    rope, dim = config.rope, config.head_dim
    powers = _powers(rope.theta, dim)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, powers, dim)
    inv = _recip(powers)
    if rope.rope_type == "linear":
        assert rope.factor
        return inv / F32(rope.factor)
    return _llama3_inv_freq(rope, inv) if rope.rope_type == "llama3" else inv


def _given_inv_freq(config, inv_freq) -> np.ndarray:
    """A caller's inverse frequencies (a model's ``rotary_emb.inv_freq``, torch or numpy)
    as float32 [head_dim / 2], as transformers' forward reads them (``.float()``)."""
    if hasattr(inv_freq, "detach"):
        inv_freq = inv_freq.detach().cpu().float().numpy()
    out = np.asarray(inv_freq)
    want = (config.head_dim // 2,)
    if out.shape != want or out.dtype.kind != "f" or not np.isfinite(out).all():
        raise ModelError(f"rope_tables: inv_freq must be {want[0]} finite floats "
                         f"(head_dim / 2), got {out.dtype.name} {out.shape}")
    return out.astype(F32)


def rope_tables(config, positions: int, inv_freq=None) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), float32 [positions, head_dim / 2], of positions 0 .. positions - 1:
    transformers' ``cat(freqs, freqs).cos()`` (one half-row serves both halves) with
    ``freqs = position * inv_freq`` in float32, each value's cos and sin rounded once
    to float32 (torch's are within 1 ulp), times the rope's attention factor in float32.
    ``inv_freq``: torch's own (a model's ``rotary_emb.inv_freq``), else rope_inv_freq's."""
    if isinstance(positions, bool) or not isinstance(positions, (int, np.integer)) or \
            not 1 <= positions <= MAX_POSITIONS:
        raise ModelError(f"rope_tables: positions must be an int from 1 to {MAX_POSITIONS} "
                         f"(float32 holds every position exactly up to 2^24), got {positions!r}")
    inv = rope_inv_freq(config) if inv_freq is None else _given_inv_freq(config, inv_freq)
    angles = (np.arange(positions, dtype=F32)[:, None] * inv[None, :]).astype(np.float64)
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    scale = config.rope.attention_factor
    if scale != 1.0:
        cos, sin = cos * F32(scale), sin * F32(scale)
    return cos, sin
