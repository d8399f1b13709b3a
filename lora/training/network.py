"""A stack of frozen layers with LoRA, trained together on the GPU: the whole
step (the forward, the loss, the backward through every layer, the frozen
weights' input gradient included, and the optimizer) in one submit.

    net = lora.Network([lora.Linear(W1, b1, rank=8, alpha=16, name="fc1"), "relu",
                        lora.Linear(W2, b2, rank=8, alpha=16, name="fc2")],
                       loss="xent", optimizer=lora.AdamW(lr=1e-2))
    net.step(x, labels)    # records one step; nothing is read back
    net.loss()             # the last step's loss (waits for the GPU)

Every layer is checked when the network is made, before any GPU buffer
exists; the buffers and plans are made at the first step, for that batch's
row count. A Linear's name is its module name in the peft adapter file
(``save_adapter``): by default its index in the list, as ``torch.nn.Sequential``
names the same layers.
"""
from __future__ import annotations

import math
import re

import numpy as np
from numpy.typing import DTypeLike

from ..core import checks as C
from ..core import reference as R
from ..core.plan import Plan
from ..core.tuning import product_tiling
from ..core.weight import Weight, storage_dtype, wgsl_dtype
from ..kernels.dropout import threshold
from ..kernels.matrix import FRAGMENT
from ..kernels.network import ACTIVATIONS
from .adapter_io import LoraLayer, load_adapter, save_adapter
from .backward import backward_plan, dropout_plan, train_forward_plan
from .losses import LOSSES, loss_plan, loss_value, report_labels
from .optim import AdamW, check_free
from .trainer import _masters


class Linear:
    """A frozen ``y = x W^T + b`` (W [out, in], as torch.nn.Linear stores it; b
    optional), with a LoRA adapter or without one (then only frozen).

    ``adapter``: (A [rank, in], B [out, rank]) or a lora.LoraLayer (which
    brings its alpha); or ``rank``: a fresh adapter as peft makes one (B = 0,
    A Kaiming-uniform, seeded by ``seed``). The scale is ``scale``, else
    ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``, as peft's
    rsLoRA, which a LoraLayer's flag also sets), else 1. ``name``: the module
    name in adapter files.
    """

    def __init__(self, weight, bias=None, *, adapter=None, rank=None, alpha=None, scale=None,
                 name=None, seed=0, use_rslora=False):
        self.name = "" if name is None else str(name)
        what = f"Linear {self.name!r}" if self.name else "Linear"
        if hasattr(weight, "in_features") and hasattr(weight, "weight"):
            raise ValueError(f"{what}: weight is a torch.nn.{type(weight).__name__}, expected its "
                             f"weight [out, in]: lora.Linear(m.weight, m.bias, rank=8), or "
                             f"lora.Network.from_torch(model, target_modules=...) for a whole "
                             f"nn.Sequential")
        self.weight = _matrix(weight, f"{what}: weight", "[out, in]")
        out_dim, in_dim = self.weight.shape
        self.bias = None if bias is None else _vector(bias, f"{what}: bias", out_dim)
        rslora = bool(use_rslora)
        if isinstance(adapter, LoraLayer):
            if alpha is None and scale is None:
                alpha, rslora = adapter.alpha, rslora or adapter.use_rslora
            adapter = (adapter.a, adapter.b)
        if adapter is not None and rank is not None:
            raise ValueError(f"{what}: give adapter=(A, B) or rank=r, not both")
        if rank is not None:
            rank = C.count(rank, f"{what}: rank")
            adapter = R.init_lora(in_dim, out_dim, rank, seed=seed)
        self.adapter = None if adapter is None else _pair(adapter, what, in_dim, out_dim)
        self.rank = 0 if self.adapter is None else self.adapter[0].shape[0]
        root = math.sqrt(self.rank) if rslora and self.rank else float(self.rank or 1)
        self.scale = C.scale_of(alpha, scale, root)
        self.use_rslora = rslora
        self.alpha = self.scale * root  # as peft's config would hold it

    @property
    def in_dim(self) -> int:
        return self.weight.shape[1]

    @property
    def out_dim(self) -> int:
        return self.weight.shape[0]

    def __repr__(self) -> str:
        rank = f" rank={self.rank}" if self.rank else " frozen"
        return f"<Linear {self.name!r} {self.in_dim} -> {self.out_dim}{rank}>"


def _matrix(value, what: str, layout: str) -> np.ndarray:
    """A finite 2-D float array as float32, or ValueError naming ``what``."""
    arr = C.host_values(value)
    if arr.dtype.kind != "f" or arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(f"{what} must be a 2-D float array {layout}, got "
                         f"{arr.dtype.name} {arr.shape}")
    out = arr.astype(np.float32)
    if not np.isfinite(out).all():
        raise ValueError(f"{what} has NaN or infinite values (as float32)")
    return out


def _vector(value, what: str, n: int) -> np.ndarray:
    arr = C.host_values(value)
    if arr.dtype.kind != "f" or arr.shape != (n,) or not np.isfinite(arr).all():
        raise ValueError(f"{what} must be {n} finite floats (one per output), got "
                         f"{arr.dtype.name} {arr.shape}")
    return arr.astype(np.float32)


def _pair(adapter, what: str, in_dim: int, out_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) checked against the layer: A [rank, in_dim], B [out_dim, rank]."""
    if not isinstance(adapter, (tuple, list)) or len(adapter) != 2:
        raise ValueError(f"{what}: adapter must be (A, B) or a lora.LoraLayer, got "
                         f"{type(adapter).__name__}")
    a = _matrix(adapter[0], f"{what}: adapter A", "[rank, in]")
    b = _matrix(adapter[1], f"{what}: adapter B", "[out, rank]")
    if a.shape[1] != in_dim or b.shape != (out_dim, a.shape[0]):
        raise ValueError(f"{what}: the adapter does not fit the layer ({in_dim} -> {out_dim}): "
                         f"A must be [rank, {in_dim}] and B [{out_dim}, rank], got A "
                         f"{list(a.shape)} and B {list(b.shape)}")
    return a, b


def _check_f16_range(linears) -> None:
    """Every frozen weight, bias and adapter finite as float16 (at most 65504)."""
    for layer in linears:
        named = {"weight": layer.weight, "bias": layer.bias, "adapter A": None, "adapter B": None}
        if layer.adapter is not None:
            named["adapter A"], named["adapter B"] = layer.adapter
        for what, value in named.items():
            if value is not None and np.abs(value).max() > np.finfo(np.float16).max:
                raise ValueError(f"Network: Linear {layer.name!r}: {what} has values past "
                                 f"float16's range (65504); use dtype=np.float32")


def _torch_hint(layer) -> str:
    """How to write a torch module this list does not take as it is."""
    kind = type(layer).__name__
    if kind.lower() in ACTIVATIONS:
        return f" (torch.nn.{kind}? give its name, {kind.lower()!r})"
    if hasattr(layer, "weight") and hasattr(layer, "in_features"):
        return (f" (torch.nn.{kind}? wrap it: lora.Linear(m.weight, m.bias, rank=8, "
                f"alpha=16), or without rank for a frozen layer)")
    return ""


def check_layers(layers) -> list:
    """The layers, named and checked: Linear or an activation's name, each
    Linear's input the width the layer before it gives, names unique, at
    least one adapter. ValueError naming the layer otherwise."""
    layers = list(layers)
    if not layers:
        raise ValueError("Network: no layers; expected Linear layers and activations")
    width, names = None, set()
    for i, layer in enumerate(layers):
        if isinstance(layer, str):
            if layer not in ACTIVATIONS:
                raise ValueError(f"Network: layer {i}: unknown activation {layer!r}; expected "
                                 f"one of {ACTIVATIONS} or a lora.Linear")
            continue
        if not isinstance(layer, Linear):
            raise ValueError(f"Network: layer {i}: expected a lora.Linear or one of "
                             f"{ACTIVATIONS}, got {type(layer).__name__}{_torch_hint(layer)}")
        if not layer.name:
            layer.name = str(i)
        if layer.name in names:
            raise ValueError(f"Network: layer {i}: the name {layer.name!r} is taken by an "
                             f"earlier layer; module names must be unique")
        names.add(layer.name)
        if width is not None and layer.in_dim != width:
            raise ValueError(f"Network: layer {i} ({layer.name!r}) takes {layer.in_dim} inputs, "
                             f"but the layer before it gives {width}")
        width = layer.out_dim
    if width is None:
        raise ValueError("Network: no Linear layer; an activation alone has nothing to train")
    if not any(isinstance(x, Linear) and x.adapter is not None for x in layers):
        raise ValueError("Network: no Linear layer has an adapter, so there is nothing to "
                         "train; give one adapter=(A, B) or rank=r")
    return layers


def layers_from_torch(module, target_modules, rank: int, alpha, seed: int,
                      use_rslora: bool = False) -> list:
    """A torch ``nn.Sequential``'s children as Network's layers: each Linear a
    lora.Linear named as its child (so a saved adapter loads into the torch
    model with the same ``target_modules``), with a fresh adapter where
    ``target_modules`` (child names, or "all-linear") names it; ReLU, GELU
    (exact), SiLU and Tanh by name. ValueError naming anything else."""
    if hasattr(module, "peft_config"):
        raise ValueError("Network.from_torch: got a peft model; give the torch model as it was "
                         "before get_peft_model (peft_model.unload() returns it), and load a "
                         "saved adapter with net.load_adapter(path)")
    children = list(module.named_children()) if hasattr(module, "named_children") else []
    if children and not _is_sequential(module):
        first = children[0][0]
        part = f"m.{first}" if first.isidentifier() else f"m[{first}]"
        raise ValueError(f"Network.from_torch: expected a torch.nn.Sequential, got "
                         f"{type(module).__name__}, whose forward is not read here (it may add, "
                         f"skip or reorder its children): list its layers in the order forward "
                         f"runs them, lora.Network([lora.Linear({part}.weight, {part}.bias, "
                         f"rank=8, name={first!r}), 'relu', "
                         f"...]), named as the model names them")
    if not children:
        raise ValueError(f"Network.from_torch: expected a torch.nn.Sequential of Linear layers "
                         f"and activations, got {type(module).__name__}")
    linears = [name for name, m in children if hasattr(m, "in_features")]
    targets = _targets(target_modules, linears)
    layers: list = []
    for k, (name, m) in enumerate(children):
        kind = type(m).__name__
        if hasattr(m, "in_features"):
            adapted = name in targets
            layers.append(Linear(m.weight, m.bias, rank=rank if adapted else None,
                                 alpha=alpha if adapted else None, name=name, seed=seed + k,
                                 use_rslora=use_rslora))
        elif kind.lower() in ACTIVATIONS and getattr(m, "approximate", "none") == "none":
            layers.append(kind.lower())
        else:
            shown = f"GELU(approximate={m.approximate!r})" if kind == "GELU" else kind
            raise ValueError(f"Network.from_torch: layer {name!r} is {shown}; expected Linear, "
                             f"ReLU, GELU (exact), SiLU or Tanh")
    return layers


def _is_sequential(module) -> bool:
    """Whether ``module`` is a torch.nn.Sequential (or a subclass that keeps its forward)."""
    kinds = type(module).__mro__
    seq = next((k for k in kinds if k.__name__ == "Sequential" and
                k.__module__.startswith("torch.nn")), None)
    return seq is not None and getattr(type(module), "forward", None) is getattr(seq, "forward")


def _targets(target_modules, linears: list[str]) -> list[str]:
    """The Linear children ``target_modules`` names, as peft reads it: a list of
    names, "all-linear", or a string: a regex matching whole names (re.fullmatch)."""
    if target_modules == "all-linear":
        return linears
    if isinstance(target_modules, str):
        try:
            matched = [name for name in linears if re.fullmatch(target_modules, name)]
        except re.error as e:
            raise ValueError(f"Network.from_torch: target_modules {target_modules!r} is not a "
                             f"valid regex ({e})") from None
        if not matched:
            raise ValueError(f"Network.from_torch: target_modules {target_modules!r} (a regex, "
                             f"as peft reads a string) matches no Linear of the model (its "
                             f"Linear layers: {linears})")
        return matched
    targets = list(target_modules)
    unknown = [t for t in targets if t not in linears]
    if unknown:
        raise ValueError(f"Network.from_torch: target_modules {unknown} name no Linear of the "
                         f"model (its Linear layers: {linears})")
    return targets


class Network:
    """Layers (lora.Linear and activation names: "relu", "gelu", "silu",
    "tanh") trained together: ``step(x, y)`` records one training step in one
    submit; ``loss()`` reads the last one's loss back.

    ``loss``: "mse" against targets [rows, out], or "xent": softmax
    cross-entropy of the output as logits against integer labels [rows].
    ``optimizer``: a lora.AdamW or lora.SGD (default AdamW()), over every
    adapter's A and B, clipped by their global norm where it says so.
    ``batch``: the rows of every step (None: the first step's or forward's).
    ``dtype``: float32, or float16 for mixed precision as torch.autocast
    does it: weights, activations, targets and their gradients stored f16,
    every sum f32, the optimizer updating f32 masters of A and B (the values
    ``adapters()`` returns) and writing their f16 rounding after each step.
    ``forward`` / ``backward``: the LoRA strategies (None: each layer's default).
    ``lora_dropout``: peft's option: in each training step every adapted
    layer's adapter input is dropped (probability p, the rest scaled by
    1 / (1 - p)), its base input is not, and the input gradient through the
    adapter takes the same mask; the mask of the layer at position k of
    ``layers`` is :func:`lora.training.backward.dropout_plan`'s hash of
    (``dropout_seed`` + k mod 2^32, the optimizer's step count, the element's
    index). ``forward()`` drops nothing. 0: no dispatch, today's step.
    """

    def __init__(self, layers, *, loss="mse", optimizer=None, batch=None,
                 dtype: DTypeLike = np.float32, device=None, forward=None, backward=None,
                 lora_dropout: float = 0.0, dropout_seed: int = 0):
        if loss not in LOSSES:
            raise ValueError(f"Network: loss: expected one of {LOSSES} (mean squared error, as "
                             f"torch's mse_loss; softmax cross-entropy of logits against "
                             f"integer labels, as torch's cross_entropy), got {loss!r}")
        self.layers = check_layers(layers)
        self._dtype = storage_dtype(dtype)
        if self._dtype == np.float16:
            _check_f16_range(self.linears)
        self.kind = loss
        self.optimizer = AdamW() if optimizer is None else optimizer
        check_free(self.optimizer, "Network")
        self.strategies = (forward, backward)
        threshold(lora_dropout)  # ValueError outside [0, 1)
        if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, (int, np.integer)) \
                or not 0 <= dropout_seed < 2**32:
            raise ValueError(f"Network: dropout_seed: expected an int in [0, 2^32), got "
                             f"{dropout_seed!r}")
        self.dropout = (float(lora_dropout), int(dropout_seed))
        self._device = device
        self.batch = 0 if batch is None else C.count(batch, "Network: batch")
        self._batch_from = f"Network(batch={batch})"  # what set it: that, a step or forward
        self._gpu = None       # _Built, made at the first step
        self._steps = 0

    @classmethod
    def from_torch(cls, module, *, target_modules, rank: int = 8, alpha=8, seed: int = 0,
                   use_rslora: bool = False, **options) -> "Network":
        """The network of a torch ``nn.Sequential`` (Linear layers and
        activations), adapters on the Linear children ``target_modules`` names
        as peft's ``LoraConfig(r=rank, lora_alpha=alpha, target_modules=...)``
        does, with its defaults (r 8, lora_alpha 8: the scale alpha / rank;
        ``use_rslora``: alpha / sqrt(rank)); ``options`` are the constructor's
        (loss, optimizer, ...)."""
        return cls(layers_from_torch(module, target_modules, rank, alpha, seed, use_rslora),
                   **options)

    @property
    def dtype(self) -> np.dtype:
        """float32, or float16 (mixed precision)."""
        return self._dtype

    @property
    def linears(self) -> list[Linear]:
        """The Linear layers, in order."""
        return [x for x in self.layers if isinstance(x, Linear)]

    @property
    def in_dim(self) -> int:
        return self.linears[0].in_dim

    @property
    def out_dim(self) -> int:
        return self.linears[-1].out_dim

    @property
    def device(self):
        if self._device is None:
            from shaderdsl.runtime import get_device
            self._device = get_device()
        return self._device

    def build(self, batch: int) -> "_Built":
        """The buffers and plans for ``batch`` rows (made once; the first step does it)."""
        if self.batch and batch != self.batch:
            raise ValueError(f"Network.build: this network takes batches of {self.batch} "
                             f"rows ({self._batch_from}), not {batch}; make another Network "
                             f"for {batch}")
        if self._gpu is None:
            self.batch = self.batch or C.count(batch, "Network: batch")
            check_free(self.optimizer, "Network")  # not taken by another since __init__
            self._gpu = _Built(self, self.device, self.batch)
        return self._gpu

    def step(self, x, y) -> None:
        """One training step on x [batch, in] and y (mse: targets [batch, out];
        xent: labels [batch]): written, then recorded in one submit."""
        x, y = self._inputs(x, y)
        if not self.batch:
            self._batch_from = "set by the first step"
        gpu = self.build(len(x))
        self.device.write(gpu.values[0], x)
        self.device.write(gpu.target, y)
        self.record()

    def record(self) -> None:
        """One training step on the batch already in the GPU's x and target
        buffers (``build(batch).values[0]`` and ``.target``), in one submit.
        Their labels are not checked here: see :meth:`report_labels`."""
        if self._gpu is None:
            raise RuntimeError("Network.record: no buffers yet; call build(batch) or step(x, y)")
        self._gpu.record_step()
        self._steps += 1

    def _inputs(self, x, y) -> tuple[np.ndarray, np.ndarray]:
        """x and y stored as the network's dtype (labels as uint32), checked against it."""
        x = C.host_values(x)
        if x.dtype.kind not in "fiu" or x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"Network.step: x must be [rows, {self.in_dim}] numbers, got "
                             f"{x.dtype.name} {x.shape}")
        rows = x.shape[0]
        if self.batch and rows != self.batch:
            raise ValueError(f"Network.step: this network steps on batches of {self.batch} "
                             f"rows ({self._batch_from}), x has {rows}; drop a smaller last "
                             f"batch or make another Network for it")
        y = C.host_values(y)
        if self.kind == "xent":
            if y.dtype.kind not in "iu" or y.shape != (rows,):
                raise ValueError(f"Network.step: with loss 'xent', y must be {rows} integer "
                                 f"labels, got {y.dtype.name} {y.shape}")
            if y.min(initial=0) < 0 or y.max(initial=0) >= self.out_dim:
                ignored = (" (-100 is torch's ignore_index, which the loss here does not skip: "
                           "leave those rows out of the batch)") if np.any(y == -100) else ""
                raise ValueError(f"Network.step: labels must be in 0..{self.out_dim - 1} (the "
                                 f"output has {self.out_dim} classes), got {y.min()}..{y.max()}"
                                 f"{ignored}")
            return self._stored(x, "x", "step"), np.ascontiguousarray(y, np.uint32)
        if y.dtype.kind not in "fiu" or y.shape != (rows, self.out_dim):
            raise ValueError(f"Network.step: with loss 'mse', y must be [{rows}, "
                             f"{self.out_dim}] numbers, got {y.dtype.name} {y.shape}")
        return self._stored(x, "x", "step"), self._stored(y, "y", "step")

    def _stored(self, values: np.ndarray, what: str, call: str) -> np.ndarray:
        """``values`` as the network's dtype; a ValueError where a finite value
        would be stored as infinity (past float16's 65504), as lora.forward refuses."""
        top = np.abs(values[np.isfinite(values)]).max(initial=0)
        if self.dtype == np.float16 and top > np.finfo(np.float16).max:
            raise ValueError(f"Network.{call}: {what} holds {top:g}, past float16's range "
                             f"(65504): stored as float16 it would be infinite; scale it or "
                             f"make the network with dtype=np.float32")
        return np.ascontiguousarray(values, self.dtype)

    def loss(self) -> float:
        """The last step's loss (reads back: waits for the GPU), after
        :meth:`report_labels`."""
        if not self._steps or self._gpu is None:
            raise RuntimeError("Network.loss: no step recorded yet; call step(x, y) first")
        self.report_labels()
        return loss_value(self.device, self._gpu.loss)

    def report_labels(self) -> None:
        """With loss="xent": ValueError naming the first step and token whose
        label was outside the classes since the last report (labels written to
        the target buffer for :meth:`record`; step() refuses them at once),
        which clears the record: a sticky record on the GPU, written by the
        loss's dispatch, read only here. :meth:`loss`, :meth:`adapters` (and
        so :meth:`save_adapter`) and :meth:`forward` call it first."""
        if self._gpu is not None:
            report_labels(self.device, self._gpu.loss)

    def forward(self, x) -> np.ndarray:
        """The adapted network's output for x [rows, in] (float32, read back),
        run in batches of the training batch's rows (the last one padded)."""
        x = C.host_values(x)
        if x.dtype.kind not in "fiu" or x.ndim != 2 or x.shape[1] != self.in_dim:
            raise ValueError(f"Network.forward: x must be [rows, {self.in_dim}] numbers, got "
                             f"{x.dtype.name} {x.shape}")
        x = self._stored(x, "x", "forward")
        self.report_labels()
        if not self.batch:
            self._batch_from = (f"set by the first forward(x), of {len(x)} rows, before any "
                                f"step: give Network(..., batch=rows) to step on another")
        gpu = self.build(self.batch or len(x))
        out = []
        for start in range(0, len(x), self.batch):
            part = np.zeros((self.batch, self.in_dim), self.dtype)
            chunk = x[start:start + self.batch]
            part[:len(chunk)] = chunk
            self.device.write(gpu.values[0], part)
            with self.device.batch():
                gpu.record_forward()
            out.append(self.device.read(gpu.values[-1])[:len(chunk)].astype(np.float32))
        return np.concatenate(out) if out else np.zeros((0, self.out_dim), np.float32)

    def adapters(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{name: (A, B)} of every adapted layer: read back once the GPU has
        them (after :meth:`report_labels`)."""
        if self._gpu is None:
            return {x.name: x.adapter for x in self.linears if x.adapter is not None}
        self.report_labels()
        read = self.device.read
        return {name: (read(a).copy(), read(b).copy())
                for name, (a, b) in self._gpu.masters.items()}

    def save_adapter(self, path, **kw):
        """Every adapter as one peft adapter (lora.save_adapter), module names
        the layers' names, each layer's alpha (peft's alpha_pattern where they
        differ), use_rslora where every adapted layer has it (peft's one flag;
        otherwise each alpha is written as scale * rank), the network's
        lora_dropout; extra keywords go to save_adapter."""
        adapted = [x for x in self.linears if x.adapter is not None]
        if "use_rslora" in kw:
            raise ValueError("Network.save_adapter: use_rslora comes from the layers (each "
                             "Linear's use_rslora), not from a keyword")
        rslora = all(x.use_rslora for x in adapted)  # peft's flag is one for every module
        alphas = {x.name: x.alpha if rslora else x.scale * x.rank for x in adapted}
        kw.setdefault("lora_dropout", self.dropout[0])
        return save_adapter(path, self.adapters(), alpha=alphas, use_rslora=rslora, **kw)

    def load_adapter(self, path) -> None:
        """Every adapted layer's A and B from a peft adapter (lora.load_adapter)
        whose modules are exactly the adapted layers, each of its rank and scale."""
        layers = load_adapter(path)
        mine = {x.name: x for x in self.linears if x.adapter is not None}
        if set(layers) != set(mine):
            raise ValueError(f"Network.load_adapter: {path} has the modules {sorted(layers)}, "
                             f"the network's adapted layers are {sorted(mine)}")
        for name, layer in layers.items():
            pair = _pair((layer.a, layer.b), f"Network.load_adapter: {name!r}",
                         mine[name].in_dim, mine[name].out_dim)
            if pair[0].shape[0] != mine[name].rank or \
                    not np.isclose(layer.scale, mine[name].scale, rtol=1e-6):
                raise ValueError(f"Network.load_adapter: {name!r} in {path} has rank "
                                 f"{layer.rank} and scale {layer.scale}; the layer has rank "
                                 f"{mine[name].rank} and scale {mine[name].scale}")
        for name, layer in layers.items():
            pair = (layer.a.astype(np.float32), layer.b.astype(np.float32))
            mine[name].adapter = pair
            if self._gpu is not None:
                self._gpu.weights[name].write(*pair)


TILED_FROM = 128 * 128  # weights of at least this many values use the tiled base products


def base_kernel(name: str, device, wgsl: str, **params) -> tuple:
    """A frozen base product's (kernel, parameters) for a weight [out_dim,
    in_dim] (both in ``params``): for a large one, on matrix units where f16 runs on them (f16
    16x16x16 fragments, f32 sums; widths multiples of 4; the engine's tiling
    for the shape: tuned where the cache has it, else lora.core.tilings' rule
    within the device's limits: lora.core.tuning.product_tiling), else tiled (the
    same sums in the same order as the plain kernel, so the same result; W
    read once per 64 tokens instead of once per token); the plain kernel for
    a small one. ``name``: "dense" or "dense_grad_input"."""
    in_dim, out_dim = params["in_dim"], params["out_dim"]
    if in_dim * out_dim < TILED_FROM:
        return name, dict(params, dtype=wgsl)
    if wgsl == "f16" and FRAGMENT in getattr(device, "subgroup_matrix_configs", ()) \
            and in_dim % 4 == 0 and out_dim % 4 == 0:
        return f"{name}_matrix", dict(params, tiling=product_tiling(device, name, params))
    return f"{name}_tiled", dict(params, dtype=wgsl)


class _Built:
    """A network's GPU side for ``batch`` rows: values[l] is layer l's input
    (values[0] = x, values[-1] the output), grads[l] its gradient; one plan
    list per direction, recorded in order."""

    def __init__(self, net: Network, device, batch: int):
        C.check_f16(device, net.dtype, "Network")
        self.device, self.net = device, net
        layers, f32, dt = net.layers, np.float32, net.dtype
        self.wgsl = wgsl_dtype(dt)
        dims = [net.in_dim]
        for layer in layers:
            dims.append(layer.out_dim if isinstance(layer, Linear) else dims[-1])
        self.values = [device.empty((batch, d), dt, name=f"net.v{i}") for i, d in enumerate(dims)]
        self.first = next(i for i, x in enumerate(layers)
                          if isinstance(x, Linear) and x.adapter is not None)
        self.grads = {i: device.empty((batch, dims[i]), dt, name=f"net.d{i}")
                      for i in range(self.first + 1, len(layers))}
        self.weights = {x.name: Weight.from_numpy(device, *x.adapter, dtype=dt, name=x.name)
                        for x in net.linears if x.adapter is not None}
        self.base = {x.name: (device.buffer(x.weight.astype(dt), name=f"{x.name}.weight"),
                              None if x.bias is None else
                              device.buffer(x.bias.astype(dt), name=f"{x.name}.bias"))
                     for x in net.linears}
        copies = {name: _masters(device, w) for name, w in self.weights.items()}
        self.masters = {name: pair for name, (pair, _) in copies.items()}
        self.to_f16 = [plan for _, plan in copies.values() if plan is not None]
        self.loss = loss_plan(device, net.kind, batch, net.out_dim, net.dtype,
                              seen=net.kind == "xent")
        self.grads[len(layers)] = self.loss.scratch["g"]
        label = np.uint32 if net.kind == "xent" else dt
        self.target = device.empty((batch,) if net.kind == "xent" else (batch, net.out_dim),
                                   label, name="net.target")
        self.param_grads = {name: (device.empty(w.a.shape, f32, name=f"{name}.dA"),
                                   device.empty(w.b.shape, f32, name=f"{name}.dB"))
                            for name, w in self.weights.items()}
        net.optimizer.attach(device, [pair for name, params in self.masters.items()
                                      for pair in zip(params, self.param_grads[name])])
        self.dropped = self._dropouts(batch)
        self.forwards = [self._forward(i, batch) for i in range(len(layers))]
        self.inference = self.forwards if not self.dropped else \
            [self._forward(i, batch, training=False) for i in range(len(layers))]
        self.backwards = [self._backward(i, batch) for i in range(self.first, len(layers))][::-1]

    def _dropouts(self, batch: int) -> dict:
        """With lora_dropout, {layer position: its dropout plans and buffers}:
        "forward" drops x into "x", "backward" masks the adapter's input
        gradient "dx" into the layer's (None for the first trained layer)."""
        p, seed = self.net.dropout
        if not threshold(p):
            return {}
        dev, dt, state, out = self.device, self.net.dtype, self.net.optimizer.state, {}
        for i, layer in enumerate(self.net.layers):
            if not isinstance(layer, Linear) or layer.adapter is None:
                continue
            w, k = self.weights[layer.name], (seed + i) % 2**32
            has_dx = i in self.grads
            out[i] = {"forward": dropout_plan(dev, w, batch, p, k, state),
                      "x": dev.empty((batch, layer.in_dim), dt, name=f"{layer.name}.x_dropped"),
                      "backward": dropout_plan(dev, w, batch, p, k, state) if has_dx else None,
                      "dx": dev.empty((batch, layer.in_dim), dt, name=f"{layer.name}.dx_dropped")
                      if has_dx else None}
        return out

    def _forward(self, i: int, batch: int, training: bool = True) -> list:
        """Layer i's forward: [(plan, args)], from values[i] into values[i + 1]
        (in training, the adapter's input dropped where lora_dropout says)."""
        layer, dev = self.net.layers[i], self.device
        x, y = self.values[i], self.values[i + 1]
        if isinstance(layer, str):
            return [(Plan(dev, f"net {i} {layer}", [("activation", dict(
                n=y.size, kind=layer, dtype=self.wgsl))], {}, bound={"z": x, "y": y}), ())]
        w, bias = self.base[layer.name]
        bound = {"x": x, "W": w, "y": y, **({"bias": bias} if bias is not None else {})}
        dense = Plan(dev, f"net {i} {layer.name} dense", [base_kernel(
            "dense", dev, self.wgsl, in_dim=layer.in_dim, out_dim=layer.out_dim,
            tokens=batch, bias=bias is not None)], {}, bound=bound)
        steps: list[tuple[Plan, tuple]] = [(dense, ())]
        if layer.adapter is not None:
            drop = self.dropped.get(i) if training else None
            if drop is not None:
                steps.append((drop["forward"], (x, drop["x"])))
            plan = train_forward_plan(dev, self.weights[layer.name], layer.scale, batch,
                                      self.net.strategies[0], given=())
            steps.append((plan, (x if drop is None else drop["x"], y)))
        return steps

    def _backward(self, i: int, batch: int) -> list:
        """Layer i's backward: [(plan, args)], from grads[i + 1] into grads[i]
        (the adapter's dA, dB; no input gradient for the first trained layer)."""
        layer, dev = self.net.layers[i], self.device
        g, x, dx = self.grads[i + 1], self.values[i], self.grads.get(i)
        if isinstance(layer, str):
            return [(Plan(dev, f"net {i} {layer} grad", [("activation_grad", dict(
                n=x.size, kind=layer, dtype=self.wgsl))], {},
                bound={"z": x, "dy": g, "dz": dx}), ())]
        steps: list[tuple[Plan, tuple]] = []
        if layer.adapter is not None:
            plan = backward_plan(dev, self.weights[layer.name], layer.scale, batch,
                                 self.net.strategies[1], with_dx=dx is not None)
            h = self.forwards[i][-1][0].h
            drop = self.dropped.get(i)
            x_in, dx_out = (x, dx) if drop is None else (drop["x"], drop["dx"])
            steps.append((plan, (g, x_in, h, *self.param_grads[layer.name],
                                 *((dx_out,) if dx is not None else ()))))
            if drop is not None and dx is not None:  # the same mask on the input gradient
                steps.append((drop["backward"], (drop["dx"], dx)))
        if dx is not None:
            kernel = base_kernel("dense_grad_input", dev, self.wgsl, in_dim=layer.in_dim,
                                 out_dim=layer.out_dim, tokens=batch,
                                 accumulate=layer.adapter is not None)
            steps.append((Plan(dev, f"net {i} {layer.name} dense grad", [kernel], {},
                               bound={"g": g, "W": self.base[layer.name][0], "dx": dx}), ()))
        return steps

    def record_forward(self, training: bool = False) -> None:
        """The forward of every layer (in training, with lora_dropout's drops)."""
        for steps in self.forwards if training else self.inference:
            for plan, args in steps:
                plan.record(*args)

    def record_step(self) -> None:
        """Forward, loss, backward (last layer first), optimizer: one submit."""
        with self.device.batch():
            self.record_forward(training=True)
            self.loss.record(self.values[-1], self.target)
            for steps in self.backwards:
                for plan, args in steps:
                    plan.record(*args)
            self.net.optimizer.record()
            for plan in self.to_f16:
                plan.record()
