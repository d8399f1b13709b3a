"""Shared fixtures and the test tiers (markers registered in pyproject.toml).

Devices: ``device`` is the one the GPU tests run on: wgpu's, or with
``SHADERDSL_DEVICE=interp`` an interpreter device (the same host API) with
wgpu's limits, so the suite runs under its race and uninitialised-read checks;
a test marked ``needs_wgpu(reason)`` then skips with that reason.
``wgpu_device`` is always wgpu's (naga's compile checks run on it).

Markers set here, by what a test uses: ``gpu`` where it uses ``wgpu_device``,
or ``device`` on wgpu; ``interp`` where it uses an interpreter device: the
``device`` fixture under SHADERDSL_DEVICE=interp, or ``shaderdsl.interp`` named
in its code, a fixture's, or a function of tests/ that it calls. A hypothesis
test marked ``examples(quick=N)`` runs twice, as ``[quick]`` (N examples, the
default tier) and as ``[full]`` (its own @settings count, marked ``slow``); of a
test marked ``one_per_kind``, the first strategy of each kind stays in the
default tier."""
import dis
import gc
import inspect
import os
import tempfile
from pathlib import Path

import pytest
import time_budget
from hypothesis import HealthCheck, settings

# Python's cyclic collector ran a full collection over the heap of cached kernels and
# expression trees every few thousand allocations: 15-23 % of the time of test_strategies,
# test_many and test_matmul in one process (WORKERS=0), no change seen with 2 workers
# (optimisation note 58). Collect far less often.
gc.set_threshold(50_000, 20, 100)

# The LoRA autotuner caches its choices on disk: keep the tests' choices out of
# the user's cache, and fresh for each run.
os.environ["SHADERDSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="shaderdsl-test-cache-")
os.environ.pop("LORA_STRATEGY", None)

# Lavapipe warns unless XDG_RUNTIME_DIR names a private folder.
if not os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")):
    path = os.path.join(tempfile.gettempdir(), f"xdg-runtime-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = path

# What every hypothesis test here needs (loaded before the test modules are
# imported, so their @settings inherit it): no deadline (a first dispatch
# compiles, for seconds on lavapipe) and no health check for slow or big draws.
settings.register_profile("shaderdsl", deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("shaderdsl")

DEVICES = ("wgpu", "interp")
DEVICE = os.environ.get("SHADERDSL_DEVICE", "wgpu")
if DEVICE not in DEVICES:
    raise ValueError(f"SHADERDSL_DEVICE must be one of {DEVICES}, got {DEVICE!r}")
TESTS = Path(__file__).resolve().parent
INTERP = "shaderdsl.interp"


def pytest_configure(config):
    """The default tier's time budget: a test not marked slow over 10 s fails the
    run (tests/time_budget.py)."""
    time_budget.register(config)


@pytest.fixture(scope="session")
def wgpu_device():
    """The wgpu device (SHADERDSL_BACKEND, SHADERDSL_ADAPTER and SHADERDSL_WGPU choose it)."""
    from shaderdsl.runtime import get_device
    return get_device()


@pytest.fixture(scope="session")
def interp_device():
    """An interpreter device with subgroups of 8, as lavapipe's (CI's GPU)."""
    from shaderdsl import interp
    return interp.Device(subgroup_size=8)


@pytest.fixture(scope="session")
def device(request):
    """The device the GPU tests run on: ``wgpu_device``, or with
    SHADERDSL_DEVICE=interp an interpreter device with its limits (so it
    refuses what the GPU would, and the tests size their work as for it)."""
    gpu = request.getfixturevalue("wgpu_device")
    if DEVICE == "wgpu":
        return gpu
    from shaderdsl import interp
    return interp.Device(subgroup_size=8, limits=gpu.limits)


@pytest.fixture(scope="session")
def sub_ok(device):
    """Whether the test device has the 'subgroup' feature."""
    return device.has_feature("subgroup")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty LoRA tuning cache and no forced strategy."""
    monkeypatch.setenv("SHADERDSL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LORA_STRATEGY", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def naga(wgpu_device):
    """Compile a Kernel's WGSL and pipeline with naga (under wgpu-native, or Tint
    under Dawn); skips, with the reason, when the adapter lacks a feature the kernel needs."""
    def check(kernel):
        missing = sorted(set(kernel.features) - set(wgpu_device.features))
        if missing:
            pytest.skip(f"adapter lacks {', '.join(missing)}")
        wgpu_device.prepare(kernel, overrides={o.name: 1 for o in kernel.overrides
                                               if o.default is None})
        return kernel
    return check


class _Watched(dict):
    """shaderdsl.runtime's device table, noting whether get_device read it."""
    touched = False

    def get(self, key, default=None):
        self.touched = True
        return super().get(key, default)


@pytest.fixture(autouse=True)
def _interp_only(request, monkeypatch):
    """A test marked interp and not gpu runs on the interpreter alone: CI's OpenGL
    pass leaves those out, since they run the same whatever wgpu's backend. One that
    reaches the wgpu device (get_device, directly or through a default device=None)
    fails, so that none is left out that the backend could change."""
    node = request.node
    if node.get_closest_marker("interp") is None or node.get_closest_marker("gpu") is not None:
        yield
        return
    from shaderdsl.runtime import device as runtime_device
    watched = _Watched(runtime_device._devices)
    monkeypatch.setattr(runtime_device, "_devices", watched)
    yield
    assert not watched.touched, (
        f"{node.nodeid} is marked interp and not gpu, and reached the wgpu device "
        f"(shaderdsl.runtime.get_device): take the device or wgpu_device fixture, which "
        f"marks it gpu, so that the OpenGL pass of CI (-m 'not (interp and not gpu)') runs it")


# ---------------------------------------------------------------- tiers

def pytest_generate_tests(metafunc):
    """examples(quick=N): a [quick] item of N hypothesis examples and a [full] one, slow."""
    mark = metafunc.definition.get_closest_marker("examples")
    if mark is not None:
        quick = mark.kwargs.get("quick", mark.args[0] if mark.args else None)
        assert isinstance(quick, int) and quick > 0, "examples(quick=N) takes a count"
        metafunc.parametrize("_examples", [pytest.param(quick, id="quick"),
                                           pytest.param(None, id="full", marks=pytest.mark.slow)],
                             indirect=True)


@pytest.fixture(autouse=True)
def _examples(request):
    """In an examples(quick=N) test's [quick] item, hypothesis runs N examples.

    Not a profile: hypothesis copies a profile's values into a test's settings
    when the test is decorated, so a profile cannot lower one test's count per
    item, and the public ``settings(...)(test)`` refuses a test that already has
    @settings. The settings given holds at call time is set for this item and
    put back after it."""
    quick = getattr(request, "param", None)
    if quick is None:
        yield
        return
    fn = getattr(request.function, "__func__", request.function)
    full = fn._hypothesis_internal_use_settings   # what @settings gave the test
    fn._hypothesis_internal_use_settings = settings(full, max_examples=quick)
    try:
        yield
    finally:
        fn._hypothesis_internal_use_settings = full


def _strategy_kind(text):
    """The strategy's name (seed, three, split, single, tiled, gemm, matrix);
    tiled's quad columns (:q) a kind apart."""
    parts = str(text).split(":")
    return parts[0] + (":q" if parts[-1] == "q" else "")


def _tier(item):
    """(N or None, the test's other parameters) for an examples(quick=N) item, else None."""
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    if "_examples" not in params:
        return None
    return params.pop("_examples"), (item.parent.nodeid, item.originalname, repr(params))


_CODE_NAMES: dict = {}  # code object -> _code_names: a helper is read once, not once per test


def _code_names(fn) -> tuple[set[str], set[str]]:
    """The global and attribute names in ``fn``'s code and in its nested
    functions', and the modules they import (``from shaderdsl import interp``:
    shaderdsl.interp)."""
    found = _CODE_NAMES.get(fn.__code__)
    if found is None:
        found = _CODE_NAMES[fn.__code__] = _read_code(fn.__code__)
    return found


def _read_code(top) -> tuple[set[str], set[str]]:
    names, modules, codes = set(), set(), [top]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
        package = ""
        for ins in dis.get_instructions(code):
            if ins.opname == "IMPORT_NAME":
                package = ins.argval
                modules.add(package)
            elif ins.opname == "IMPORT_FROM":
                modules.add(f"{package}.{ins.argval}")
    return names, modules


def _from_interp(obj) -> bool:
    """Whether ``obj`` is shaderdsl.interp, or a class, function or object of it."""
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    if not isinstance(module, str):
        module = type(obj).__module__
    return module == INTERP or module.startswith(INTERP + ".")


def _names_interp(fn, seen: set) -> bool:
    """Whether ``fn`` (a test, fixture or function in tests/) names the
    interpreter, itself or through a function of tests/ that it names."""
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)   # under @given
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen or not code.co_filename.startswith(str(TESTS)):
        return False
    seen.add(code)
    names, modules = _code_names(fn)
    if any(m == INTERP or m.startswith(INTERP + ".") for m in modules):
        return True
    for name in names:
        obj = fn.__globals__.get(name)
        if obj is not None and (_from_interp(obj) or inspect.isfunction(obj)
                                and _names_interp(obj, seen)):
            return True
    return False


def _uses_interp(item) -> bool:
    """Whether a test item runs on an interpreter: its code, or that of a
    fixture it uses (but ``device``: SHADERDSL_DEVICE decides), names it."""
    seen: set = set()
    if DEVICE == "interp" and "device" in item.fixturenames:
        return True
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    fixtures = [d[-1].func for name, d in defs.items() if d and name != "device"]
    return any(_names_interp(fn, seen) for fn in [getattr(item, "function", None)] + fixtures
               if fn is not None)


def _device_marks(item):
    """Mark gpu and interp by what the test uses; under SHADERDSL_DEVICE=interp,
    skip a test marked needs_wgpu, with its reason."""
    names = getattr(item, "fixturenames", ())
    if "wgpu_device" in names or DEVICE == "wgpu" and "device" in names:
        item.add_marker(pytest.mark.gpu)
    if _uses_interp(item):
        item.add_marker(pytest.mark.interp)
    need = item.get_closest_marker("needs_wgpu")
    if need is not None and DEVICE == "interp":
        reason = need.args[0] if need.args else need.kwargs["reason"]
        item.add_marker(pytest.mark.skip(reason=f"SHADERDSL_DEVICE=interp: {reason}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    """Before -m and -k choose: mark gpu and interp the tests that use those
    devices (_device_marks), and slow all but the first strategy of each kind in
    a one_per_kind test. After: where both items of an examples(quick=N) test
    are chosen (a --full run), leave out [quick]: [full] checks the same
    property on more examples."""
    kinds = set()
    for item in items:
        _device_marks(item)
        if item.get_closest_marker("one_per_kind"):
            params = dict(item.callspec.params)
            kind = (item.parent.nodeid, item.originalname,
                    _strategy_kind(params.pop("strategy")), repr(params))
            if kind in kinds:
                item.add_marker(pytest.mark.slow)
            kinds.add(kind)
    yield
    tiers = {item: tier for item in items if (tier := _tier(item)) is not None}
    full = {key for quick, key in tiers.values() if quick is None}
    dropped = [item for item, (quick, key) in tiers.items() if quick is not None and key in full]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]
