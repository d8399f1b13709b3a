"""The LoRA weights on the GPU: A ``[rank, in_dim]`` and B ``[out_dim, rank]``, row-major,
stored as float32 or (on adapters with shader-f16) float16."""
from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from shaderdsl.errors import BindingError, DeviceLostError

from .checks import check_f16, count, host_matrix
from .shape import LayerShape

STORAGE_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def storage_dtype(dtype) -> np.dtype:
    """float32 or float16 as a numpy dtype (given as numpy takes it, or as
    torch's ``torch.float16``), or a ValueError naming the choices."""
    name = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is None or dt not in STORAGE_DTYPES:
        raise ValueError(f"dtype: expected float32 or float16, got {dtype!r}")
    return dt


def wgsl_dtype(dtype: np.dtype) -> str:
    """The kernels' name for a storage dtype: "f32" or "f16"."""
    return "f16" if dtype == np.float16 else "f32"


class Weight:
    """GPU buffers of one LoRA adapter: ``a`` (A, ``[rank, in_dim]``) and
    ``b`` (B, ``[out_dim, rank]``), both row-major, float32 or float16
    (``dtype``; the activations of a forward must match it), on ``device``.

    Make one with :meth:`from_numpy` (your trained weights) or :meth:`init`
    (a fresh adapter, initialised the way peft does). The execute functions in
    :mod:`lora.hesper` take a Weight and the activation buffers.
    """

    __slots__ = ("device", "a", "b", "in_dim", "out_dim", "rank", "plans", "masters",
                 "on_read", "__weakref__")

    def __init__(self, device, a, b, in_dim: int, out_dim: int, rank: int):
        """Wrap existing buffers (both float32 or both float16, shaped
        ``(rank, in_dim)`` and ``(out_dim, rank)``); most code wants
        :meth:`from_numpy` instead."""
        self.in_dim = count(in_dim, "Weight: in_dim")
        self.out_dim = count(out_dim, "Weight: out_dim")
        self.rank = count(rank, "Weight: rank")
        for what, buf, shape in (("a", a, (rank, in_dim)), ("b", b, (out_dim, rank))):
            if getattr(buf, "device", None) is not device:
                raise BindingError(f"Weight: {what} must be a Buffer on {device!r}, got {buf!r}")
            if buf.dtype != a.dtype or buf.dtype not in STORAGE_DTYPES or buf.shape != shape:
                raise BindingError(f"Weight: {what} must be float32{list(shape)} or "
                                   f"float16{list(shape)} (a and b alike), got "
                                   f"{buf.dtype.name}{list(buf.shape)}")
        self.device, self.a, self.b = device, a, b
        self.masters = None  # f32 copies an f16 weight trains from (set by LayerTrainer)
        self.on_read = None  # called before numpy() reads (LayerTrainer: its label report)
        # The plans of this weight (lora.core.cache): they
        # hold its buffers, not the Weight, so they go when the weight goes.
        self.plans: dict = {}

    @classmethod
    def from_numpy(cls, device, a, b, *, dtype: DTypeLike = np.float32,
                   name: str = "lora") -> "Weight":
        """Upload A ``[rank, in_dim]`` and B ``[out_dim, rank]`` (any real float
        dtype), stored as ``dtype`` (float32, or float16 where the adapter has
        shader-f16). Shapes, dtypes, finiteness and the feature are checked
        before anything is allocated."""
        dtype = storage_dtype(dtype)
        check_f16(device, dtype, "Weight")
        a = host_matrix(a, "a", "[rank, in_dim]", dtype)
        b = host_matrix(b, "b", "[out_dim, rank]", dtype)
        if b.shape[1] != a.shape[0]:
            raise BindingError(f"Weight: rank mismatch: a is [rank, in_dim] = {list(a.shape)}, "
                               f"so b must be [out_dim, {a.shape[0]}], got {list(b.shape)}")
        rank, in_dim = a.shape
        out_dim = b.shape[0]
        return cls(device, device.buffer(a, name=f"{name}.A"), device.buffer(b, name=f"{name}.B"),
                   in_dim, out_dim, rank)

    @classmethod
    def init(cls, device, in_dim: int, out_dim: int, rank: int, seed: int = 0, *,
             dtype=np.float32, name: str = "lora") -> "Weight":
        """A fresh adapter as peft initialises one: B = 0, and A drawn from
        U(-1/sqrt(in_dim), 1/sqrt(in_dim)).

        That bound is ``torch.nn.init.kaiming_uniform_(A, a=sqrt(5))``, which
        peft uses (gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in)).
        Hesper draws A with bound sqrt(3 / in_dim) instead (gain 1), a factor
        sqrt(3) wider. Either way B = 0, so a new adapter adds exactly nothing
        until it is trained. ``seed`` feeds ``numpy.random.default_rng``.
        """
        in_dim, out_dim = count(in_dim, "Weight: in_dim"), count(out_dim, "Weight: out_dim")
        rank = count(rank, "Weight: rank")
        bound = 1.0 / math.sqrt(in_dim)
        rng = np.random.default_rng(seed)
        a = rng.uniform(-bound, bound, (rank, in_dim)).astype(np.float32)
        b = np.zeros((out_dim, rank), np.float32)
        return cls.from_numpy(device, a, b, dtype=dtype, name=name)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype of A and B (and of the activations a forward takes)."""
        return self.a.dtype

    def layer_shape(self, tokens: int | None = None, scale: float = 1.0) -> LayerShape:
        """This weight's layer for ``tokens`` tokens (None: the run-time forms)
        and ``scale``: what strategies are given."""
        return LayerShape(self.rank, self.in_dim, self.out_dim, tokens, wgsl_dtype(self.dtype),
                          scale)

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) read back from the GPU."""
        self._check_device()
        if self.on_read is not None:
            self.on_read()
        return self.device.read(self.a), self.device.read(self.b)

    def _check_device(self) -> None:
        """A weight whose device was lost is gone with it: say so by name."""
        if getattr(self.device, "lost", False):
            raise DeviceLostError(f"{self!r} was made on {self.device!r}, which is lost; make "
                                  f"the weight again on a fresh shaderdsl.runtime.get_device()")

    def write(self, a=None, b=None) -> None:
        """Overwrite A and/or B in place (same shapes; any real float dtype,
        cast to the weight's), and the f32 masters a trainer keeps of an f16
        weight (else its next step would write the old values back)."""
        self._check_device()
        given = (a, b)
        if a is not None:
            a = host_matrix(a, "a", "[rank, in_dim]", self.dtype)
            if a.shape != self.a.shape:
                raise BindingError(f"Weight.write: a must be {list(self.a.shape)}, got "
                                   f"{list(a.shape)}")
        if b is not None:
            b = host_matrix(b, "b", "[out_dim, rank]", self.dtype)
            if b.shape != self.b.shape:
                raise BindingError(f"Weight.write: b must be {list(self.b.shape)}, got "
                                   f"{list(b.shape)}")
        if a is not None:
            self.device.write(self.a, a)
        if b is not None:
            self.device.write(self.b, b)
        for value, master in zip(given, self.masters or ()):
            if value is not None:
                self.device.write(master, np.asarray(value, np.float32))

    def __repr__(self) -> str:
        return (f"<Weight rank={self.rank} in_dim={self.in_dim} out_dim={self.out_dim} "
                f"{self.dtype.name} on {self.device.name!r}>")


def weight_on(device, weight) -> Weight:
    """``weight`` as a live Weight on ``device``, else a BindingError naming it."""
    if not isinstance(weight, Weight):
        raise BindingError(f"weight: expected a lora.Weight (Weight.from_numpy or Weight.init), "
                           f"got {type(weight).__name__}")
    if weight.device is not device:
        raise BindingError(f"weight: {weight!r} lives on another device than {device!r}")
    for what, buf in (("weight.a", weight.a), ("weight.b", weight.b)):
        if buf.released:
            raise BindingError(f"{what}: {buf!r} was released")
    return weight
