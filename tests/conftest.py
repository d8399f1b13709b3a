"""Shared fixtures: the device the GPU tests run on and a naga compile check."""
import os
import tempfile

import pytest

# Lavapipe warns unless XDG_RUNTIME_DIR names a private folder.
if not os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")):
    path = os.path.join(tempfile.gettempdir(), f"xdg-runtime-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = path


@pytest.fixture(scope="session")
def device():
    from shaderdsl.runtime import get_device
    return get_device()


@pytest.fixture(scope="session")
def naga():
    """Compile a Kernel's WGSL with naga (wgpu-native), pipeline included."""
    import wgpu
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    feats = [f for f in ("shader-f16", "subgroup") if f in adapter.features]
    dev = adapter.request_device_sync(required_features=feats)

    def check(kernel):
        missing = set(kernel.features) - set(feats)
        if missing:
            pytest.skip(f"adapter lacks {sorted(missing)}")
        module = dev.create_shader_module(code=kernel.wgsl)
        constants = {o.name: 1 for o in kernel.overrides if o.default is None}
        dev.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main",
                                                            "constants": constants})
        return kernel
    return check
