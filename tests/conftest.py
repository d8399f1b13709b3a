"""Shared fixtures: the device the GPU tests run on and a naga compile check;
and the test tiers (markers registered in pyproject.toml): tests that use the
``device`` fixture are marked ``gpu`` here; a hypothesis test marked
``examples(quick=N)`` runs twice, as ``[quick]`` (N examples, the default tier)
and as ``[full]`` (its own @settings count, marked ``slow``); of a test marked
``one_per_kind``, the first strategy of each kind stays in the default tier."""
import os
import tempfile

import pytest
from hypothesis import settings

# The LoRA autotuner caches its choices on disk: keep the tests' choices out of
# the user's cache, and fresh for each run.
os.environ["SHADERDSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="shaderdsl-test-cache-")
os.environ.pop("LORA_STRATEGY", None)

# Lavapipe warns unless XDG_RUNTIME_DIR names a private folder.
if not os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")):
    path = os.path.join(tempfile.gettempdir(), f"xdg-runtime-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = path


def device_or_skip(backend=None, **kw):
    """get_device(backend, ...), or a skip naming the adapter when it is listed
    but cannot open a device (the H200's OpenGL adapter: "Parent device is lost")."""
    from shaderdsl.errors import NoAdapterError
    from shaderdsl.runtime import get_device

    try:
        return get_device(backend, **kw)
    except NoAdapterError as e:
        if "cannot open a device" not in str(e):
            raise
        pytest.skip(str(e).splitlines()[0])


@pytest.fixture(scope="session")
def device():
    from shaderdsl.runtime import get_device
    return get_device()


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
def naga(device):
    """Compile a Kernel's WGSL and pipeline on the test device (naga under wgpu-native);
    skips, with the reason, when the adapter lacks a feature the kernel needs."""
    def check(kernel):
        missing = sorted(set(kernel.features) - set(device.features))
        if missing:
            pytest.skip(f"adapter lacks {', '.join(missing)}")
        device.prepare(kernel, overrides={o.name: 1 for o in kernel.overrides if o.default is None})
        return kernel
    return check


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
    """In an examples(quick=N) test's [quick] item, hypothesis runs N examples."""
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
    """seed, three, split, single, tiled, gemm; tiled's quad columns (:q) a kind apart."""
    parts = str(text).split(":")
    return parts[0] + (":q" if parts[-1] == "q" else "")


def _tier(item):
    """(N or None, the test's other parameters) for an examples(quick=N) item, else None."""
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    if "_examples" not in params:
        return None
    return params.pop("_examples"), (item.parent.nodeid, item.originalname, repr(params))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    """Before -m and -k choose: mark gpu the tests that use the device, and
    slow all but the first strategy of each kind in a one_per_kind test. After:
    where both items of an examples(quick=N) test are chosen (a --full run),
    leave out [quick]: [full] checks the same property on more examples."""
    kinds = set()
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)
        if item.get_closest_marker("one_per_kind"):
            params = dict(item.callspec.params)
            kind = (item.parent.nodeid, item.originalname,
                    _strategy_kind(params.pop("strategy")), repr(params))
            if kind in kinds:
                item.add_marker(pytest.mark.slow)
            kinds.add(kind)
    yield
    tiers = {item: _tier(item) for item in items if _tier(item)}
    full = {key for quick, key in tiers.values() if quick is None}
    dropped = [item for item, (quick, key) in tiers.items() if quick is not None and key in full]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]
