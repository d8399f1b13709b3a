"""Compile WGSL texts with Tint (Dawn's Null backend, no GPU): for each text of
the JSON list in argv[1], "ok" or Tint's first error line, as a JSON list in
argv[2]. tests/test_uniformity.py runs it in a subprocess (Dawn and
wgpu-native cannot both be ``wgpu`` in one process)."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("SHADERDSL_WGPU", "dawn")
os.environ.setdefault("WGPU_BACKEND_TYPE", "Null")

from shaderdsl.runtime import get_device  # noqa: E402


def verdict(device, code: str) -> str:
    try:
        device.wgpu_device.create_shader_module(code=code)
    except Exception as e:  # wgpu's GPUValidationError, with Tint's text
        text = str(e)
        at = text.find("error:")
        return text[at:].splitlines()[0] if at >= 0 else text.splitlines()[0]
    return "ok"


def main() -> None:
    device = get_device()
    texts = json.loads(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as f:
        json.dump([verdict(device, t) for t in texts], f)


if __name__ == "__main__":
    main()
