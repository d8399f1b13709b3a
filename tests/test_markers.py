"""The markers tests/conftest.py sets by what a test uses (pyproject.toml
lists them): ``interp`` for the tests that run the interpreter however they
reach it, ``gpu`` for those on the wgpu device, and SHADERDSL_DEVICE=interp
moving the ``device`` fixture's tests from one to the other."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


FILES = ("tests/test_matmul.py", "tests/test_packed.py", "tests/test_shaped.py",
         "tests/test_lora_interp.py", "tests/test_uniform_ring.py")
# Loaded into the collecting pytest (-p): each test's id and its device markers, once
# conftest has set them (pytest_collection_finish comes after pytest_collection_modifyitems).
MARKS_PLUGIN = """
def pytest_collection_finish(session):
    for item in session.items:
        marks = [m for m in ("gpu", "interp") if item.get_closest_marker(m) is not None]
        print("MARKS", item.nodeid, ",".join(marks), sep="\\t")
"""


@functools.cache
def marks(device: str | None = None) -> dict[str, set[str]]:
    """test id -> its markers among gpu and interp, for the tests of FILES as
    ``pytest --collect-only`` sees them (SHADERDSL_DEVICE=device): one collection."""
    env = {k: v for k, v in os.environ.items() if k != "SHADERDSL_DEVICE"}
    if device is not None:
        env["SHADERDSL_DEVICE"] = device
    plugin = Path(tempfile.mkdtemp(prefix="marks-plugin-"))
    (plugin / "collected_marks.py").write_text(MARKS_PLUGIN)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugin), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-s",
                        "-p", "no:cacheprovider", "-p", "collected_marks", *FILES],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    found = [line.split("\t") for line in r.stdout.splitlines() if line.startswith("MARKS\t")]
    return {test: set(filter(None, names.split(","))) for _, test, names in found}


def chosen(mark: str, *files: str, device: str | None = None) -> set[str]:
    """The tests of ``files`` that ``-m mark`` chooses."""
    return {t for t, m in marks(device).items() if mark in m and t.startswith(files)}


def test_interp_marks_every_way_of_running_the_interpreter():
    files = ("tests/test_matmul.py", "tests/test_packed.py", "tests/test_shaped.py")
    interp = chosen("interp", *files)
    assert {
        "tests/test_matmul.py::test_the_example_in_the_interpreter",  # helpers.h200_interp()
        "tests/test_packed.py::test_int8_matmul_in_the_interpreter_is_exact",  # a file's function
        "tests/test_shaped.py::test_sizes_from_an_override_and_a_uniform",  # interp.run
        "tests/test_shaped.py::test_the_interpreter_checks_each_axis",
    } <= interp
    gpu = chosen("gpu", *files)
    assert "tests/test_matmul.py::test_the_example_on_the_gpu" in gpu - interp
    assert "tests/test_matmul.py::test_matrix_depth_must_be_a_multiple_of_16" not in interp | gpu


def test_shaderdsl_device_interp_moves_device_tests_to_the_interpreter():
    on_gpu = chosen("gpu", "tests/test_lora_interp.py", "tests/test_uniform_ring.py")
    assert on_gpu and not chosen("gpu", "tests/test_uniform_ring.py", device="interp")
    assert on_gpu <= chosen("interp", "tests/test_uniform_ring.py", device="interp")
    assert chosen("interp", "tests/test_lora_interp.py") == \
        chosen("interp", "tests/test_lora_interp.py", device="interp")


def test_an_unknown_shaderdsl_device_is_refused():
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "tests/test_markers.py"],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "SHADERDSL_DEVICE": "cuda"})
    assert r.returncode != 0
    assert "SHADERDSL_DEVICE must be one of ('wgpu', 'interp'), got 'cuda'" in r.stdout + r.stderr


# ---------------------------------------------------------------- the time budget

SLEEPY = """
import time
import pytest

def test_quick():
    pass

def test_sleepy():
    time.sleep(0.6)

@pytest.mark.slow
def test_slow_and_sleepy():
    time.sleep(0.6)
"""


def run_with_budget(tmp_path, budget: str, *args: str) -> subprocess.CompletedProcess:
    """pytest on SLEEPY with tests/time_budget.py as a plugin, SHADERDSL_TEST_BUDGET=budget."""
    (tmp_path / "test_sleepy.py").write_text(SLEEPY)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: long\n")
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SHADERDSL_TEST_BUDGET": budget, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "time_budget", *args, "test_sleepy.py"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


@pytest.mark.parametrize("workers", [  # xdist's two workers start in 5 s of CPU: in --full
    pytest.param([], id="one process"),
    pytest.param(["-n", "2"], id="xdist", marks=pytest.mark.slow)])
def test_a_test_over_the_budget_fails_the_run(tmp_path, workers):
    """Over SHADERDSL_TEST_BUDGET seconds: the run fails naming the test, which
    itself passed; a test marked slow may take longer. Under pytest-xdist the
    controller sums every worker's reports."""
    if workers:
        pytest.importorskip("xdist", reason="pytest-xdist is not installed (test extras)")
    r = run_with_budget(tmp_path, "0.3", *workers)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "3 passed" in out, out
    over = out.split("over the default tier's 0.3 s a test")[1]
    assert "test_sleepy.py::test_sleepy" in over and "test_slow_and_sleepy" not in over, out


def test_a_budget_of_zero_checks_nothing(tmp_path):
    r = run_with_budget(tmp_path, "0")
    assert r.returncode == 0 and "over the default tier" not in r.stdout, r.stdout + r.stderr


def test_the_budget_is_on_where_the_tier_is_measured():
    """10 s on wgpu-native's Vulkan device (lavapipe), 15 s beside the slow tier; off
    on Dawn, OpenGL and the interpreter device unless SHADERDSL_TEST_BUDGET says; a
    bad value is named."""
    from time_budget import budget_seconds
    assert budget_seconds({}) == budget_seconds({"SHADERDSL_BACKEND": "Vulkan"}) == 10.0
    assert budget_seconds({}, beside_slow=True) == 15.0
    assert budget_seconds({"SHADERDSL_TEST_BUDGET": "4"}, beside_slow=True) == 4.0
    assert budget_seconds({"SHADERDSL_WGPU": "dawn"}) == 0.0
    assert budget_seconds({"SHADERDSL_BACKEND": "OpenGL"}) == 0.0
    assert budget_seconds({"SHADERDSL_DEVICE": "interp"}) == 0.0
    assert budget_seconds({"SHADERDSL_WGPU": "dawn", "SHADERDSL_TEST_BUDGET": "30"}) == 30.0
    with pytest.raises(ValueError, match=r"SHADERDSL_TEST_BUDGET must be a number of seconds "
                                         r"\(0: no check\), got 'ten'"):
        budget_seconds({"SHADERDSL_TEST_BUDGET": "ten"})
