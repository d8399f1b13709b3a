"""Every kernel the project generates, validated by both WGSL compilers.

naga (wgpu-native) compiles the grid of tests/tint_check.py in this process,
on the test device. Tint (Dawn, package ``wgpudawn``) compiles the same grid
in a subprocess running tests/tint_check.py on Dawn's Null backend: Dawn and
wgpu-native cannot both be ``wgpu`` in one process, and the Null backend
needs no GPU. The subprocess starts first, so it builds and compiles while
this process does the same for naga. The counts are printed at the end of
the run ("kernels validated by naga: N, by Tint: N").

The default tier validates the grid's sample (tint_check.PARTS: every kernel
function with its first entry); --full adds the rest, so the two together
are the whole grid, each compiled once.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shaderdsl.types import SUBGROUP_MATRIX_FEATURE

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "tint_check.py"
TIMEOUT_S = 300


def _load_tint_check():
    spec = importlib.util.spec_from_file_location("tint_check", SCRIPT)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {SCRIPT} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tint_check = _load_tint_check()

RESULTS: dict = {}  # compiler -> [report of each part] (or why it did not run), for the summary


class _Summary:
    """Writes the counts into pytest's terminal summary."""

    def pytest_terminal_summary(self, terminalreporter):
        if not RESULTS:
            return
        terminalreporter.write_sep("-", "WGSL validation (tests/test_tint.py)")
        parts = []
        for compiler in ("naga", "Tint"):
            reports = RESULTS.get(compiler, "not run")
            if isinstance(reports, str):
                parts.append(f"by {compiler}: {reports}")
                continue
            checked, expected, module_only, failures = (
                sum(r[key] if isinstance(r[key], int) else len(r[key]) for r in reports)
                for key in ("checked", "expected", "module_only", "failures"))
            text = f"by {compiler}: {checked} of {expected} on {reports[0]['device']}"
            if module_only:
                text += f", {module_only} of them as modules only (over the device's limits)"
            if failures:
                text += f", {failures} REJECTED"
            parts.append(text)
        terminalreporter.write_line("kernels validated " + "; ".join(parts))


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    manager = request.config.pluginmanager
    if not manager.has_plugin("shaderdsl-wgsl-validation"):
        manager.register(_Summary(), "shaderdsl-wgsl-validation")


class _TintJob:
    """tests/tint_check.py running under Dawn in a subprocess."""

    def __init__(self, folder: Path, part: str):
        self.report_path = folder / "report.json"
        self.stdout = open(folder / "stdout.txt", "w+")
        self.stderr = open(folder / "stderr.txt", "w+")
        env = dict(os.environ, SHADERDSL_WGPU="dawn", WGPU_BACKEND_TYPE="Null")
        # SHADERDSL_BACKEND and SHADERDSL_ADAPTER would filter out the Null adapter, and
        # Dawn uses Null only where it lists no other: VK_ICD_FILENAMES naming a driver
        # Dawn takes (SwiftShader, which lacks shader-f16) would be used instead
        for name in ("SHADERDSL_BACKEND", "SHADERDSL_ADAPTER", "VK_ICD_FILENAMES"):
            env.pop(name, None)
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), "--json", str(self.report_path),
                                      "--part", part],
                                     cwd=HERE.parent, env=env, stdout=self.stdout,
                                     stderr=self.stderr)

    def result(self) -> dict:
        try:
            self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"tests/tint_check.py took over {TIMEOUT_S} s")
        if not self.report_path.exists():
            self.stderr.seek(0)
            pytest.fail(f"tests/tint_check.py exited with status {self.proc.returncode} and no "
                        f"report; its stderr ends:\n{self.stderr.read()[-4000:]}")
        return json.loads(self.report_path.read_text())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stdout.close()
        self.stderr.close()


PART = [pytest.param("sample"), pytest.param("rest", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def grid_parts(tmp_path_factory):
    """part -> (its Tint check, or None without wgpudawn; its entries). The Tint
    check of a part starts before this process builds that part for naga, so
    the two run side by side."""
    found: dict = {}

    def part_of(part):
        if part not in found:
            job = None
            if importlib.util.find_spec("wgpudawn") is not None:
                job = _TintJob(tmp_path_factory.mktemp(f"tint-{part}"), part)
            found[part] = (job, tint_check.grid(part))
        return found[part]

    yield part_of
    for job, _ in found.values():
        if job is not None:
            job.close()


def _describe(items, key="error", limit=20) -> str:
    lines = [f"{i['group']} {i['name']} {i['params']}:\n    {i[key]}" for i in items[:limit]]
    if len(items) > limit:
        lines.append(f"... and {len(items) - limit} more")
    return "\n".join(lines)


def test_grid_has_every_kernel_function():
    """A new LoRA kernel factory or example kernel must join the grid."""
    import examples
    from lora import kernels as K

    groups = {}
    for e in tint_check.entries():
        groups.setdefault(e.group, set()).add(e.name)
    # the other matrix-unit kernels: tests/test_many.py and tests/test_attention.py check
    # them on the interpreter; the engine's (lora.kernels.matrix) are in the grid (Tint's)
    lora_kernels = {name for name, spec in K.KERNELS.items() if spec.function.__module__
                    not in ("lora.kernels.many_matrix", "lora.kernels.attention_matrix",
                            "lora.kernels.attention_matrix_grad")}
    assert lora_kernels <= groups["lora"], f"missing from the grid: {lora_kernels - groups['lora']}"
    found = set()
    for path in sorted(Path(examples.__file__).parent.glob("*.py")):
        module = importlib.import_module(f"examples.{path.stem}")
        for name, fn in vars(module).items():
            if (inspect.isfunction(fn) and fn.__module__ == module.__name__ and name[0] != "_"
                    and list(inspect.signature(fn).parameters)[:1] == ["m"]):
                found.add(f"{module.__name__}.{name}")
    # needs Dawn's chromium_experimental_subgroup_matrix, which no validator here enables
    # (Tint's Null backend refuses the `enable`); tests/test_matmul.py and
    # tests/test_subgroup_matrix.py check them, and compile them where Dawn offers it
    found -= {"examples.subgroup_matmul.tiled_matmul"}
    assert found and found <= groups["examples"], \
        f"missing from the grid: {found - groups['examples']}"
    assert groups["codegen"] and groups["constructs"] and groups["engine"] == {"gemm"}


@pytest.mark.parametrize("part", PART)
def test_naga_validates_every_kernel(device, grid_parts, part):
    from shaderdsl.runtime import COMPILER

    if COMPILER != "naga":
        RESULTS["naga"] = "not run (the suite runs under Dawn)"
        pytest.skip("the suite runs under Dawn (SHADERDSL_WGPU=dawn): no naga in this process")
    _, entries = grid_parts(part)
    # wgpu-native has no subgroup matrices: the engine's kernels are Tint's alone
    entries = [e for e in entries if SUBGROUP_MATRIX_FEATURE not in e.kernel.features]
    report = tint_check.check(device, entries)
    RESULTS.setdefault("naga", []).append(report)
    print(f"kernels validated by naga: {report['checked']} of {report['expected']} "
          f"on {report['device']} in {report['seconds']} s")
    assert report["control_rejected"], "naga accepted a kernel with a type error"
    assert not report["failures"], "naga rejected:\n" + _describe(report["failures"])
    if report["unsupported"]:
        pytest.skip(f"naga validated {report['checked']} of {report['expected']}; the adapter "
                    f"lacks features for:\n" + _describe(report["unsupported"]))
    assert report["checked"] == len(entries)


@pytest.mark.parametrize("part", PART)
def test_tint_validates_every_kernel(grid_parts, part):
    tint_job, entries = grid_parts(part)
    if tint_job is None:
        RESULTS["Tint"] = "not run (wgpudawn not installed)"
        pytest.skip("wgpudawn not installed")
    report = tint_job.result()
    RESULTS.setdefault("Tint", []).append(report)
    print(f"kernels validated by Tint: {report['checked']} of {report['expected']} "
          f"on {report['device']} in {report['seconds']} s; "
          f"{len(report['module_only'])} as modules only:\n"
          + _describe(report["module_only"], "reason", limit=5))
    assert report["compiler"] == "tint"
    assert report["digest"] == tint_check.digest(entries), \
        "the subprocess built other kernels than this process"
    assert report["control_rejected"], "Tint accepted a kernel with a type error"
    assert not report["failures"], "Tint rejected:\n" + _describe(report["failures"])
    assert not report["unsupported"], "not compiled:\n" + _describe(report["unsupported"])
    assert report["checked"] == report["expected"] == len(entries)
