"""Which wgpu build the runtime uses: wgpu-native (naga) or Dawn (Tint).

``SHADERDSL_WGPU=dawn`` selects the Dawn build (package ``wgpudawn``, same
API); it must be installed as ``wgpu`` before anything imports wgpu, so this
module is the first thing the runtime imports.
"""
from __future__ import annotations

import os
import sys

from ..errors import NoAdapterError

WGPU_BUILD = os.environ.get("SHADERDSL_WGPU", "native").strip().lower() or "native"

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
elif WGPU_BUILD != "native":
    raise NoAdapterError(f"SHADERDSL_WGPU={WGPU_BUILD!r}: expected 'native' or 'dawn'")

# The WGSL compiler inside the chosen build; Kernel.wgsl_for adapts the text to it.
COMPILER = "tint" if WGPU_BUILD == "dawn" else "naga"
