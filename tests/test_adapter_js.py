"""The page's peft reader (lora/apps/web_assets/adapter.mjs, exported as
lora_adapter.js) in Node: every case of tests/adapter_cases.py reads as in Python,
and no file changes any object but the reader's own result. Skips without ``node``."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from adapter_cases import CASES, RUN_CASES_JS, check_outcome

from lora.training.adapter_io import CONFIG_NAME, load_adapter, save_adapter

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


# Modules of different ranks and alphas, on names that are dotted suffixes of each other,
# and a name ("7") that a JavaScript object would put first: the patterns' order matters.
MIXED = {"a.q_proj": (2, 1.0), "q_proj": (4, 1.0), "b.q_proj": (2, 1.0),
         "m.a.q_proj": (4, 3.0), "7": (3, 2.5), "x.7": (2, 1e-5)}


def mixed_layers() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    return {m: (rng.standard_normal((r, 3)).astype(np.float32),
                rng.standard_normal((5, r)).astype(np.float32)) for m, (r, _) in MIXED.items()}


def run_node(tmp_path: Path, body: str) -> dict:
    """``body`` (JavaScript using ``m``, the page's adapter module, and ``dir``, tmp_path)
    in Node; what it prints, as JSON."""
    script = tmp_path / "run.mjs"
    script.write_text(f"import * as m from {json.dumps(ADAPTER_JS.as_uri())};\n"
                      f"import {{readFileSync, writeFileSync}} from 'node:fs';\n"
                      f"const dir = {json.dumps(str(tmp_path))};\n{body}\n")
    done = subprocess.run([NODE, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_file_python_writes_with_mixed_ranks_reads_in_the_page(tmp_path):
    """save_adapter writes rank_pattern and alpha_pattern; readPeftAdapter gives every
    module the rank, alpha, scale and values load_adapter gives it."""
    save_adapter(tmp_path, mixed_layers(), alpha={m: a for m, (_, a) in MIXED.items()})
    got = run_node(tmp_path, """
      const {layers} = m.readPeftAdapter(readFileSync(`${dir}/adapter_config.json`, "utf8"),
                                         readFileSync(`${dir}/adapter_model.safetensors`));
      console.log(JSON.stringify(Object.fromEntries(Object.entries(layers).map(([n, l]) =>
        [n, [l.rank, l.inDim, l.outDim, l.alpha, l.scale, Array.from(l.a), Array.from(l.b)]]))));
    """)
    want = load_adapter(tmp_path)
    assert got.keys() == want.keys() == MIXED.keys()
    for module, layer in want.items():
        assert got[module] == [layer.rank, layer.in_dim, layer.out_dim, layer.alpha, layer.scale,
                               layer.a.ravel().tolist(), layer.b.ravel().tolist()], module
        assert (layer.rank, layer.alpha) == MIXED[module]


def test_the_page_writes_the_config_python_writes(tmp_path):
    """writePeftAdapter of the same layers writes save_adapter's config text, byte for
    byte (patterns in peft's order), and load_adapter reads the page's files back."""
    layers = mixed_layers()
    save_adapter(tmp_path / "python", layers, alpha={m: a for m, (_, a) in MIXED.items()})
    page = {m: {"a": a.ravel().tolist(), "b": b.ravel().tolist(), "rank": a.shape[0],
                "inDim": a.shape[1], "outDim": b.shape[0], "alpha": MIXED[m][1]}
            for m, (a, b) in layers.items()}
    (tmp_path / "layers.json").write_text(json.dumps(page))
    (tmp_path / "page").mkdir()
    run_node(tmp_path, """
      const layers = JSON.parse(readFileSync(`${dir}/layers.json`, "utf8"));
      for (const l of Object.values(layers)) { l.a = Float32Array.from(l.a);
                                               l.b = Float32Array.from(l.b); }
      const files = m.writePeftAdapter(layers);
      writeFileSync(`${dir}/page/adapter_config.json`, files.config);
      writeFileSync(`${dir}/page/adapter_model.safetensors`, files.tensors);
      console.log("{}");
    """)
    config = (tmp_path / "page" / CONFIG_NAME).read_text()
    assert config == (tmp_path / "python" / CONFIG_NAME).read_text()
    assert list(json.loads(config)["rank_pattern"]) == [  # r is 2: every name but 7's catches
        "m\\.a\\.q_proj", "a\\.q_proj", "b\\.q_proj", "q_proj", "x\\.7", "7"]
    back = load_adapter(tmp_path / "page")
    for module, (a, b) in layers.items():
        assert (back[module].rank, back[module].alpha) == MIXED[module]
        assert np.array_equal(back[module].a, a) and np.array_equal(back[module].b, b)


def test_an_rslora_adapter_read_in_the_page_is_written_back_rslora(tmp_path):
    """readPeftAdapter's layers of an rslora file (scale alpha / sqrt(r)), written back
    by writePeftAdapter with no options, say use_rslora: true, so peft and load_adapter
    scale them as before (the file said false: every module's scale halved at rank 4).
    A use_rslora the layers' scales contradict, or a scale of neither rule, is refused."""
    rng = np.random.default_rng(3)
    layers = {"fc1": (rng.standard_normal((4, 12)), rng.standard_normal((8, 4))),
              "fc2": (rng.standard_normal((2, 8)), rng.standard_normal((6, 2)))}
    save_adapter(tmp_path / "rs", layers, alpha={"fc1": 8.0, "fc2": 6.0}, use_rslora=True)
    got = run_node(tmp_path, """
      const read = m.readPeftAdapter(readFileSync(`${dir}/rs/adapter_config.json`, "utf8"),
                                     readFileSync(`${dir}/rs/adapter_model.safetensors`));
      const files = m.writePeftAdapter(read.layers);
      writeFileSync(`${dir}/back_config.json`, files.config);
      writeFileSync(`${dir}/back.safetensors`, files.tensors);
      const refused = f => { try { f(); return null; } catch (e) { return e.message; } };
      const fc1 = read.layers.fc1;
      console.log(JSON.stringify([
        refused(() => m.writePeftAdapter(read.layers, {useRslora: false})),
        refused(() => m.writePeftAdapter({fc1: {...fc1, scale: 3}})),
        refused(() => m.writePeftAdapter({fc1: {...fc1, scale: 2}}))]));
    """)
    assert got[0] == ("use_rslora would be false, but module(s) fc1, fc2 have scale alpha / "
                      "sqrt(r) (rslora): peft would scale them otherwise; give {useRslora: true} "
                      "or layers of one rule")
    assert got[1] == ("module fc1: scale 3 is neither alpha / r (2) nor alpha / sqrt(r) (4) for "
                      "alpha 8, r 4; peft would not read it back")
    assert got[2] is None  # alpha / r: a plain adapter
    (tmp_path / "back").mkdir()
    (tmp_path / "back_config.json").rename(tmp_path / "back" / CONFIG_NAME)
    (tmp_path / "back.safetensors").rename(tmp_path / "back" / "adapter_model.safetensors")
    assert json.loads((tmp_path / "back" / CONFIG_NAME).read_text())["use_rslora"] is True
    before, after = load_adapter(tmp_path / "rs"), load_adapter(tmp_path / "back")
    for module in layers:
        assert after[module].scale == before[module].scale == before[module].alpha / np.sqrt(
            before[module].rank)
        assert np.array_equal(after[module].a, before[module].a)


def test_the_page_reader_names_what_it_was_given_instead_of_a_file(tmp_path):
    """A Promise (a fetch not awaited), a Blob, or the config already parsed is refused
    naming what came and how to get the file's text or bytes; the bytes were read as
    '0 bytes: too short for a safetensors file', the object as '[object Object]' JSON."""
    save_adapter(tmp_path / "a", {"fc": (np.ones((2, 4)), np.ones((3, 2)))}, alpha=4.0)
    got = run_node(tmp_path, """
      const text = readFileSync(`${dir}/a/adapter_config.json`, "utf8");
      const bytes = readFileSync(`${dir}/a/adapter_model.safetensors`);
      const refused = f => { try { f(); return null; } catch (e) { return e.message; } };
      console.log(JSON.stringify([
        refused(() => m.readPeftAdapter(text, Promise.resolve(bytes))),
        refused(() => m.readPeftAdapter(text, new Blob([bytes]))),
        refused(() => m.readPeftAdapter(JSON.parse(text), bytes)),
        refused(() => m.readPeftAdapter(text, new Uint8Array(bytes).buffer))]));
    """)
    want = ("adapter_model.safetensors: expected the file's bytes (an ArrayBuffer or a "
            "Uint8Array: await file.arrayBuffer(), or await response.arrayBuffer()), got ")
    assert got[0] == want + "a Promise (await it first)"
    assert got[1] == want + "Blob"
    assert got[2] == ("adapter_config.json: expected the file's text (a string: await "
                      "file.text(), or await response.text()), got Object")
    assert got[3] is None
