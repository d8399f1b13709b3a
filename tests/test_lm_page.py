"""The causal LM in a page (``python -m lora export --lm``, lora_lm.js) against
lora.CausalLM on the same model folder and data: logits, training losses and adapters
within 1e-4, generated ids identical, the same messages for bad input; in Node on
Dawn's ``webgpu`` package and in headless Chromium, both over SwiftShader.

The model is lora.apps.lm_folders.TINY (random weights written with numpy). SwiftShader
compiles the model's 60-odd kernels slowly (0.1-5 s each on this project's 2 cores), so
the default tier keeps the tests that compile little: the logits of a model whose
embedding goes in row chunks, the messages, the weight files refused and the limits;
the whole runs (training, generation, the adapter files, a lost device, the demo page)
are marked slow.
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from test_export import in_page, needs_browser
from test_node_modules import b64, missing, run_node, unb64

import lora
from lora.apps.cli import main as lora_main
from lora.apps.lm_folders import TINY, random_folder, random_weights, write_safetensors
from lora.models.config import LMConfig
from lora.training.adapter_io import LoraLayer, load_adapter, save_adapter
from shaderdsl import browser

VOCAB = TINY["vocab_size"]
RANK, ALPHA, LR = 4, 8.0, 1e-2
SHAPES = ["--batch", "2", "--seq", "8", "--gen-batch", "2", "--prompt-tokens", "8",
          "--new-tokens", "8"]
needs_node = pytest.mark.skipif(bool(missing()), reason=missing())


def linear_shapes(config: dict) -> dict:
    """{module: (in, out)} of every decoder Linear of a config.json's dict."""
    from lora.models.config import linear_modules
    return {name: (cols, rows) for name, (rows, cols, _) in
            linear_modules(LMConfig.from_dict(config)).items() if name != "lm_head"}


class Case:
    """A tiny model folder, its module exported with ``targets``, a random adapter
    (B not 0) saved as peft files, and Python's CausalLM of them on ``device``."""

    def __init__(self, root: Path, targets: str, *extra: str):
        self.folder = random_folder(root / "model", TINY)
        self.out = root / "web"
        self.targets = targets
        assert lora_main(["export", "--lm", str(self.folder), "--out", str(self.out),
                          "--target-modules", targets, "--rank", str(RANK), "--alpha",
                          str(ALPHA), "--lr", str(LR), *SHAPES, *extra]) == 0
        config = json.loads((self.out / "lora_lm.js").read_text().split(
            "export const config = ", 1)[1].split(";\n", 1)[0])
        rng = np.random.default_rng(7)
        shapes = linear_shapes(TINY)
        self.layers = {m: LoraLayer(0.2 * rng.standard_normal((RANK, shapes[m][0])),
                                    0.2 * rng.standard_normal((shapes[m][1], RANK)),
                                    ALPHA, False) for m in config["adapters"]}
        self.adapter = save_adapter(root / "adapter", {m: (la.a.astype(np.float32),
                                                          la.b.astype(np.float32))
                                                       for m, la in self.layers.items()},
                                    alpha=ALPHA, task_type="CAUSAL_LM")

    def python(self, device) -> lora.CausalLM:
        targets = self.targets if self.targets == "all-linear" else self.targets.split(",")
        return lora.CausalLM.from_pretrained(self.folder, target_modules=targets, rank=RANK,
                                             alpha=ALPHA, optimizer=lora.AdamW(lr=LR),
                                             adapters=self.layers, device=device)

    def module(self, name: str = "lora_lm.js") -> str:
        return json.dumps((self.out / name).as_uri())


def ids_of(rng, batch: int, seq: int) -> np.ndarray:
    return rng.integers(3, VOCAB, size=(batch, seq))


# JavaScript shared by the Node and Chromium runs: ``m`` the module, ``io`` lora_adapter.js,
# ``weights`` a weights source, ``adapterText`` / ``adapterBytes`` the peft files, ``dev``.
LOAD = """
const layers = io.readPeftAdapter(adapterText, adapterBytes).layers;
const lm = await m.loadCausalLM(dev, weights, {adapter: layers});
"""


def _data(rng) -> dict:
    """The inputs of a whole run: two logits batches (one shorter, left-padded by its
    mask), two prompts (one left-padded), six training batches (the fourth shorter, with
    -100 labels and a padded mask)."""
    short = ids_of(rng, 1, 6)
    short_mask = np.array([[0, 1, 1, 1, 1, 1]])
    prompts = ids_of(rng, 2, 5)
    prompt_mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    steps: list[dict] = [{"ids": ids_of(rng, 2, 8)} for _ in range(6)]
    labels = ids_of(rng, 1, 6)
    labels[0, :2] = -100
    steps[3] = {"ids": ids_of(rng, 1, 6), "labels": labels, "mask": [[1, 1, 1, 1, 1, 0]]}
    return {"logits": ids_of(rng, 2, 8), "short": short, "shortMask": short_mask,
            "prompts": prompts, "promptMask": prompt_mask, "steps": steps}


def _listed(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def _run_js(data: dict) -> str:
    """The body of a whole run (after LOAD): logits, generation, six steps (the
    adapter kept after each), the adapter files, then the device destroyed during a
    seventh step."""
    steps = json.dumps([{k: _listed(v) for k, v in s.items()} for s in data["steps"]])
    return LOAD + f"""
const result = {{}}, told = [];
result.logits = b64(await lm.logits({json.dumps(data["logits"].tolist())}));
result.short = b64(await lm.logits({json.dumps(data["short"].tolist())},
                                   {{attentionMask: {json.dumps(data["shortMask"].tolist())}}}));
result.generated = await lm.generate({json.dumps(data["prompts"].tolist())},
  {{maxNewTokens: 8, attentionMask: {json.dumps(data["promptMask"].tolist())},
   onToken: t => told.push(t)}});
result.told = told;
const steps = {steps};
for (const s of steps.slice(0, 5))
  await lm.step(s.ids, {{labels: s.labels ?? null, attentionMask: s.mask ?? null}});
result.losses = await lm.losses();
result.loss = await lm.loss();
const now = await lm.adapters();
result.adapters = Object.fromEntries(Object.entries(now).map(([k, l]) =>
  [k, [b64(l.a), b64(l.b)]]));
const files = io.writePeftAdapter(now, lm.peftOptions);
result.config = files.config;
result.tensors = b64(files.tensors);
result.keptBefore = (await lm.keptAdapter()).steps;
result.memory = lm.memory();
await lm.step(steps[5].ids);
dev.destroy();
await dev.lost;   // (a browser says so a little later: until then a step goes nowhere)
result.lost = await message(() => lm.step(steps[5].ids));
const kept = await lm.keptAdapter();
result.kept = {{steps: kept.steps, layers: Object.fromEntries(Object.entries(kept.layers)
  .map(([k, l]) => [k, [b64(l.a), b64(l.b)]]))}};
result.keptFiles = io.writePeftAdapter(kept.layers, lm.peftOptions).config === files.config;
"""


def _python_run(case: Case, data: dict, device) -> dict:
    """Python's answers to _run_js's calls; the adapters after 5 and 6 steps."""
    lm = case.python(device)
    out: dict = {"logits": lm.logits(data["logits"]),
                 "short": lm.logits(data["short"], attention_mask=data["shortMask"]),
                 "generated": lm.generate(data["prompts"], 8,
                                          attention_mask=data["promptMask"])}
    losses, adapters = [], []
    for s in data["steps"]:
        lm.step(s["ids"], labels=s.get("labels"), attention_mask=s.get("mask"))
        losses.append(lm.loss())
        adapters.append(lm.adapters())
    lm.save_adapter(case.out.parent / "python-adapter")
    out.update(losses=losses[:5], after5=adapters[4], after6=adapters[5],
               config=(case.out.parent / "python-adapter" / "adapter_config.json").read_text())
    return out


def _check_run(got: dict, want: dict, case: Case) -> None:
    """The page's whole run equals Python's."""
    b, s = want["logits"].shape[:2]
    np.testing.assert_allclose(unb64(got["logits"]).reshape(b, s, VOCAB), want["logits"],
                               atol=1e-4, rtol=0)
    np.testing.assert_allclose(unb64(got["short"]).reshape(1, 6, VOCAB), want["short"],
                               atol=1e-4, rtol=0)
    assert got["generated"] == want["generated"].tolist()
    told = [t["ids"] for t in got["told"]]  # as read: an ended row's ids not yet padded
    assert len(told) == want["generated"].shape[1] - 5
    if not np.isin(want["generated"][:, 5:], TINY["eos_token_id"]).any():
        assert told == want["generated"][:, 5:].T.tolist()
    np.testing.assert_allclose(got["losses"], want["losses"], atol=1e-4, rtol=0)
    assert got["loss"] == got["losses"][-1]
    for module, (a, bb) in want["after5"].items():
        np.testing.assert_allclose(unb64(got["adapters"][module][0]).reshape(a.shape), a,
                                   atol=1e-4, rtol=0)
        np.testing.assert_allclose(unb64(got["adapters"][module][1]).reshape(bb.shape), bb,
                                   atol=1e-4, rtol=0)
    assert got["config"] == want["config"]  # the text save_adapter writes
    assert got["keptBefore"] == 5 and got["keptFiles"]
    kept = got["kept"]
    assert kept["steps"] in (5, 6), kept["steps"]  # the 6th copy may or may not come back
    for module, (a, bb) in want[f"after{kept['steps']}"].items():
        np.testing.assert_allclose(unb64(kept["layers"][module][1]).reshape(bb.shape), bb,
                                   atol=1e-4, rtol=0)
    assert got["lost"].startswith("CausalLM.step: the GPUDevice was lost (destroyed")
    assert got["lost"].endswith(f"The adapter of step {kept['steps']} (the last whose copy "
                                f"came back) is kept: await lm.keptAdapter()")
    memory = got["memory"]
    assert memory["weights"] > 0 and memory["train"] > 0 and memory["generate"] > 0


def _files_of(got: dict, folder: Path) -> Path:
    """The page's adapter files written into ``folder``."""
    import base64
    folder.mkdir()
    (folder / "adapter_config.json").write_text(got["config"])
    (folder / "adapter_model.safetensors").write_bytes(base64.b64decode(got["tensors"]))
    return folder


# ---------------------------------------------------------------- Node

NODE_LOAD = """
const m = await import(%(module)s), io = await import(%(adapter)s);
const fs = await import("node:fs");
const adapterText = fs.readFileSync(%(dir)s + "/adapter_config.json", "utf8");
const adapterBytes = fs.readFileSync(%(dir)s + "/adapter_model.safetensors");
const weights = await fs.openAsBlob(%(weights)s);
"""


def node_load(case: Case, weights: Path | None = None) -> str:
    return NODE_LOAD % {"module": case.module(), "adapter": case.module("lora_adapter.js"),
                        "dir": json.dumps(str(case.adapter)),
                        "weights": json.dumps(str(weights or case.folder /
                                                  "model.safetensors"))}


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    """q_proj and v_proj adapted, the kernels built within 24 KiB bindings: the embedding
    (320 x 48 f32, 60 KiB) goes in 3 chunks of rows, as a browser's 128 MiB splits a large
    model's."""
    return Case(tmp_path_factory.mktemp("chunked"), "q_proj,v_proj",
                "--max-binding-size", "24576")


@needs_node
def test_the_logits_in_node_equal_pythons_with_the_embedding_in_chunks(chunked, device,
                                                                        tmp_path):
    """lora_lm.js in Node: the weights streamed from a Blob (fs.openAsBlob) into 3 row
    chunks of the embedding, a peft adapter from readPeftAdapter; the logits of a full
    batch and of a shorter left-padded one equal lora.CausalLM's within 1e-4."""
    text = (chunked.out / "lora_lm.js").read_text()
    assert text.count('"tensor": "model.embed_tokens.weight"') == 3
    rng = np.random.default_rng(3)
    ids, short, mask = ids_of(rng, 2, 8), ids_of(rng, 1, 5), [[0, 0, 1, 1, 1]]
    got = run_node(tmp_path, node_load(chunked) + LOAD + f"""
      const result = {{full: b64(await lm.logits({json.dumps(ids.tolist())})),
        short: b64(await lm.logits({json.dumps(short.tolist())}, {{attentionMask: {mask}}})),
        memory: lm.memory()}};""", timeout=300)
    lm = chunked.python(device)
    np.testing.assert_allclose(unb64(got["full"]).reshape(2, 8, VOCAB), lm.logits(ids),
                               atol=1e-4, rtol=0)
    np.testing.assert_allclose(unb64(got["short"]).reshape(1, 5, VOCAB),
                               lm.logits(short, attention_mask=mask), atol=1e-4, rtol=0)
    assert got["memory"]["logits"] > 0 and got["memory"]["train"] == 0  # made when used


# Bad input: (the call in JavaScript, the same call in Python); the messages are Python's
# with the arguments in their JavaScript spelling.
BAD_CALLS = [
    ("lm.step([[5, 400, 7]])", lambda lm: lm.step([[5, 400, 7]])),
    ("lm.logits([Array(257).fill(5)])", lambda lm: lm.logits([[5] * 257])),
    ("lm.step([[5, 6, 7]], {attentionMask: [[1, 1]]})",
     lambda lm: lm.step([[5, 6, 7]], attention_mask=[[1, 1]])),
    ("lm.logits([[5, 6, 7]], {attentionMask: [[1, 2, 3]]})",
     lambda lm: lm.logits([[5, 6, 7]], attention_mask=[[1, 2, 3]])),
    ("lm.step([[5, 6, 7]], {labels: [[5, 6]]})", lambda lm: lm.step([[5, 6, 7]], [[5, 6]])),
    ("lm.step([[5, 6, 7]], {labels: [[5, 999, 7]]})",
     lambda lm: lm.step([[5, 6, 7]], [[5, 999, 7]])),
    ("lm.generate([[5, 6]], {maxNewTokens: 0})", lambda lm: lm.generate([[5, 6]], 0)),
    ("lm.generate([Array(250).fill(5)], {maxNewTokens: 8})",
     lambda lm: lm.generate([[5] * 250], 8)),
    ("lm.generate([[5, 6]], {maxNewTokens: 2, eosTokenId: 9999})",
     lambda lm: lm.generate([[5, 6]], 2, eos_token_id=9999)),
    ("lm.loss()", lambda lm: lm.loss()),
]
JS_NAMES = {"input_ids": "inputIds", "attention_mask": "attentionMask",
            "max_new_tokens": "maxNewTokens", "eos_token_id": "eosTokenId"}


def python_message(call, lm) -> str:
    try:
        call(lm)
    except (ValueError, RuntimeError) as e:
        text = str(e)
        for py, js in JS_NAMES.items():
            text = text.replace(py, js)
        return text
    raise AssertionError("Python took it")


@needs_node
def test_bad_input_is_refused_with_pythons_messages(chunked, device, tmp_path):
    """Ids outside the vocabulary, sequences past max_position_embeddings, masks and labels
    of another shape or values, new tokens past the positions, eos ids outside the
    vocabulary, a loss before a step: refused in Python's words before any GPU work;
    and what only the page has: a batch past the export's shapes."""
    calls = ", ".join(f"await message(async () => {js})" for js, _ in BAD_CALLS)
    got = run_node(tmp_path, node_load(chunked) + LOAD + f"""
      const result = [{calls},
        await message(() => lm.step([[5, 6], [7, 8], [9, 10]])),
        await message(() => lm.logits([Array(9).fill(5)])),
        await message(() => lm.generate([[5]], {{maxNewTokens: 9}})),
        await message(() => lm.generate([Array(9).fill(5)], {{maxNewTokens: 2}})),
        await message(() => lm.step("5 6 7")), lm.steps];
      Object.values(m.buffers).find(b => b.group === "train").bytes = 2 ** 40;  // too many
      result.push(await message(() => lm.step([[5, 6]])));""")
    lm = chunked.python(device)
    for (js, call), message in zip(BAD_CALLS, got):
        assert message == python_message(call, lm), js
    assert got[len(BAD_CALLS):-1] == [
        "CausalLM.step: 3 sequences, but this module runs 2 at a time (--batch 2 at export); "
        "give at most 2",
        "CausalLM.logits: sequences of 9 tokens are longer than this module's 8 (--seq 8 at "
        "export)",
        "CausalLM.generate: maxNewTokens 9 is over this module's 8 (--new-tokens 8 at export: "
        "the KV cache holds the prompt and that many)",
        "CausalLM.generate: sequences of 9 tokens are longer than this module's 8 "
        "(--prompt-tokens 8 at export)",
        "CausalLM.step: inputIds must be integers [batch, seq] (a 1-D row is one sequence for "
        "inputIds), got string", 0]
    assert got[-1].startswith("CausalLM.step: the device could not make the train buffers (")


def _bad_files(folder: Path, into: Path) -> dict[str, Path]:
    """Weights files that are not the model's, by what is wrong."""
    config = LMConfig.from_dict(TINY)
    good = random_weights(config, seed=0)
    cases = {
        "missing": {k: v for k, v in good.items() if k != "model.norm.weight"},
        "misshapen": {**good, "model.norm.weight": np.ones(47, np.float32)},
        "extra": {**good, "model.layers.2.mlp.up_proj.weight": np.ones((64, 48), np.float32)},
        "nan": {**good, "model.layers.1.input_layernorm.weight":
                np.where(np.arange(48) % 7 == 0, np.nan, 1.0).astype(np.float32)},
        "untied": {**good, "lm_head.weight": good["model.embed_tokens.weight"] + 1},
        "tied": {**good, "lm_head.weight": good["model.embed_tokens.weight"]},
    }
    paths = {}
    for name, tensors in cases.items():
        paths[name] = into / f"{name}.safetensors"
        write_safetensors(paths[name], tensors)
    whole = (folder / "model.safetensors").read_bytes()
    paths["truncated"] = into / "truncated.safetensors"
    paths["truncated"].write_bytes(whole[:-100])
    header = json.dumps({"x": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    paths["int64"] = into / "int64.safetensors"
    paths["int64"].write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    return paths


@needs_node
def test_weights_files_that_are_not_the_models_are_refused_by_name(chunked, tmp_path):
    """A tensor missing, misshapen, extra, of a dtype the page does not read, NaN values,
    a file cut short, an lm_head.weight of its own under a tied config: refused naming
    the file and the tensor (before any kernel is compiled); the same head as the
    embedding is taken, as transformers ties it."""
    paths = _bad_files(chunked.folder, tmp_path)
    tries = ", ".join(f"await message(async () => m.loadCausalLM(dev, await fs.openAsBlob("
                      f"{json.dumps(str(p))})))" for p in paths.values())
    got = run_node(tmp_path, node_load(chunked) + f"""
      const result = [{tries}, await message(() => m.loadCausalLM(dev, 5)),
        await message(() => m.loadCausalLM(dev, fs.readFileSync({json.dumps(str(paths["nan"]))}),
          {{adapter: {{"model.layers.0.mlp.up_proj": {{}}}}}}))];""")
    where = f"the config of this module ({chunked.folder})"
    want = dict(zip(paths, got))
    assert want["missing"] == (f"weights file 1: model.norm.weight [48] is missing ({where} "
                               f"implies it: LlamaForCausalLM)")
    assert want["misshapen"] == (f"weights file 1: model.norm.weight has shape [47]; {where} "
                                 f"implies [48]")
    assert want["extra"] == (f"weights file 1: holds model.layers.2.mlp.up_proj.weight, which "
                             f"LlamaForCausalLM of {where} does not have")
    assert want["nan"] == ("weights file 1: model.layers.1.input_layernorm.weight: 7 of 48 "
                           "values are NaN or infinite")
    assert want["untied"].startswith("weights file 1: lm_head.weight holds other values than "
                                     "model.embed_tokens.weight")
    assert want["tied"] is None
    assert want["truncated"].startswith("weights file 1: not a readable safetensors file: "
                                        "model.norm.weight's data_offsets")
    assert want["int64"] == "weights file 1: x is stored as I64; lora reads F32, F16, BF16"
    assert got[-2] == ("loadCausalLM: a weights file must be a URL, a Response, a Blob or "
                       "File, or its bytes (an ArrayBuffer or Uint8Array), got Number")
    assert got[-1] == ("loadCausalLM: adapter: the adapter adapts [model.layers.0.mlp.up_proj]"
                       "; this model adapts [model.layers.0.self_attn.q_proj, "
                       "model.layers.0.self_attn.v_proj, model.layers.1.self_attn.q_proj, "
                       "model.layers.1.self_attn.v_proj]")


@needs_node
def test_what_a_browser_does_not_give_is_named(chunked, tmp_path):
    """A module built for bindings past WebGPU's default (--max-binding-size) on a device
    not given them, and an f16 module on a device without shader-f16 (SwiftShader has
    none): loadCausalLM says what to request or to export with --dtype f32."""
    big, half = tmp_path / "big", tmp_path / "half"
    for out, extra in ((big, ["--max-binding-size", str(200 << 20), "--max-buffer-size",
                              str(300 << 20)]), (half, ["--dtype", "f16"])):
        assert lora_main(["export", "--lm", str(chunked.folder), "--out", str(out),
                          "--rank", "4", *SHAPES, *extra]) == 0
    got = run_node(tmp_path, f"""
      const fs = await import("node:fs");
      const weights = fs.readFileSync({json.dumps(str(chunked.folder / "model.safetensors"))});
      const bare = await (await gpu.requestAdapter()).requestDevice();  // default limits
      const result = [];
      for (const dir of [{json.dumps(str(big))}, {json.dumps(str(half))}]) {{
        const m = await import(dir + "/lora_lm.js");
        result.push(await message(() => m.loadCausalLM(bare, weights)));
      }}
      result.push(adapter.features.has("shader-f16"));""")
    assert got[0] == ("loadCausalLM: this module binds up to maxStorageBufferBindingSize = "
                      "209715200 and maxBufferSize = 314572800 bytes, over the device's "
                      "134217728 and 268435456: request them with adapter.requestDevice("
                      '{requiredLimits: {"maxStorageBufferBindingSize":209715200,'
                      '"maxBufferSize":314572800}}) where adapter.limits allows, or export '
                      "with smaller --max-binding-size / --max-buffer-size")
    if got[2]:
        pytest.skip("this adapter has shader-f16")
    assert got[1] == ("loadCausalLM: this module needs the WebGPU feature(s) shader-f16, which "
                      "the device was not given: request them with adapter.requestDevice("
                      '{requiredFeatures: ["shader-f16"]}) where adapter.features has them; '
                      "where it has not (SwiftShader, some GPUs), export the module with "
                      "--dtype f32")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Every Linear adapted ("all-linear"), WebGPU's default limits."""
    return Case(tmp_path_factory.mktemp("whole"), "all-linear")


@pytest.fixture(scope="module")
def answers(whole, device):
    """The inputs of a whole run and Python's answers to them."""
    data = _data(np.random.default_rng(11))
    return data, _python_run(whole, data, device)


@pytest.fixture(scope="module")
def node_run(whole, answers, tmp_path_factory):
    """The whole run in Node (_run_js), its results."""
    if missing():
        pytest.skip(missing())
    return run_node(tmp_path_factory.mktemp("node-run"), node_load(whole) +
                    _run_js(answers[0]), timeout=900)


@pytest.mark.slow
@needs_node
def test_a_whole_run_in_node_equals_python(whole, answers, node_run, tmp_path):
    """In Node: logits (a batch padded inside), greedy generation of two prompts (one
    left-padded) with a callback per token, five AdamW steps (one of a shorter batch
    with -100 labels and padding), the adapters and the peft files written: equal to
    lora.CausalLM's within 1e-4 (ids identical, the adapter_config.json text
    save_adapter writes); the device destroyed during a sixth step, the adapter of the
    last step whose copy came back is kept and written."""
    _check_run(node_run, answers[1], whole)
    layers = load_adapter(_files_of(node_run, tmp_path / "page-adapter"))
    assert sorted(layers) == sorted(answers[1]["after5"])


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request on stderr
        pass


@contextlib.contextmanager
def served(folder: Path):
    """``folder`` over HTTP on a free local port while inside: its root URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        _Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@needs_node
def test_bf16_and_f16_files_load_as_python_reads_them(whole, device, tmp_path):
    """The same model stored as BF16 (widened exactly) and as F16, read from bytes and
    from a URL (fetch, streamed): logits equal those of lora.CausalLM from the same
    folder within 1e-4."""
    config = LMConfig.from_dict(TINY)
    rng = np.random.default_rng(5)
    ids = ids_of(rng, 2, 8)
    folders = {}
    for dtype in ("bfloat16", "float16"):
        folders[dtype] = tmp_path / dtype
        folders[dtype].mkdir()
        (folders[dtype] / "config.json").write_text(json.dumps(TINY))
        write_safetensors(folders[dtype] / "model.safetensors", random_weights(config, 1),
                          dtype)
    with served(tmp_path) as root:
        url = f"{root}/float16/model.safetensors"
        got = run_node(tmp_path, node_load(whole) + f"""
          const result = {{}};
          for (const [name, source] of [["bf16", fs.readFileSync(
              {json.dumps(str(folders["bfloat16"] / "model.safetensors"))})],
              ["f16", {json.dumps(url)}]]) {{
            const lm = await m.loadCausalLM(dev, source, {{adapter: io.readPeftAdapter(
              adapterText, adapterBytes).layers}});
            result[name] = b64(await lm.logits({json.dumps(ids.tolist())}));
          }}""", timeout=600)
    for name, dtype in (("bf16", "bfloat16"), ("f16", "float16")):
        lm = lora.CausalLM.from_pretrained(folders[dtype], target_modules="all-linear",
                                           rank=RANK, alpha=ALPHA, adapters=whole.layers,
                                           device=device)
        np.testing.assert_allclose(unb64(got[name]).reshape(2, 8, VOCAB), lm.logits(ids),
                                   atol=1e-4, rtol=0, err_msg=name)


@pytest.mark.slow
@needs_node
def test_the_pages_adapter_loads_in_peft_to_the_same_logits(whole, answers, node_run,
                                                             device, tmp_path):
    """The adapter files the page wrote in Node after five steps, loaded by
    peft.PeftModel.from_pretrained into transformers' model of the folder (float64),
    give the logits of lora.CausalLM with that adapter within 1e-4 (and lora.CausalLM
    loads them too)."""
    torch = pytest.importorskip("torch", reason="peft's side needs torch (not installed)")
    peft = pytest.importorskip("peft", reason="peft is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    ids = answers[0]["logits"]
    folder = _files_of(node_run, tmp_path / "page-adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(whole.folder,
                                                             attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(base, str(folder)).double().eval()
    with torch.no_grad():
        got = model(input_ids=torch.tensor(ids)).logits.numpy()
    lm = lora.CausalLM.from_pretrained(whole.folder, target_modules="all-linear", rank=RANK,
                                       alpha=ALPHA, device=device)
    lm.load_adapter(folder)
    np.testing.assert_allclose(got, lm.logits(ids), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- Chromium

def page_load(case: Case) -> str:
    """In the browser device's page: a device of its own (the run destroys it), the
    modules imported, the weights as a Blob and the adapter files from base64."""
    import base64
    text = (case.adapter / "adapter_config.json").read_text()
    tensors = base64.b64encode((case.adapter / "adapter_model.safetensors").read_bytes())
    weights = base64.b64encode((case.folder / "model.safetensors").read_bytes())
    return f"""
const dev = await (await navigator.gpu.requestAdapter()).requestDevice();
const m = await import({case.module()}), io = await import({case.module("lora_adapter.js")});
const b64 = a => new Uint8Array(a.buffer, a.byteOffset, a.byteLength).toBase64();
const message = async f => {{ try {{ await f(); return null; }}
                              catch (e) {{ return e.message; }} }};
const adapterText = {json.dumps(text)};
const adapterBytes = Uint8Array.fromBase64("{tensors.decode()}");
const weights = new Blob([Uint8Array.fromBase64("{weights.decode()}")]);
"""


@pytest.mark.slow
@needs_browser
def test_a_whole_run_in_chromium_equals_python(whole, answers):
    """The run of test_a_whole_run_in_node_equals_python in headless Chromium
    (SwiftShader), the weights from a Blob: the same equalities with lora.CausalLM."""
    data, want = answers
    got = in_page("{" + page_load(whole) + _run_js(data) + "return result; }")
    _check_run(got, want, whole)


TEXT = Path("/usr/share/common-licenses/GPL-3")  # real text that ships on the machine


@pytest.mark.slow
@needs_browser
@pytest.mark.skipif(not TEXT.exists(), reason=f"{TEXT} (Debian's base-files) is missing")
def test_the_demo_page_fine_tunes_the_tiny_model_headless(whole, device, tmp_path):
    """--lm-demo's page, served over HTTP with ?model=...&text=... (the weights fetched
    and streamed): 10 steps on the text's bytes lower the loss (the page compares the
    first five steps' mean with the last five's); its losses are
    lora.CausalLM's from the page's own first adapter on the same batches within 1e-4,
    and the sample after training is Python's greedy continuation with the page's
    adapter, which lora.load_adapter reads."""
    steps, seq, batch = 10, 16, 2
    page = tmp_path / "page"
    assert lora_main(["export", "--lm", str(whole.folder), "--lm-demo", str(page),
                      "--target-modules", "all-linear", "--rank", str(RANK), "--alpha",
                      str(ALPHA), "--lr", "2e-2", "--steps", str(steps), "--seq", str(seq),
                      "--batch", str(batch), "--prompt-tokens", "16", "--new-tokens",
                      "8"]) == 0
    html = (page / "index.html").read_text()
    assert "http" not in html.replace("http-equiv", "")  # nothing fetched but what is picked
    (page / "model.safetensors").write_bytes((whole.folder / "model.safetensors").read_bytes())
    text = TEXT.read_bytes()[:640]
    (page / "train.txt").write_bytes(text)
    with served(page) as root:
        result = browser.load_page(f"{root}/index.html?model=model.safetensors&text=train.txt",
                                   "window.loraLmDemo", timeout=900)
    assert result["ok"], result.get("error", result)
    assert result["last"] < result["first"] and len(result["losses"]) == steps
    files = {}
    for name in ("initial", "trained"):
        got = result[name] if name == "initial" else result
        files[name] = _files_of(got, tmp_path / name)
    lm = lora.CausalLM.from_pretrained(whole.folder, target_modules="all-linear", rank=RANK,
                                       alpha=ALPHA, optimizer=lora.AdamW(lr=2e-2),
                                       device=device)
    lm.load_adapter(files["initial"])
    ids = np.frombuffer(text, np.uint8).astype(np.int64)
    rows = ids[:len(ids) // seq * seq].reshape(-1, seq)
    losses = []
    for s in range(steps):
        lm.step(rows[[(s * batch + r) % len(rows) for r in range(batch)]])
        losses.append(lm.loss())
    np.testing.assert_allclose(result["losses"], losses, atol=1e-4, rtol=0)
    lm.load_adapter(files["trained"])
    after = lm.generate(ids[None, :16], 8)[0, 16:]
    said = b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in after.tolist())
    assert result["after"] == said.decode("utf-8", errors="replace")


@pytest.mark.slow
@needs_node
def test_the_lm_block_of_the_docs_runs(tmp_path):
    """docs/browser.md's lora_lm.js block, as written, beside the files its command
    writes for a model folder model/: it prints a token a step and the loss, and the
    adapter files it writes load with lora.load_adapter."""
    import subprocess

    from test_node_modules import NODE, NODE_MODULES, doc_block, node_env
    random_folder(tmp_path / "model", TINY)
    assert lora_main(["export", "--lm", str(tmp_path / "model"), "--out", str(tmp_path),
                      "--target-modules", "all-linear", "--rank", "8", "--batch", "1",
                      "--seq", "8", "--prompt-tokens", "8", "--new-tokens", "4"]) == 0
    (tmp_path / "node_modules").symlink_to(NODE_MODULES)
    (tmp_path / "lm.mjs").write_text(doc_block("The language model in a page"))
    done = subprocess.run([NODE, "lm.mjs"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=node_env())
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == [f"token {k}" for k in range(4)]
    assert lines[4].startswith("loss ") and 0 < float(lines[4][5:]) < 20
    assert len(load_adapter(tmp_path / "adapter")) == 14  # 7 Linear modules x 2 layers


def test_the_export_refuses_what_it_cannot_record(chunked, tmp_path, capsys):
    """--lm-demo without --lm, shapes past the model's positions, a folder without
    weights: refused before anything is written."""
    folder = str(chunked.folder)
    tries = [["--lm-demo", str(tmp_path / "page")],
             ["--lm", folder, "--out", str(tmp_path / "a"), "--seq", "300"],
             ["--lm", folder, "--out", str(tmp_path / "b"), "--prompt-tokens", "250"],
             ["--lm", str(tmp_path), "--out", str(tmp_path / "c")]]
    said = []
    for argv in tries:
        assert lora_main(["export", *argv]) == 1
        said.append(capsys.readouterr().err)
    assert said[0] == ("error: --lm-demo needs --lm FOLDER: the page is written for that "
                       "model's architecture and sizes\n")
    assert said[1] == ("error: --lm: --seq (300) is over the model's max_position_embeddings "
                       "(256)\n")
    assert said[2] == ("error: --lm: --prompt-tokens + --new-tokens (282) is over the model's "
                       "max_position_embeddings (256)\n")
    assert said[3].startswith(f"error: {tmp_path / 'config.json'}: missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# Uses the module's declared API, so tsc checks that the declarations hold it.
USE_LM_TS = """
import { loadCausalLM, configDifferences, config, type CausalLM } from "./web/lora_lm.js";
import { readPeftAdapter, writePeftAdapter } from "./web/lora_adapter.js";

export async function use(device: GPUDevice, file: Blob, bytes: Uint8Array) {
  const layers = readPeftAdapter("{}", bytes).layers;
  const lm: CausalLM = await loadCausalLM(device, [file, "model.safetensors"],
    { adapter: layers, seed: 1, onProgress: ({ loaded, total }) => loaded / total });
  const logits: Float32Array = await lm.logits([[1, 2, 3]], { attentionMask: [[1, 1, 1]] });
  const rows: number[][] = await lm.generate(new Int32Array([1, 2]), { maxNewTokens: 4,
    eosTokenId: [2], onToken: ({ step, ids }) => step + ids.length });
  await lm.step([[1, 2, 3]], { labels: [[-100, 2, 3]] });
  const losses: number[] = await lm.losses();
  lm.set({ lr: 1e-3 });
  const files = writePeftAdapter(await lm.adapters(), lm.peftOptions);
  const kept = await lm.keptAdapter();
  lm.loadAdapter(kept.layers);
  const differ: string[] = configDifferences(files.config);
  return [logits, rows, losses, differ, config.shapes.seq, lm.memory().train, await lm.loss()];
}
"""


@needs_node
def test_the_lm_declarations_pass_tsc_strict(chunked):
    """`tsc --strict` over lora_lm.d.ts and lora_adapter.d.ts, used as the docs use them."""
    import subprocess

    from test_node_modules import NODE, NODE_MODULES, TSC
    if not TSC.exists():
        pytest.skip(f"TypeScript is not in {NODE_MODULES} (scripts/setup.sh installs it)")
    root = chunked.out.parent
    (root / "use.ts").write_text(USE_LM_TS)
    (root / "tsconfig.json").write_text(json.dumps({"compilerOptions": {
        "strict": True, "noEmit": True, "target": "es2022", "module": "esnext",
        "moduleResolution": "bundler", "skipLibCheck": False,
        "typeRoots": [str(NODE_MODULES / "@webgpu")], "types": ["types"]},
        "files": ["use.ts"]}))
    done = subprocess.run([NODE, str(TSC), "-p", "."], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_node
def test_weights_are_converted_as_numpy_converts_them(chunked, tmp_path):
    """The loader's conversion (lm.mjs's ``converted``, exported from a copy of the module):
    every bfloat16 bit pattern to float16 (by its table) and to float32, and every float16
    pattern to float32, equal numpy's astype bit for bit (NaNs as NaNs), with the values
    NaN or infinite and those finite but beyond float16 counted."""
    copy = tmp_path / "lm_copy.js"
    copy.write_text((chunked.out / "lora_lm.js").read_text() + "\nexport { converted };\n")
    patterns = np.arange(65536, dtype=np.uint16)
    rng = np.random.default_rng(0)
    floats = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-9, 6, 5000),
                             [0.0, -0.0, 65504, 65519.99, 65520, -7e4, 6e-8, 2.98e-8, 2.99e-8,
                              np.inf, -np.inf, np.nan]]).astype(np.float32)
    got = run_node(tmp_path, f"""
      const {{ converted }} = await import({json.dumps(copy.as_uri())});
      const bits = new Uint8Array(Uint16Array.from({{length: 65536}}, (_, k) => k).buffer);
      const result = {{}};
      for (const [from, to] of [["BF16", "float16"], ["BF16", "float32"], ["F16", "float32"]]) {{
        const {{data, tally}} = converted(bits, from, to);
        result[from + to] = {{data: b64(data), tally}};
      }}
      const {{data, tally}} = converted(new Uint8Array(f32("{b64(floats)}").buffer), "F32",
                                        "float16");
      result.F32float16 = {{data: b64(data), tally}};""")
    wide = (patterns.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(over="ignore"):
        want = {"BF16float16": wide.astype(np.float16), "BF16float32": wide,
                "F16float32": patterns.view(np.float16).astype(np.float32),
                "F32float16": floats.astype(np.float16)}
    for key, values in want.items():
        data = unb64(got[key]["data"], values.dtype)
        nan = np.isnan(values)
        assert np.array_equal(np.isnan(data), nan), key
        assert np.array_equal(data[~nan].view(f"u{values.itemsize}"),
                              values[~nan].view(f"u{values.itemsize}")), key
    bf16_finite = np.isfinite(wide)
    assert got["BF16float16"]["tally"]["nonFinite"] == int((~bf16_finite).sum())
    assert got["BF16float16"]["tally"]["beyond"] == int(
        (bf16_finite & ~np.isfinite(want["BF16float16"])).sum())
    assert got["F16float32"]["tally"]["nonFinite"] == 2 * 1024
    finite = np.isfinite(floats)
    assert got["F32float16"]["tally"] == {
        "nonFinite": 3, "beyond": int((finite & ~np.isfinite(want["F32float16"])).sum()),
        "firstBeyond": float(floats[finite & ~np.isfinite(want["F32float16"])][0])}


def test_the_package_of_a_language_model(chunked, tmp_path):
    """--lm with --package: lora_lm.js is the package's main entry, lora_adapter.js
    beside it, each by stem and by file name."""
    assert lora_main(["export", "--lm", str(chunked.folder), "--package", str(tmp_path),
                      "--seq", "8"]) == 0
    manifest = json.loads((tmp_path / "package.json").read_text())
    assert manifest["main"] == "./lora_lm.js" and manifest["types"] == "./lora_lm.d.ts"
    assert set(manifest["exports"]) == {".", "./lora_lm", "./lora_lm.js", "./lora_adapter",
                                        "./lora_adapter.js"}
