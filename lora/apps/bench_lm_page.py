"""The causal LM's page module (lora_lm.js) timed in Node on Dawn's ``webgpu`` package
beside lora.CausalLM in Python, in one run (issue 44's H200 figures):

    python -m lora.apps.bench_lm_page --node /tmp/gpu-node/node \\
        --webgpu /tmp/gpu-node/webgpu/index.js --out $OUT

writes a random-weight model folder of SmolLM2-135M's shape (bf16, as the hub's), exports
its module for the adapter's limits (probed first, in Node), then times in Node: loading
the weights, greedy generation (tokens/s of the new tokens, the prefill included, and of
the decode steps alone: a run of one new token taken off), a training step (tokens/s of
the batch, the loss read after the last step), and says the GPU memory the module holds
(lm.memory()) and the process's resident memory; beside the same work in Python
(lora.CausalLM on the runtime's device, run first: the page starts from its adapter and
trains on its batch, so the last losses should agree). Rows go to stdout and
``OUT/bench-lm-page.json``. Every sequence makes every token asked for (no
end-of-sequence id).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .lm_folders import SMOLLM2_135M, TINY, random_folder

F16_FLAGS = "enable-dawn-features=allow_unsafe_apis,vulkan_enable_f16_on_nvidia"

PROBE = """
import { create, globals } from %(webgpu)s;
Object.assign(globalThis, globals);
const gpu = create(%(flags)s);
const adapter = await gpu.requestAdapter();
const l = adapter.limits;
console.log(JSON.stringify({maxStorageBufferBindingSize: l.maxStorageBufferBindingSize,
  maxBufferSize: l.maxBufferSize, f16: adapter.features.has("shader-f16"),
  info: adapter.info?.description || adapter.info?.vendor || "?"}));
process.exit(0);
"""

BENCH = """
import { create, globals } from %(webgpu)s;
import fs from "node:fs";
Object.assign(globalThis, globals);
const s = %(settings)s;
const gpu = create(s.flags);
const adapter = await gpu.requestAdapter();
const m = await import(s.module);
const dev = await adapter.requestDevice({requiredFeatures: m.config.features,
                                         requiredLimits: m.config.limits});
const rows = (n, len, seed) => Array.from({length: n}, (_, r) => Array.from({length: len},
  (_, k) => 1 + ((seed * 7919 + r * 104729 + k * 31337) %% (m.config.model.vocabSize - 1))));
const io = await import(s.adapterModule);
const start = io.readPeftAdapter(fs.readFileSync(s.adapter + "/adapter_config.json", "utf8"),
  fs.readFileSync(s.adapter + "/adapter_model.safetensors")).layers;
let t = performance.now();
const lm = await m.loadCausalLM(dev, await fs.openAsBlob(s.weights), {adapter: start});
const out = {loadS: (performance.now() - t) / 1000};
const prompt = rows(m.config.shapes.genBatch, m.config.shapes.prompt, 1);
const gen = async n => { const t0 = performance.now();
  await lm.generate(prompt, {maxNewTokens: n, eosTokenId: []});
  return (performance.now() - t0) / 1000; };
await gen(m.config.shapes.newTokens); await gen(1);         // compiles, warms
const one = await gen(1), all = await gen(m.config.shapes.newTokens);
const made = m.config.shapes.genBatch * m.config.shapes.newTokens;
out.generateTokensPerS = made / all;
out.decodeTokensPerS = m.config.shapes.genBatch * (m.config.shapes.newTokens - 1) / (all - one);
const batch = JSON.parse(fs.readFileSync(s.batch, "utf8"));
for (let k = 0; k < 2; k++) await lm.step(batch);            // compiles, warms
await lm.loss();
t = performance.now();
for (let k = 0; k < s.steps; k++) await lm.step(batch);
out.loss = await lm.loss();
out.stepMs = (performance.now() - t) / s.steps;
out.stepTokensPerS = m.config.shapes.batch * m.config.shapes.seq / (out.stepMs / 1000);
out.memory = lm.memory();
out.rssMiB = process.memoryUsage().rss / 2 ** 20;
console.log(JSON.stringify(out));
process.exit(0);
"""


def node_json(node: str, script: str, folder: Path, timeout: float) -> dict:
    """Run ``script`` (an ES module) in Node; its one line of JSON on stdout."""
    path = folder / f"run{time.monotonic_ns()}.mjs"
    path.write_text(script)
    done = subprocess.run([node, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=folder)
    if done.returncode:
        raise RuntimeError(f"node failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export(folder: Path, out: Path, args, limits: dict) -> Path:
    """The module of ``folder`` for the bench's shapes, within the adapter's limits."""
    from .web_export import asset
    from .web_lm import LMSetup, LMShapes, module_js, record_module

    shapes = LMShapes(args.batch, args.seq, args.gen_batch, args.prompt, args.new_tokens)
    setup = LMSetup(folder, shapes, args.dtype, "all-linear", args.rank, 2.0 * args.rank,
                    limits={"max-storage-buffer-binding-size":
                            limits["maxStorageBufferBindingSize"],
                            "max-buffer-size": limits["maxBufferSize"]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "package.json").write_text('{"type": "module"}\n')  # Node 20.18 reads .js as ESM
    (out / "lora_lm.js").write_text(module_js(record_module(setup)))
    (out / "lora_adapter.js").write_text(asset("adapter.mjs"))
    return out / "lora_lm.js"


def python_times(folder: Path, args, work: Path) -> dict:
    """lora.CausalLM's figures for the same model, shapes and work; its first adapter
    and training batch go to ``work`` (adapter/, batch.json) for the page to start
    from, so that the last loss of both is the same step's."""
    from ..models.causal_lm import CausalLM

    dtype = {"f32": np.float32, "f16": np.float16}[args.dtype]
    t = time.perf_counter()
    lm = CausalLM.from_pretrained(folder, target_modules="all-linear", rank=args.rank,
                                       alpha=2.0 * args.rank, dtype=dtype)
    out = {"loadS": time.perf_counter() - t, "device": str(lm.device)}
    lm.save_adapter(work / "adapter")
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, lm.config.vocab_size, (args.gen_batch, args.prompt))

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        lm.generate(prompt, n, eos_token_id=[])
        return time.perf_counter() - t0

    for n in (args.new_tokens, 1):   # each compiles its graphs (the cache's length is baked)
        gen(n)
    one, whole = gen(1), gen(args.new_tokens)
    out["generateTokensPerS"] = args.gen_batch * args.new_tokens / whole
    out["decodeTokensPerS"] = args.gen_batch * (args.new_tokens - 1) / (whole - one)
    batch = rng.integers(1, lm.config.vocab_size, (args.batch, args.seq))
    (work / "batch.json").write_text(json.dumps(batch.tolist()))
    for _ in range(2):
        lm.step(batch)
    lm.loss()
    t = time.perf_counter()
    for _ in range(args.steps):
        lm.step(batch)
    out["loss"] = lm.loss()
    out["stepMs"] = (time.perf_counter() - t) / args.steps * 1000
    out["stepTokensPerS"] = args.batch * args.seq / (out["stepMs"] / 1000)
    out["memory"] = lm.memory()
    return out


def table(rows: dict, args) -> str:
    """The two sides as a markdown table."""
    shape = (f"{args.dtype}, rank {args.rank} all-linear; generate {args.gen_batch} x "
             f"({args.prompt} + {args.new_tokens}); step {args.batch} x {args.seq}")
    lines = [f"| {shape} | page module (Node) | lora.CausalLM (Python) |", "|---|---|---|"]
    for key, label in (("loadS", "load the weights (s)"),
                       ("generateTokensPerS", "generate: new tokens/s (prefill included)"),
                       ("decodeTokensPerS", "decode steps: tokens/s"),
                       ("stepMs", "training step (ms)"), ("stepTokensPerS", "training tokens/s")):
        lines.append(f"| {label} | {rows['node'][key]:.4g} | {rows['python'][key]:.4g} |")
    lines.append(f"| the last step's loss (both from Python's first adapter) | "
                 f"{rows['node']['loss']:.6f} | {rows['python']['loss']:.6f} |")
    mem = {side: sum(rows[side]["memory"].values()) / 2**20 for side in ("node", "python")}
    lines.append(f"| GPU memory held (MiB) | {mem['node']:.0f} | {mem['python']:.0f} |")
    lines.append(f"| Node's resident memory (MiB) | {rows['node']['rssMiB']:.0f} | - |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--node", default="node")
    p.add_argument("--webgpu", required=True, help="Dawn's webgpu package's index.js")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--dtype", choices=("f32", "f16"), default="f16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--gen-batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--flags", default=F16_FLAGS, help="Dawn's flags for create() "
                   "(space-separated; default: NVIDIA's f16)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-lm-page-"))
    flags = args.flags.split()
    webgpu = json.dumps(Path(args.webgpu).resolve().as_uri())
    limits = node_json(args.node, PROBE % {"webgpu": webgpu, "flags": json.dumps(flags)},
                       work, 120)
    print(f"adapter: {limits}", flush=True)
    config = SMOLLM2_135M if args.model == "smollm2" else TINY
    folder = random_folder(work / "model", config, "bfloat16")
    t = time.perf_counter()
    module = export(folder, work / "web", args, limits)
    print(f"exported in {time.perf_counter() - t:.1f} s: {module.stat().st_size} bytes",
          flush=True)
    python = python_times(folder, args, work)
    print(f"python: {python}", flush=True)
    gc.collect()   # (the Python model's buffers go before Node makes its own)
    settings = {"flags": flags, "module": module.as_uri(), "steps": args.steps,
                "weights": str(folder / "model.safetensors"), "adapter": str(work / "adapter"),
                "adapterModule": (module.parent / "lora_adapter.js").as_uri(),
                "batch": str(work / "batch.json")}
    node = node_json(args.node, BENCH % {"webgpu": webgpu, "settings": json.dumps(settings)},
                     work, 3600)
    print(f"node: {node}", flush=True)
    rows = {"node": node, "python": python, "adapter": limits, "args": vars(args)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench-lm-page.json").write_text(json.dumps(rows, indent=2))
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
