"""Which wgpu build the runtime uses: wgpu-native (naga) or Dawn (Tint).

``SHADERDSL_WGPU=dawn`` selects the Dawn build (package ``wgpudawn``, same
API); it must be installed as ``wgpu`` before anything imports wgpu, so this
module is the first thing the runtime imports. It also gives Dawn its
toggles, which must be set before the first adapter request
(``SHADERDSL_DAWN_TOGGLES``, a comma-separated list; default
:data:`DAWN_TOGGLES`; empty for none):

- ``allow_unsafe_apis``: Dawn's experimental features, among them
  ``chromium-experimental-subgroup-matrix`` (matrix units: tensor cores);
- ``vulkan_enable_f16_on_nvidia``: ``shader-f16`` on NVIDIA under Vulkan,
  which Dawn turns off by default there (crbug.com/42251215, a driver bug
  with f16 in some shaders; ONNX Runtime's WebGPU backend sets this toggle
  too). Without it the H200 has no shader-f16 and no f16 subgroup matrices;
- ``enable_integer_range_analysis_in_robustness``: Tint drops the bounds
  clamp of an index it can prove in range (on by default in Chrome since
  141), so Python runs what a browser would.
"""
from __future__ import annotations

import os
import sys

from ..errors import NoAdapterError

WGPU_BUILD = os.environ.get("SHADERDSL_WGPU", "native").strip().lower() or "native"
DAWN_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia",
                "enable_integer_range_analysis_in_robustness")  # see the docstring

if WGPU_BUILD == "dawn":
    if "wgpu" in sys.modules and "wgpudawn" not in sys.modules:
        raise NoAdapterError("SHADERDSL_WGPU=dawn, but wgpu-native was imported before "
                             "shaderdsl.runtime; import shaderdsl.runtime first")
    try:
        import wgpudawn
    except ImportError:
        raise NoAdapterError("SHADERDSL_WGPU=dawn needs the package wgpudawn "
                             "(pip install wgpudawn)") from None
    wgpudawn.install_as_wgpu()
    from wgpudawn.backends.dawn import extras as _dawn_extras

    _toggles = os.environ.get("SHADERDSL_DAWN_TOGGLES", ",".join(DAWN_TOGGLES))
    DAWN_TOGGLES = tuple(t.strip() for t in _toggles.split(",") if t.strip())
    try:
        _dawn_extras.set_instance_extras(enable_toggles=DAWN_TOGGLES)
    except ValueError as e:  # an unknown toggle name
        raise NoAdapterError(f"SHADERDSL_DAWN_TOGGLES={_toggles!r}: {e}") from None
elif WGPU_BUILD != "native":
    raise NoAdapterError(f"SHADERDSL_WGPU={WGPU_BUILD!r}: expected 'native' or 'dawn'")

# The WGSL compiler inside the chosen build; Kernel.wgsl_for adapts the text to it.
COMPILER = "tint" if WGPU_BUILD == "dawn" else "naga"
