"""The bench's WebGPU peer (lora.apps.bench_peers): ONNX Runtime's WebGPU
execution provider beside ``bench --gemm``'s rows. Without it installed the
bench says once how to install it and goes on; with it (``pip install
onnxruntime-webgpu onnx``: not dependencies of the package) its f16 products
and LoRA forward match float64 here. Those tests skip where it is not
installed, or where its Dawn opens no device: Dawn turns down the lavapipe of
Mesa 22.3 (Debian 12's: it lacks shaderUniform*ArrayDynamicIndexing); Mesa
25.0's lavapipe works."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
from helpers import h200_interp

from lora.apps import bench_gemm, bench_peers

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


def gemm_run(monkeypatch, tmp_path):
    """``bench --gemm`` at SMALL on the interpreter as the H200 (lavapipe has no
    matrix units), none of our tilings timed (tests/test_bench.py runs one in
    the interpreter: seconds): its lines and JSON."""
    monkeypatch.setattr(bench_gemm, "variants", lambda *a, **kw: [])
    monkeypatch.setattr(bench_gemm, "get_device", h200_interp)
    lines: list[str] = []
    assert bench_gemm.gemm_main(str(tmp_path), SMALL, lambda *a, **kw: lines.append(
        " ".join(map(str, a)))) == 0
    return lines, json.loads(next(tmp_path.glob("gemm-*.json")).read_text())


def test_gemm_bench_goes_on_without_ort(monkeypatch, tmp_path):
    """The reason and the install line once per run, tinygrad's line once, a row
    for every shape, the JSON's rows saying why ORT has none."""
    block_onnxruntime(monkeypatch)
    lines, result = gemm_run(monkeypatch, tmp_path)
    said = [line for line in lines if bench_peers.ORT_INSTALL in line]
    assert len(said) == 1 and "not installed" in said[0]
    assert lines.count(bench_peers.TINYGRAD_WHY) == 1
    assert not any("ORT WebGPU fp16" in line for line in lines)
    assert [r["layout"] for r in result["rows"]] == ["plain", "linear"]
    for row in result["rows"]:
        assert row["ort_webgpu"] == {"why": said[0]}
    assert result["peers"]["ort_webgpu"] == said[0]


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


def test_gemm_bench_with_ort(peer, monkeypatch, tmp_path):
    """Each shape's ORT line after its own, the JSON's rows with ORT's time and error."""
    lines, result = gemm_run(monkeypatch, tmp_path)
    ort_lines = [line for line in lines if "ORT WebGPU fp16:" in line]
    assert [line.split(" ORT")[0] for line in ort_lines] == ["64x48x32 plain", "64x48x32 linear"]
    assert not any("WRONG" in line for line in ort_lines)
    assert result["peers"]["ort_webgpu"] == peer.ort.__version__
    for row in result["rows"]:
        assert row["ort_webgpu"]["right"] and row["ort_webgpu"]["us"] > 0
