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

GIVEN = ("x", "target", "base", "output")  # the buffers a step is given (or copied into)


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


def record_step(shape: TrainShape) -> tuple[list, dict, "_Recorder"]:
    """(ops, names, device) of one training step: ops as _Recorder lists them,
    names: id(buffer) -> (name, buffer) (x, output, base, target, a, b, loss_sums
    and buf<k> for the rest), and the device holding their first contents."""
    dev = _Recorder()
    a, b = R.init_lora(shape.in_dim, shape.out_dim, shape.rank, seed=shape.seed)
    weight = Weight.from_numpy(dev, a, b)
    make = AdamW if shape.optimizer == "adamw" else SGD
    opt = make(lr=shape.lr, max_grad_norm=shape.max_grad_norm)
    trainer = LayerTrainer(dev, weight, shape.scale, shape.tokens, opt, loss=shape.loss)
    f32, t = np.float32, shape.tokens
    given = {"x": dev.empty((t, shape.in_dim), f32), "output": dev.empty((t, shape.out_dim), f32),
             "base": dev.empty((t, shape.out_dim), f32),
             "target": dev.empty((t, shape.out_dim), f32) if shape.loss == "mse"
             else dev.empty(t, np.uint32)}
    trainer.record(given["x"], given["output"], given["target"], given["base"])
    names = {id(buf): (role, buf) for role, buf in given.items()}
    names.update({id(weight.a): ("a", weight.a), id(weight.b): ("b", weight.b)})
    sums = trainer.loss_plan.scratch["partial" if shape.loss == "mse" else "losses"]
    names[id(sums)] = ("loss_sums", sums)
    for op in dev.ops:
        for buf in (op[2] if op[0] == "dispatch" else op[1:3]):
            if id(buf) not in names:
                names[id(buf)] = (f"buf{len(names)}", buf)
    return dev.ops, names, dev


def _steps(ops, names) -> tuple[list, list]:
    """(kernels, steps) for the module: each distinct Kernel once; a dispatch as
    its kernel's index, grid and buffer per binding; a copy as [src, dst, bytes]."""
    kernels, steps = [], []
    for op in ops:
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
    return kernels, steps


def module_js(shape: TrainShape, command: str = "") -> str:
    """The ES module: config, buffers, kernels, steps, the runtime, loraTrainer."""
    ops, names, dev = record_step(shape)
    kernels, steps = _steps(ops, names)
    buffers = {}
    for name, buf in names.values():
        first = dev.read(buf)
        buffers[name] = {"bytes": int(first.nbytes), "dtype": first.dtype.name,
                         "init": None if name in GIVEN or not first.any()
                         else base64.b64encode(first.tobytes()).decode("ascii")}
    config = {"rank": shape.rank, "inDim": shape.in_dim, "outDim": shape.out_dim,
              "tokens": shape.tokens, "alpha": shape.alpha, "scale": shape.scale,
              "loss": shape.loss, "optimizer": shape.optimizer, "lr": shape.lr,
              "maxGradNorm": shape.max_grad_norm, "seed": shape.seed,
              "features": sorted({f for k in kernels for f in kernel_info(k)["features"]})}
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
const bytesOf = text => Uint8Array.fromBase64(text);

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

function checkArray(what, value, dtype, bytes) {
  const Want = dtype === "uint32" ? Uint32Array : Float32Array;
  if (!(value instanceof Want))
    throw new Error(`loraTrainer.step: ${what} must be a ${Want.name} (or a GPUBuffer), got ` +
                    `${value?.constructor?.name ?? typeof value}`);
  if (value.byteLength !== bytes)
    throw new Error(`loraTrainer.step: ${what} has ${value.length} values, the trainer takes ` +
                    `${bytes / 4} (${config.tokens} token(s); a batch of another size needs ` +
                    `its own export)`);
}

/** A trainer on ``device``: its buffers made and filled (A and B from ``a`` and ``b``,
 *  row-major Float32Arrays, else as exported: peft's initialisation), every pipeline
 *  compiled. ``step({x, target, base})`` records one training step into one submit:
 *  x [tokens, inDim], base [tokens, outDim] (the frozen layer's output for this
 *  batch), target [tokens, outDim] for mse or u32 labels [tokens] for xent, each a
 *  TypedArray (written into the trainer's own buffer) or a GPUBuffer of that size. */
export async function loraTrainer(device, {a = null, b = null} = {}) {
  await Promise.all(kernels.map(k => prepareKernel(device, k)));
  const own = {};
  for (const [name, info] of Object.entries(buffers)) {
    own[name] = device.createBuffer({label: `lora ${name}`, size: Math.max(16, info.bytes),
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST});
    const first = name === "a" && a ? a : name === "b" && b ? b :
                  info.init ? bytesOf(info.init) : null;
    if (first) {
      if (first.byteLength !== info.bytes)
        throw new Error(`loraTrainer: ${name} has ${first.byteLength} bytes, needs ${info.bytes}`);
      device.queue.writeBuffer(own[name], 0, first);
    }
  }
  let taken = 0;
  return {
    config,
    get steps() { return taken; },
    step({x, target, base}) {
      const bound = {...own};
      for (const [what, value] of Object.entries({x, target, base})) {
        if (value instanceof GPUBuffer) { bound[what] = value; continue; }
        checkArray(what, value, buffers[what].dtype, buffers[what].bytes);
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
      const sums = new Float32Array(await readBack(device, own.loss_sums,
                                                   buffers.loss_sums.bytes));
      let total = 0;
      for (let k = 0; k < sums.length; k++) {
        if (config.loss === "xent" && sums[k] < 0)
          throw new Error(`labels: label ${-sums[k] - 1} at token ${k} is outside ` +
                          `0..${config.outDim - 1} (the output has ${config.outDim} classes)`);
        total += sums[k];
      }
      return config.loss === "mse" ? total / (config.tokens * config.outDim)
                                   : total / config.tokens;
    },
    /** The adapter now: {a, b, rank, inDim, outDim, alpha, scale} (for writePeftAdapter). */
    async adapter() {
      const [ab, bb] = await Promise.all([readBack(device, own.a, buffers.a.bytes),
                                          readBack(device, own.b, buffers.b.bytes)]);
      return {a: new Float32Array(ab), b: new Float32Array(bb), rank: config.rank,
              inDim: config.inDim, outDim: config.outDim, alpha: config.alpha,
              scale: config.scale};
    },
    /** Free every buffer the trainer made. */
    destroy() { for (const buf of Object.values(own)) buf.destroy(); },
  };
}
"""

TRAIN_DTS = """export declare const config: { rank: number; inDim: number; outDim: number;
  tokens: number; alpha: number; scale: number; loss: "mse" | "xent";
  optimizer: "adamw" | "sgd"; lr: number; maxGradNorm: number | null; seed: number;
  features: string[] };
export interface LoraTrainer {
  readonly config: typeof config;
  readonly steps: number;
  step(batch: { x: Float32Array | GPUBuffer; target: Float32Array | Uint32Array | GPUBuffer;
                base: Float32Array | GPUBuffer }): void;
  loss(): Promise<number>;
  adapter(): Promise<{ a: Float32Array; b: Float32Array; rank: number; inDim: number;
                       outDim: number; alpha: number; scale: number }>;
  destroy(): void;
}
export function loraTrainer(device: GPUDevice, weights?: { a?: Float32Array | null;
  b?: Float32Array | null }): Promise<LoraTrainer>;
"""
