"""Several adapters in one batch, each sequence naming one (peft's
``adapter_names``: a name per sample, ``"__base__"`` for none): every adapted
module's adapters in one :class:`lora.AdapterPool` and each row routed to
its own by the many-adapter kernels (``forward_many``'s plans).

"default" is the model's own (trained) adapter, taken from its masters when
a batch first names it after a step; others come from
``CausalLM.add_adapter`` (a peft directory or ``{module: LoraLayer}``). A
module an adapter does not have gets no delta from it, as in peft.
"""
from __future__ import annotations

import numpy as np

from ..core.many import plan_options
from ..core.many_plan import BASE
from ..core.pool import AdapterPool
from ..training.adapter_io import LoraLayer

DEFAULT = "default"


class MixedAdapters:
    """The named adapters of a model, their pools (one per module, made on
    first use) and each pool's plan."""

    def __init__(self, model):
        self.model = model
        self.named: dict[str, dict[str, LoraLayer]] = {}
        self.pools: dict[str, AdapterPool] = {}
        self._plans: dict = {}  # (module, rows, form) -> the pool's ManyPlan
        self._default_at = -1   # the model's step count when "default" was last pooled

    def add(self, name: str, layers: dict) -> None:
        """Keep ``layers`` {module: LoraLayer} under ``name``, checked against
        the model's Linear modules (dims), before any pool changes."""
        if not isinstance(name, str) or not name or name in (BASE, DEFAULT):
            raise ValueError(f"CausalLM.add_adapter: the name must be a non-empty str other "
                             f"than {BASE!r} and {DEFAULT!r} (the model's own), got {name!r}")
        if name in self.named:
            raise ValueError(f"CausalLM.add_adapter: an adapter named {name!r} is loaded "
                             f"already; remove_adapter({name!r}) first")
        shapes = self.model.frozen.linears
        for module, layer in layers.items():
            if module not in shapes:
                raise ValueError(f"CausalLM.add_adapter: {name!r} adapts {module}, which is "
                                 f"not a decoder Linear of the model")
            w, _ = shapes[module]
            if (layer.in_dim, layer.out_dim) != (w.shape[1], w.shape[0]):
                raise ValueError(f"CausalLM.add_adapter: {name!r}'s {module} is A "
                                 f"{list(layer.a.shape)}, B {list(layer.b.shape)}; the module "
                                 f"is {w.shape[1]} -> {w.shape[0]}")
        self._drop(name)
        self.named[name] = dict(layers)

    def remove(self, name: str) -> None:
        if name not in self.named:
            raise ValueError(f"CausalLM.remove_adapter: no adapter named {name!r}; loaded: "
                             f"{sorted(self.named)}")
        self._drop(name)
        del self.named[name]

    def _drop(self, name: str) -> None:
        for pool in self.pools.values():
            if name in pool.names:
                pool.remove(name)

    def ids(self, adapter_names, batch: int, seq: int) -> dict[str, np.ndarray]:
        """{module: the pool slot of each of the batch * seq rows (-1: none)}
        for ``adapter_names`` (one per sequence), every pool brought up to date."""
        names = list(adapter_names) if not isinstance(adapter_names, str) else None
        if names is None or len(names) != batch:
            raise ValueError(f"adapter_names must name one adapter per sequence ({batch}), "
                             f"got {adapter_names!r}")
        known = set(self.named) | {DEFAULT, BASE}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"adapter_names: {unknown[0]!r} is not loaded; expected one of "
                             f"{sorted(known - {BASE})} or {BASE!r}")
        self._sync()
        out = {}
        for module, pool in self.pools.items():
            slot = [pool.names.get(n, -1) for n in names]
            out[module] = np.repeat(np.array(slot, np.int64), seq)
        return out

    def _sync(self) -> None:
        """Pools for every adapted module, holding every named adapter and the
        model's own as it is now."""
        model = self.model
        wanted = set(model.adapted) | {m for layers in self.named.values() for m in layers}
        for module in sorted(wanted - set(self.pools)):
            w, _ = model.frozen.linears[module]
            self.pools[module] = AdapterPool(model.device, w.shape[1], w.shape[0],
                                             dtype=model.dtype, max_rank=self._max_rank())
            for name, layers in self.named.items():
                if module in layers:
                    self.pools[module].add(layers[module], name)
            self._default_at = -1
        if self._default_at != model.steps:
            pairs = model.adapters()
            for module, (a, b) in pairs.items():
                pool, own = self.pools[module], model.adapted[module].layer
                if DEFAULT in pool.names:
                    pool.remove(DEFAULT)
                pool.add(LoraLayer(a, b, own.alpha, own.use_rslora), DEFAULT)
            self._default_at = model.steps

    def _max_rank(self) -> int:
        """The largest rank of any adapter, rounded up to 16 (the forms' rank blocks)."""
        ranks = [ad.rank for ad in self.model.adapted.values()]
        ranks += [layer.rank for layers in self.named.values() for layer in layers.values()]
        return max(16, -(-max(ranks) // 16) * 16)

    def plans(self, ids: dict[str, np.ndarray]) -> dict:
        """{module: the pool's plan for these rows (kept per row count and
        form), with their route}."""
        out = {}
        for module, slots in ids.items():
            pool = self.pools[module]
            ranks = [pool.rank(s) if s in pool.slots else 0
                     for s in range(len(pool.host_table))]
            options = plan_options(self.model.device, slots, ranks, pool)
            key = (module, slots.size, tuple(sorted(options.items())))
            if key not in self._plans:
                self._plans[key] = pool.forward_plan(slots.size, **options)
            out[module] = self._plans[key].with_ids(slots)
        return out
