"""The one cache of plans: each kept on its weight (``weight.plans``, so it
goes when the weight goes) or, for work without a weight, per device.

A key names the work and, for calls checked once per combination of
buffers, their ids; a hit whose buffers were released since is built again
(so the builder's check raises its message). Plans are built holding the
device's lock, so two threads never build one key twice."""
from __future__ import annotations

import contextlib
import sys
import weakref

from .weight import Weight

_DEVICE_PLANS: dict = {}  # device -> {key: plan} for work without a weight (add_scaled)
_WEIGHTS: "weakref.WeakSet" = weakref.WeakSet()  # weights whose ``plans`` hold something
LIMIT = 256  # plans kept per weight (or device) before starting afresh


def _table(owner) -> dict | None:
    """Where plans are kept: the weight's ``plans``, or per device."""
    if isinstance(owner, Weight):
        return owner.plans
    return _DEVICE_PLANS.setdefault(owner, {}) if hasattr(owner, "dispatch") else None


def _forget(table: dict) -> None:
    """Empty one table, freeing the scratch buffers of its plans now."""
    for plan in table.values():
        plan.release()
    table.clear()


def _lock(owner):
    """The lock of the device ``owner`` builds on (a context that does nothing without one)."""
    device = owner.device if isinstance(owner, Weight) else owner
    return getattr(device, "lock", None) or contextlib.nullcontext()


def get_or_build(owner, key, build, buffers=()):
    """The plan ``build()`` made for ``key`` under ``owner`` (a Weight or a
    device); built again when one of ``buffers`` was released since."""
    with _lock(owner):
        return _get_or_build(owner, key, build, buffers)


def _get_or_build(owner, key, build, buffers):
    table = _table(owner)
    try:
        hit = table.get(key) if table is not None else None
    except TypeError:  # an unhashable argument: let build() explain
        return build()
    if hit is not None and not any(b is not None and b.released for b in buffers):
        return hit
    if table is not None and len(table) >= LIMIT:
        _forget(table)  # before build(): it may return a plan of this table (under another key)
    plan = build()
    if table is not None:
        table[key] = plan
        if isinstance(owner, Weight):
            _WEIGHTS.add(owner)
    return plan


def ids(*bufs) -> tuple:
    """The buffers' ids, for a key checked once per combination of buffers."""
    return tuple([getattr(b, "id", None) for b in bufs])


def clear_plan_cache(weight: Weight | None = None) -> None:
    """Forget the plans of ``weight``, freeing their scratch buffers; kernels
    stay compiled. With no weight: the plans of every weight and device, and
    every device's compiled pipelines too (a plan still held compiles its
    kernels again at its next run), so memory grown by many shapes comes back."""
    tables = [weight.plans] if weight is not None else \
        [w.plans for w in list(_WEIGHTS)] + list(_DEVICE_PLANS.values())
    for table in tables:
        _forget(table)
    pipelines = sys.modules.get("shaderdsl.runtime.pipelines")  # absent: no GPU device made
    if weight is None and pipelines is not None:
        pipelines.clear_pipeline_caches()
