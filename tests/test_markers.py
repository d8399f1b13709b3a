"""The markers tests/conftest.py sets by what a test uses (pyproject.toml
lists them): ``interp`` for the tests that run the interpreter however they
reach it, ``gpu`` for those on the wgpu device, and SHADERDSL_DEVICE=interp
moving the ``device`` fixture's tests from one to the other."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collected(*args: str, device: str | None = None) -> set[str]:
    """The test ids ``pytest --collect-only`` chooses with ``args``."""
    env = {k: v for k, v in os.environ.items() if k != "SHADERDSL_DEVICE"}
    if device is not None:
        env["SHADERDSL_DEVICE"] = device
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode in (0, 5), r.stdout + r.stderr   # 5: none chosen
    return {line for line in r.stdout.splitlines() if "::" in line}


def test_interp_marks_every_way_of_running_the_interpreter():
    files = ("tests/test_matmul.py", "tests/test_packed.py", "tests/test_shaped.py")
    interp = collected("-m", "interp", *files)
    assert {
        "tests/test_matmul.py::test_the_example_in_the_interpreter",  # helpers.h200_interp()
        "tests/test_packed.py::test_int8_matmul_in_the_interpreter_is_exact",  # a file's function
        "tests/test_shaped.py::test_sizes_from_an_override_and_a_uniform",  # interp.run
        "tests/test_shaped.py::test_the_interpreter_checks_each_axis",
    } <= interp
    gpu = collected("-m", "gpu", *files)
    assert "tests/test_matmul.py::test_the_example_on_the_gpu" in gpu - interp
    assert "tests/test_matmul.py::test_matrix_depth_must_be_a_multiple_of_16" not in interp | gpu


def test_shaderdsl_device_interp_moves_device_tests_to_the_interpreter():
    on_gpu = collected("-m", "gpu", "tests/test_lora_interp.py", "tests/test_uniform_ring.py")
    assert on_gpu and not collected("-m", "gpu", "tests/test_uniform_ring.py", device="interp")
    assert on_gpu <= collected("-m", "interp", "tests/test_uniform_ring.py", device="interp")
    assert collected("-m", "interp", "tests/test_lora_interp.py") == \
        collected("-m", "interp", "tests/test_lora_interp.py", device="interp")


def test_an_unknown_shaderdsl_device_is_refused():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "tests/test_markers.py"],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "SHADERDSL_DEVICE": "cuda"})
    assert r.returncode != 0
    assert "SHADERDSL_DEVICE must be one of ('wgpu', 'interp'), got 'cuda'" in r.stdout + r.stderr
