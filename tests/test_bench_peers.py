"""The bench's WebGPU peer (lora.apps.bench_peers): ONNX Runtime's WebGPU
execution provider. Without it installed it says how to install it; with it (``pip install
onnxruntime-webgpu onnx``: not dependencies of the package) its f16 products
and LoRA forward match float64 here. Those tests skip where it is not
installed, or where its Dawn opens no device: Dawn turns down the lavapipe of
Mesa 22.3 (Debian 12's: it lacks shaderUniform*ArrayDynamicIndexing); Mesa
25.0's lavapipe works."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from lora.apps import bench_peers

SMALL = ((64, 48, 32, "plain"), (64, 48, 32, "linear"))
# ORT's f16 kernels sum in f16: over 32 products its error here is 1.8e-3 (plain) and
# 8.6e-4 (linear) of the largest value, the LoRA forward's 1.1e-3
TOLERANCE = 2.0**-8


def block_onnxruntime(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError


def test_not_installed_says_how_to_install(monkeypatch):
    block_onnxruntime(monkeypatch)
    why = bench_peers.start()
    assert isinstance(why, str) and "not installed" in why and bench_peers.ORT_INSTALL in why


def test_onnxruntime_without_webgpu_says_how_to_install(monkeypatch):
    """The CPU/CUDA onnxruntime shares the import name: the line says so."""
    cpu_only = types.SimpleNamespace(__version__="1.30.0",
                                     get_available_providers=lambda: ["CPUExecutionProvider"])
    monkeypatch.setitem(sys.modules, "onnxruntime", cpu_only)
    monkeypatch.setitem(sys.modules, "onnx", types.ModuleType("onnx"))
    why = bench_peers.ort_webgpu()
    assert isinstance(why, str) and "no WebGpuExecutionProvider" in why
    assert bench_peers.ORT_INSTALL in why and "PYTHONPATH" in why


@pytest.fixture(scope="module")
def peer():
    """ORT WebGPU, or a skip saying why not."""
    found = bench_peers.start()
    if isinstance(found, str):
        pytest.skip(found if "no device" not in found else
                    f"{found} (on lavapipe: Mesa 22.3's lacks the "
                    f"shaderUniform*ArrayDynamicIndexing Dawn requires; 25.0's works)")
    return found


@pytest.mark.parametrize("layout", ["plain", "linear"])
def test_ort_gemm_matches_float64(peer, layout):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 32)).astype(np.float16)
    b = rng.standard_normal((32, 48)).astype(np.float16)
    row = bench_peers.gemm(peer, a, b, layout)
    assert row["rel_err"] < TOLERANCE and row["right"]
    assert row["us"] > 0 and row["tflops"] > 0


def test_ort_lora_forward_matches_float64(peer):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, 96)).astype(np.float16)
    a = (rng.standard_normal((8, 96)) / np.sqrt(96)).astype(np.float16)
    b = rng.standard_normal((80, 8)).astype(np.float16)
    base = rng.standard_normal((64, 80)).astype(np.float16)
    row = bench_peers.lora_forward(peer, x, a, b, base, 2.0)
    assert row["rel_err"] < TOLERANCE and row["right"] and row["us"] > 0
