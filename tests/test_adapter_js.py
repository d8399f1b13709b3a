"""The page's peft reader (lora/apps/web_assets/adapter.mjs, exported as
lora_adapter.js) in Node: every case of tests/adapter_cases.py reads as in Python,
and no file changes any object but the reader's own result. Skips without ``node``."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from adapter_cases import CASES, RUN_CASES_JS, check_outcome

ADAPTER_JS = Path(__file__).resolve().parents[1] / "lora" / "apps" / "web_assets" / "adapter.mjs"
NODE = shutil.which("node") or ""

pytestmark = pytest.mark.skipif(not NODE, reason="JavaScript tests need node (Node.js 20+) "
                                                     "on PATH")


def node_outcomes(tmp_path: Path) -> dict:
    """RUN_CASES_JS over every case in one Node process."""
    (tmp_path / "cases.json").write_text(json.dumps([c.as_js() for c in CASES]))
    script = tmp_path / "run.mjs"
    script.write_text(f"import * as m from {json.dumps(ADAPTER_JS.as_uri())};\n"
                      f"import {{readFileSync}} from 'node:fs';\n{RUN_CASES_JS}\n"
                      f"const cases = JSON.parse(readFileSync(process.argv[2], 'utf8'));\n"
                      f"console.log(JSON.stringify(run(m, cases)));\n")
    done = subprocess.run([NODE, str(script), str(tmp_path / "cases.json")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_page_reader_passes_the_shared_cases(tmp_path):
    outcomes = node_outcomes(tmp_path)
    assert set(outcomes) == {c.name for c in CASES}
    for case in CASES:
        got = outcomes[case.name]
        check_outcome(case, got, "node")
        if "refused" in got:
            assert got["refused"].startswith("AdapterFileError: "), (case.name, got)
        assert got["changed"] == [] and got["plainObjectA"] is None, (case.name, got)
        assert got["good"], f"a good adapter no longer reads after {case.name}"


def test_the_module_parses():
    done = subprocess.run([NODE, "--check", str(ADAPTER_JS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_page_writes_no_reserved_names(tmp_path):
    """writePeftAdapter refuses a module Python's save_adapter refuses, so every file
    the page writes is one both readers read."""
    script = tmp_path / "write.mjs"
    script.write_text(f"import * as m from {json.dumps(ADAPTER_JS.as_uri())};\n"
                      "const layer = {a: new Float32Array(2), b: new Float32Array(2), rank: 1,\n"
                      "               inDim: 2, outDim: 2};\n"
                      "try { m.writePeftAdapter({'model.constructor': layer}, {alpha: 1});\n"
                      "      console.log('written'); }\n"
                      "catch (e) { console.log(`${e.name}: ${e.message}`); }\n")
    done = subprocess.run([NODE, str(script)], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("AdapterFileError: key base_model.model.model.constructor."
                                  "lora_A.weight holds the name 'constructor'"), done
