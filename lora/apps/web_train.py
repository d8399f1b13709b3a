"""The training step of a LoRA layer for web pages: ``python -m lora export --train``.

The step is recorded, not rewritten: a :class:`LayerTrainer` is built on an
interpreter device that records its dispatches and copies instead of running
them (no subgroups, WebGPU's default limits, so every browser takes the
kernels), and one ``record`` gives the exact list of one step: the base
output copied in, the forward saving h, the loss and its gradient, the
backward, the optimizer's begin and update. The ES module holds those
kernels, every buffer the step touches (with its first contents: A and B as
peft initialises them, the optimizer's settings, zeroed moments and state)
and ``loraTrainer(device, options)``, whose ``step({x, target, base})``
records the whole step into one submit, as the Python trainer does.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from shaderdsl.export import RUNTIME_DTS, RUNTIME_JS, js_object, kernel_info
from shaderdsl.interp import Device as InterpDevice

from ..core import reference as R
from ..core.weight import Weight
from ..training.optim import SGD, AdamW
from ..training.trainer import LayerTrainer


@dataclass(frozen=True)
class TrainShape:
    """One exported training step: a layer's shape, its loss and optimizer."""

    rank: int
    in_dim: int
    out_dim: int
    tokens: int
    alpha: float = 16.0
    loss: str = "mse"
    optimizer: str = "adamw"
    lr: float = 1e-3
    max_grad_norm: float | None = None
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class _Recorder(InterpDevice):
    """An interpreter device whose dispatches and copies are listed, not run."""

    def __init__(self):
        super().__init__(features=[])
        self.ops: list = []

    def dispatch(self, kernel, bindings, workgroups, *, overrides=None) -> None:
        self.ops.append(("dispatch", kernel, list(bindings), workgroups))

    def _copy(self, src, dst, nbytes: int) -> None:
        self.ops.append(("copy", src, dst, nbytes))


@dataclass
class Recording:
    """One recorded training step: the device's ops, the buffers' names
    (id -> (name, buffer); the named ones first, buf<k> for the rest) and
    the module's config (its ``given`` inputs, ``loss`` and ``adapters``)."""

    device: _Recorder
    named: dict
    config: dict

    def names(self) -> dict:
        names = {id(buf): (name, buf) for name, buf in self.named.items()}
        for op in self.device.ops:
            for buf in (op[2] if op[0] == "dispatch" else op[1:3]):
                if id(buf) not in names:
                    names[id(buf)] = (f"buf{len(names)}", buf)
        return names


def _layer(name: str, weight, alpha: float, scale: float) -> dict:
    return {"a": f"{name}.a", "b": f"{name}.b", "rank": weight.rank, "inDim": weight.in_dim,
            "outDim": weight.out_dim, "alpha": alpha, "scale": scale}


def record_layer(shape: TrainShape) -> Recording:
    """One LayerTrainer step (base copied into the output, forward, loss,
    backward, optimizer) on a _Recorder; A and B as peft initialises them."""
    dev = _Recorder()
    a, b = R.init_lora(shape.in_dim, shape.out_dim, shape.rank, seed=shape.seed)
    weight = Weight.from_numpy(dev, a, b)
    make = AdamW if shape.optimizer == "adamw" else SGD
    opt = make(lr=shape.lr, max_grad_norm=shape.max_grad_norm)
    trainer = LayerTrainer(dev, weight, shape.scale, shape.tokens, opt, loss=shape.loss)
    f32, t = np.float32, shape.tokens
    given = {"x": dev.empty((t, shape.in_dim), f32), "base": dev.empty((t, shape.out_dim), f32),
             "target": dev.empty((t, shape.out_dim), f32) if shape.loss == "mse"
             else dev.empty(t, np.uint32)}
    out = dev.empty((t, shape.out_dim), f32)
    trainer.record(given["x"], out, given["target"], given["base"])
    sums = trainer.loss_plan.scratch["partial" if shape.loss == "mse" else "losses"]
    config = {"tokens": t, "alpha": shape.alpha, "scale": shape.scale, "optimizer": shape.optimizer,
              "lr": shape.lr, "maxGradNorm": shape.max_grad_norm, "seed": shape.seed,
              "given": list(given), "loss": {"kind": shape.loss, "buffer": "loss_sums",
                                              "count": t * shape.out_dim if shape.loss == "mse"
                                              else t, "classes": shape.out_dim},
              "adapters": {"layer": _layer("layer", weight, shape.alpha, shape.scale)}}
    return Recording(dev, {**given, "output": out, "layer.a": weight.a, "layer.b": weight.b,
                           "loss_sums": sums}, config)


def _module_parts(rec: Recording) -> tuple[list, list, dict]:
    """(kernels, steps, buffers) for the module: each distinct Kernel once; a
    dispatch as its kernel's index, grid and buffer per binding, a copy as
    [src, dst, bytes]; every buffer's size, dtype and first contents (none
    for the step's inputs and for zeros)."""
    names = rec.names()
    kernels, steps = [], []
    for op in rec.device.ops:
        if op[0] == "copy":
            steps.append({"copy": [names[id(op[1])][0], names[id(op[2])][0], op[3]]})
            continue
        _, kernel, bufs, grid = op
        if any(b.access == "uniform" for b in kernel.bindings):  # the module makes storage only
            raise ValueError(f"kernel {kernel.name!r} takes a uniform; the training export "
                             f"makes storage buffers only")
        if kernel not in kernels:
            kernels.append(kernel)
        grid = list(grid) if isinstance(grid, tuple) else [grid, 1, 1]
        steps.append({"kernel": kernels.index(kernel), "grid": grid,
                      "buffers": {b.name: names[id(buf)][0]
                                  for b, buf in zip(kernel.bindings, bufs)}})
    buffers = {}
    for name, buf in names.values():
        first = rec.device.read(buf)
        buffers[name] = {"bytes": int(first.nbytes), "dtype": first.dtype.name,
                         "init": None if name in rec.config["given"] or not first.any()
                         else base64.b64encode(first.tobytes()).decode("ascii")}
    return kernels, steps, buffers


def module_js(rec: Recording, command: str = "") -> str:
    """The ES module: config, buffers, steps, kernels, the runtime, loraTrainer."""
    kernels, steps, buffers = _module_parts(rec)
    config = dict(rec.config, features=sorted({f for k in kernels
                                               for f in kernel_info(k)["features"]}))
    body = ",\n".join("  " + js_object(kernel_info(k), "  ") for k in kernels)
    made = f"`{command}`" if command else "lora.apps.web_train"
    return (f"// lora_train.js: generated by {made}.\n"
            f"// One LoRA training step (forward, loss, backward, optimizer) per submit on "
            f"GPUBuffers; standard WebGPU only. See docs/browser.md.\n\n"
            f"export const config = {json.dumps(config)};\n"
            f"export const buffers = {json.dumps(buffers)};\n"
            f"export const steps = [\n" + "".join(f"  {json.dumps(s)},\n" for s in steps) + "];\n"
            f"export const kernels = [\n{body},\n];\n\n{RUNTIME_JS}\n{TRAIN_JS}")


def module_dts(command: str = "") -> str:
    made = f"`{command}`" if command else "lora.apps.web_train"
    return f"// lora_train.d.ts: generated by {made}.\n{RUNTIME_DTS}\n{TRAIN_DTS}"


TRAIN_JS = r"""// ---- the training step: every op of one step into one submit
/** Bytes of base64 text (atob: in every browser and in Node, unlike Uint8Array.fromBase64). */
export function bytesOfBase64(text) {
  const raw = atob(text), out = new Uint8Array(raw.length);
  for (let k = 0; k < raw.length; k++) out[k] = raw.charCodeAt(k);
  return out;
}

async function readBack(device, buffer, bytes) {
  const staging = device.createBuffer({size: bytes, usage: GPUBufferUsage.MAP_READ |
                                                           GPUBufferUsage.COPY_DST});
  const enc = device.createCommandEncoder({label: "loraTrainer read"});
  enc.copyBufferToBuffer(buffer, 0, staging, 0, bytes);
  device.queue.submit([enc.finish()]);
  await staging.mapAsync(GPUMapMode.READ);
  const out = new Uint8Array(staging.getMappedRange()).slice();
  staging.unmap();
  staging.destroy();
  return out.buffer;
}

function checkInput(what, value) {
  const {dtype, bytes} = buffers[what];
  const Want = dtype === "uint32" ? Uint32Array : Float32Array;
  if (!(value instanceof Want))
    throw new Error(`loraTrainer.step: ${what} must be a ${Want.name} (or a GPUBuffer), got ` +
                    `${value?.constructor?.name ?? typeof value}`);
  if (value.byteLength !== bytes)
    throw new Error(`loraTrainer.step: ${what} has ${value.length} values, the trainer takes ` +
                    `${bytes / 4} (${config.tokens} token(s); a batch of another size needs ` +
                    `its own export)`);
}

/** A trainer on ``device``: its buffers made and filled (as exported: A and B as peft
 *  initialises them, or ``weights`` {module: {a, b}} of row-major Float32Arrays), every
 *  pipeline compiled. ``step(inputs)`` records one training step into one submit; its
 *  inputs are config.given (each a TypedArray written into the trainer's own buffer, or
 *  a GPUBuffer of that size). */
export async function loraTrainer(device, weights = {}) {
  await Promise.all(kernels.map(k => prepareKernel(device, k)));
  const first = {};
  for (const [module, layer] of Object.entries(weights))
    for (const part of ["a", "b"]) if (layer?.[part]) first[`${module}.${part}`] = layer[part];
  const own = {};
  for (const [name, info] of Object.entries(buffers)) {
    own[name] = device.createBuffer({label: `lora ${name}`, size: Math.max(16, info.bytes),
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST});
    const data = first[name] ?? (info.init ? bytesOfBase64(info.init) : null);
    if (data) {
      if (data.byteLength !== info.bytes)
        throw new Error(`loraTrainer: ${name} has ${data.byteLength} bytes, needs ${info.bytes}`);
      device.queue.writeBuffer(own[name], 0, data);
    }
  }
  const readLayer = async (module, l) => {
    const [a, b] = await Promise.all([readBack(device, own[l.a], buffers[l.a].bytes),
                                      readBack(device, own[l.b], buffers[l.b].bytes)]);
    return {a: new Float32Array(a), b: new Float32Array(b), rank: l.rank, inDim: l.inDim,
            outDim: l.outDim, alpha: l.alpha, scale: l.scale};
  };
  let taken = 0;
  return {
    config,
    get steps() { return taken; },
    step(inputs) {
      const bound = {...own};
      for (const what of config.given) {
        const value = inputs?.[what];
        if (value instanceof GPUBuffer) { bound[what] = value; continue; }
        checkInput(what, value);
        device.queue.writeBuffer(own[what], 0, value);
      }
      const enc = device.createCommandEncoder({label: "loraTrainer step"});
      let pass = null;
      for (const step of steps) {
        if (step.copy) {
          if (pass) { pass.end(); pass = null; }
          const [src, dst, n] = step.copy;
          enc.copyBufferToBuffer(bound[src], 0, bound[dst], 0, n);
          continue;
        }
        pass ??= enc.beginComputePass({label: "loraTrainer step"});
        const use = {};
        for (const [binding, name] of Object.entries(step.buffers)) use[binding] = bound[name];
        encodeKernel(pass, device, kernels[step.kernel], use, step.grid);
      }
      if (pass) pass.end();
      device.queue.submit([enc.finish()]);
      taken += 1;
    },
    /** The last step's loss (reads back: waits for the GPU). */
    async loss() {
      if (!taken) throw new Error("loraTrainer.loss: no step taken yet; call step(...) first");
      const {kind, buffer, count, classes} = config.loss;
      const sums = new Float32Array(await readBack(device, own[buffer], buffers[buffer].bytes));
      let total = 0;
      for (let k = 0; k < sums.length; k++) {
        if (kind === "xent" && sums[k] < 0)
          throw new Error(`labels: label ${-sums[k] - 1} at token ${k} is outside ` +
                          `0..${classes - 1} (the output has ${classes} classes)`);
        total += sums[k];
      }
      return total / count;
    },
    /** Every adapter now: {module: {a, b, rank, inDim, outDim, alpha, scale}}. */
    async adapters() {
      const out = {};
      for (const [module, l] of Object.entries(config.adapters))
        out[module] = await readLayer(module, l);
      return out;
    },
    /** The (first) adapter now, for writePeftAdapter({name: ...}). */
    async adapter() {
      const [module, l] = Object.entries(config.adapters)[0];
      return readLayer(module, l);
    },
    /** Free every buffer the trainer made. */
    destroy() { for (const buf of Object.values(own)) buf.destroy(); },
  };
}
"""

TRAIN_DTS = """export interface Layer { a: Float32Array; b: Float32Array; rank: number;
  inDim: number; outDim: number; alpha: number; scale: number; }
export declare const config: { tokens: number; alpha: number; scale: number;
  optimizer: "adamw" | "sgd"; lr: number; given: string[];
  loss: { kind: "mse" | "xent"; buffer: string; count: number; classes: number };
  adapters: Record<string, { a: string; b: string; rank: number; inDim: number;
    outDim: number; alpha: number; scale: number }>; features: string[] };
export interface LoraTrainer {
  readonly config: typeof config;
  readonly steps: number;
  step(inputs: Record<string, Float32Array | Uint32Array | GPUBuffer>): void;
  loss(): Promise<number>;
  adapters(): Promise<Record<string, Layer>>;
  adapter(): Promise<Layer>;
  destroy(): void;
}
export function loraTrainer(device: GPUDevice,
  weights?: Record<string, { a?: Float32Array; b?: Float32Array }>): Promise<LoraTrainer>;
"""


# ---------------------------------------------------------------- the digits page

@dataclass(frozen=True)
class DigitsRun:
    """The fine-tuning the page runs: python -m lora train's task and defaults."""

    steps: int = 200
    batch: int = 64
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-2
    warmup: int = 10
    max_grad_norm: float = 1.0
    seed: int = 0


def record_digits(run: DigitsRun) -> tuple[Recording, dict]:
    """One step of python -m lora train's DigitsTrainer (both layers' LoRA,
    the frozen network, cross-entropy, AdamW with clipping and a cosine
    schedule), recorded; and the page's data: the images, labels, the batch
    order and the base network (float32, as the GPU holds it)."""
    from . import digits as D
    from .finetune import DigitsTrainer
    from .train_cli import optimizer_settings

    data = D.load(run.seed)
    base = D.train_base(data, run.seed)
    dev = _Recorder()
    settings = optimizer_settings(run.lr, run.max_grad_norm, "cosine", run.warmup, run.steps)
    trainer = DigitsTrainer(dev, base, D.init_adapters(run.rank, run.seed), run.alpha / run.rank,
                            run.batch, AdamW(**settings))
    trainer.record()
    named = {"x": trainer.bufs["x"], "labels": trainer.bufs["labels"],
             "losses": trainer.bufs["losses"],
             **{f"{m}.{p}": getattr(w, p) for m, w in trainer.weights.items() for p in "ab"},
             **{f"base.{k}": buf for k, buf in trainer.base.items()}}
    scale = run.alpha / run.rank
    config = {"tokens": run.batch, "alpha": run.alpha, "scale": scale, "optimizer": "adamw",
              "lr": run.lr, "given": ["x", "labels"],
              "loss": {"kind": "xent", "buffer": "losses", "count": run.batch, "classes": 10},
              "adapters": {m: _layer(m, w, run.alpha, scale) for m, w in trainer.weights.items()}}
    order = np.stack(D.batches(len(data.train_y), run.batch, run.steps, run.seed))
    b64 = lambda a: base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")  # noqa: E731
    page = {"steps": run.steps, "batch": run.batch, "hidden": D.HIDDEN, "seed": run.seed,
            "train": b64(np.rint(data.train_x * 16).astype(np.uint8)),
            "trainLabels": b64(data.train_y.astype(np.uint8)),
            "test": b64(np.rint(data.test_x * 16).astype(np.uint8)),
            "testLabels": b64(data.test_y.astype(np.uint8)),
            "order": b64(order.astype(np.uint16))}
    return Recording(dev, named, config), page


def digits_page(run: DigitsRun, command: str = "") -> str:
    """The self-contained page: the training module and lora_adapter.js inlined,
    the digits embedded; it trains, plots, measures and offers the adapter."""
    from .web_adapter import ADAPTER_JS

    rec, page = record_digits(run)
    return (DIGITS_HTML.replace("/*TRAIN*/", module_js(rec, command))
            .replace("/*ADAPTER*/", ADAPTER_JS).replace("/*PAGE*/", json.dumps(page)))


DIGITS_HTML = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>LoRA fine-tuning in WebGPU</title>
<style>
 body { font: 15px/1.45 system-ui, sans-serif; margin: 24px 32px; color: #1b1f24; max-width: 860px; }
 h1 { font-size: 22px; margin: 0 0 4px; } .sub { color: #57606a; margin: 0 0 16px; }
 td, th { border: 1px solid #d0d7de; padding: 4px 10px; text-align: left; }
 table { border-collapse: collapse; margin: 10px 0 14px; } th { background: #f6f8fa; }
 td.n { text-align: right; font-variant-numeric: tabular-nums; }
 #verdict { font-weight: 600; padding: 8px 12px; border-radius: 6px; display: inline-block; }
 .ok { background: #dafbe1; color: #116329; } .bad { background: #ffebe9; color: #a40e26; }
 .wait { background: #fff8c5; color: #7d4e00; } canvas { border: 1px solid #d0d7de; }
</style></head>
<body>
<h1>LoRA fine-tuning in WebGPU</h1>
<p class="sub">A frozen digits network (64 &rarr; 64 &rarr; 10, trained on the digits 0-4 only)
gets LoRA adapters on both layers, fine-tuned here on all ten digits by this browser's
WebGPU: forward, softmax cross-entropy, backward and AdamW, one submit a step. The data
never leaves the page.</p>
<div id="verdict" class="wait">training&hellip;</div>
<p><canvas id="curve" width="720" height="260"></canvas></p>
<table id="facts"></table>
<p id="download"></p>
<script type="module">
/*ADAPTER*/
/*TRAIN*/
// ---- the page
const page = /*PAGE*/;
const $ = id => document.getElementById(id);
const u8 = bytesOfBase64;
const images = (text, n) => Float32Array.from(u8(text), v => v / 16);
const f32 = name => buffers[name].init ? new Float32Array(u8(buffers[name].init).buffer)
                                        : new Float32Array(buffers[name].bytes / 4);  // zeros

function logits(x, labels, adapters) {
  // the network in float64: z1 = x W1^T + b1 + s B1 A1 x, relu, logits likewise
  const H = page.hidden, n = labels.length, w1 = f32("base.w1"), b1 = f32("base.b1"),
        w2 = f32("base.w2"), b2 = f32("base.b2"), s = config.scale;
  const layer = (inp, inDim, W, bias, outDim, ad) => {
    const out = new Float64Array(outDim);
    const h = ad ? new Float64Array(ad.rank) : null;
    if (ad) for (let r = 0; r < ad.rank; r++)
      for (let i = 0; i < inDim; i++) h[r] += ad.a[r * inDim + i] * inp[i];
    for (let o = 0; o < outDim; o++) {
      let v = bias[o];
      for (let i = 0; i < inDim; i++) v += W[o * inDim + i] * inp[i];
      if (ad) for (let r = 0; r < ad.rank; r++) v += s * ad.b[o * ad.rank + r] * h[r];
      out[o] = v;
    }
    return out;
  };
  let right = 0;
  for (let k = 0; k < n; k++) {
    const z = layer(x.subarray(k * 64, k * 64 + 64), 64, w1, b1, H, adapters?.fc1);
    const y = z.map(v => Math.max(v, 0));
    const l = layer(y, H, w2, b2, 10, adapters?.fc2);
    right += l.indexOf(Math.max(...l)) === labels[k];
  }
  return right / n;
}

function draw(losses) {
  const c = $("curve"), g = c.getContext("2d"), W = c.width, Hh = c.height, pad = 36;
  g.clearRect(0, 0, W, Hh);
  g.font = "12px system-ui"; g.fillStyle = "#57606a";
  const top = Math.log(Math.max(...losses)), low = Math.log(Math.min(...losses));
  g.fillText("cross-entropy (log scale) per step", pad, 16);
  g.fillText(`${Math.exp(top).toFixed(3)}`, 2, pad); g.fillText(`${Math.exp(low).toFixed(3)}`, 2, Hh - 8);
  g.strokeStyle = "#0969da"; g.lineWidth = 2; g.beginPath();
  losses.forEach((v, k) => {
    const px = pad + (W - pad - 8) * k / Math.max(1, page.steps - 1);
    const py = pad + (Hh - 2 * pad) * (top - Math.log(v)) / Math.max(1e-9, top - low);
    k ? g.lineTo(px, py) : g.moveTo(px, py);
  });
  g.stroke();
}

async function main() {
  const adapter = await navigator.gpu?.requestAdapter();
  if (!adapter) throw new Error("this browser has no WebGPU adapter");
  const device = await adapter.requestDevice();
  const train = images(page.train), trainLabels = u8(page.trainLabels);
  const test = images(page.test), testLabels = u8(page.testLabels);
  const order = new Uint16Array(u8(page.order).buffer);
  const trainer = await loraTrainer(device);
  const before = logits(test, testLabels, null);
  const x = new Float32Array(page.batch * 64), labels = new Uint32Array(page.batch);
  const losses = [];
  const t0 = performance.now();
  for (let s = 0; s < page.steps; s++) {
    for (let k = 0; k < page.batch; k++) {
      const i = order[s * page.batch + k];
      x.set(train.subarray(i * 64, i * 64 + 64), k * 64);
      labels[k] = trainLabels[i];
    }
    trainer.step({x, labels});
    losses.push(await trainer.loss());
    if (s % 10 === 9 || s === page.steps - 1) { draw(losses); await new Promise(r => setTimeout(r)); }
  }
  const stepMs = (performance.now() - t0) / page.steps;
  const adapters = await trainer.adapters();
  const after = logits(test, testLabels, adapters);
  const files = writePeftAdapter(adapters, {alpha: config.alpha, targetModules: ["fc1", "fc2"]});
  const link = (name, data, type) => {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([data], {type}));
    a.download = name; a.textContent = `download ${name}`; a.style.marginRight = "16px";
    return a;
  };
  $("download").append(link("adapter_config.json", files.config, "application/json"),
                       link("adapter_model.safetensors", files.tensors, "application/octet-stream"));
  $("facts").innerHTML = [["adapter", (adapter.info?.description || adapter.info?.vendor || "?")],
    ["steps x images", `${page.steps} x ${page.batch}`], ["rank, alpha", `${config.adapters.fc1.rank}, ${config.alpha}`],
    ["loss", `${losses[0].toFixed(4)} → ${losses.at(-1).toFixed(4)}`],
    ["test accuracy (297 images)", `${(100 * before).toFixed(1)}% → ${(100 * after).toFixed(1)}%`],
    ["time per step (one loss read each)", `${stepMs.toFixed(1)} ms`]]
    .map(([k, v]) => `<tr><th>${k}</th><td class="n">${v}</td></tr>`).join("");
  $("verdict").className = after > before ? "ok" : "bad";
  $("verdict").textContent = after > before ? "trained: the adapter learned the digits 5-9"
                                            : "the adapter did not help";
  window.loraTrainDemo = {ok: after > before, losses, accuracyBefore: before, accuracyAfter: after,
                          stepMs, config: files.config, tensors: files.tensors.toBase64()};
}
main().catch(e => {
  $("verdict").className = "bad"; $("verdict").textContent = `error: ${e.message}`;
  window.loraTrainDemo = {ok: false, error: String(e.stack || e)};
});
</script>
</body></html>
"""
