"""Shared fixtures: the device the GPU tests run on and a naga compile check."""
import os
import tempfile

import pytest

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
