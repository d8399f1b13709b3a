// ---- the training step: every op of one step into one submit
/** Bytes of base64 text (atob: in every browser and in Node, unlike Uint8Array.fromBase64). */
export function bytesOfBase64(text) {
  const raw = atob(text), out = new Uint8Array(raw.length);
  for (let k = 0; k < raw.length; k++) out[k] = raw.charCodeAt(k);
  return out;
}

/** The usage a given buffer needs: STORAGE, and COPY_SRC / COPY_DST where the step's
 *  copies read or write it. (Asked at a step: WebGPU's globals may come after import.) */
function usageOf(what) {
  let need = GPUBufferUsage.STORAGE;
  for (const [src, dst] of steps.filter(st => st.copy).map(st => st.copy))
    need |= (src === what ? GPUBufferUsage.COPY_SRC : 0) |
            (dst === what ? GPUBufferUsage.COPY_DST : 0);
  return need;
}

function inputText(what) {
  const {dtype, bytes} = buffers[what];
  return `${bytes / 4} ${dtype} values; ${config.tokens} token(s)`;
}

/** One of config.given, checked by the name the caller gave it: a GPUBuffer (usage
 *  and size) or a TypedArray (type and length), before anything is recorded. */
function checkInput(what, value) {
  const {dtype, bytes} = buffers[what];
  if (value instanceof GPUBuffer) {
    const need = usageOf(what);
    const lacking = ["STORAGE", "COPY_SRC", "COPY_DST"]
      .filter(u => need & GPUBufferUsage[u] && !(value.usage & GPUBufferUsage[u]));
    if (lacking.length) throw new Error(`loraTrainer.step: ${what} lacks GPUBufferUsage.` +
                                        lacking.join(" and GPUBufferUsage."));
    if (value.size < bytes) throw new RangeError(`loraTrainer.step: ${what} has ${value.size} ` +
      `bytes, needs ${bytes} (${inputText(what)})`);
    return;
  }
  const Want = dtype === "uint32" ? Uint32Array : Float32Array;
  if (!(value instanceof Want))
    throw new TypeError(`loraTrainer.step: ${what} must be a ${Want.name} (or a GPUBuffer), ` +
                        `got ${value?.constructor?.name ?? typeof value}`);
  if (value.byteLength !== bytes)
    throw new RangeError(`loraTrainer.step: ${what} has ${value.length} values, the trainer ` +
                         `takes ${bytes / 4} (${config.tokens} token(s); a batch of another ` +
                         `size needs its own export)`);
}

/** The mean loss of one step from its loss buffer's sums. xent marks a label outside
 *  the classes with a negative sum: with the sticky record (config.loss.seen), reported
 *  by reportLabels, the mean is over the other tokens (NaN if none), as Python's
 *  loss_value; without it (the digits page), the mark is reported here. */
function meanLoss(sums) {
  const {kind, count, classes, seen} = config.loss;
  let total = 0, kept = 0;
  for (let k = 0; k < sums.length; k++) {
    if (kind === "xent" && sums[k] < 0) {
      if (seen) continue;
      throw new Error(`labels: label ${-sums[k] - 1} at token ${k} is outside ` +
                      `0..${classes - 1} (the output has ${classes} classes)`);
    }
    total += sums[k];
    kept += 1;
  }
  return seen ? (kept ? total / kept : NaN) : total / count;
}

/** The error for the sticky record ``seen`` (u32 [3, tokens]: per token the steps seen,
 *  the first step with a label out of range since the last report, that label), as
 *  Python's losses.report_labels words it; null when no label was out of range. */
function labelsError(seen) {
  const t = config.tokens, classes = config.loss.classes;
  let first = -1, bad = 0;
  for (let k = 0; k < t; k++) {
    if (!seen[t + k]) continue;
    bad += 1;
    if (first < 0 || seen[t + k] < seen[t + first]) first = k;  // the earliest step
  }
  if (!bad) return null;
  return new RangeError(`labels: label ${seen[2 * t + first]} at token ${first} of step ` +
    `${seen[t + first]} (counting this trainer's steps from 1) is outside 0..${classes - 1} ` +
    `(the output has ${classes} classes); that step trained without the token (its ` +
    `gradient was zero); ${bad} token(s) had a label out of range since the last report`);
}

/** {buffer name: values} of ``weights`` ({module: {a, b}}, or readPeftAdapter's layers),
 *  every module one of config.adapters and every part a Float32Array of its size; a
 *  rank, dims or scale given with it must be the trainer's (they are baked into the
 *  step): a module name or a scale that does not fit was ignored before, silently. */
function startingWeights(weights) {
  const modules = Object.keys(config.adapters).join(", ");
  if (weights === null || typeof weights !== "object" || ArrayBuffer.isView(weights))
    throw new TypeError(`loraTrainer: weights must be {module: {a, b}} (modules: ${modules}), ` +
                        `got ${weights === null ? "null" : weights.constructor?.name ?? typeof weights}`);
  const first = {};
  for (const [module, layer] of Object.entries(weights)) {
    const want = config.adapters[module];
    if (!want) throw new RangeError(`loraTrainer: weights name the module ${module}; this ` +
                                    `trainer's are ${modules}`);
    const differ = ["rank", "inDim", "outDim"].filter(key => layer?.[key] !== undefined &&
      layer[key] !== want[key]).map(key => `${key} ${layer[key]} (the trainer's ${want[key]})`);
    if (typeof layer?.scale === "number" && Math.fround(layer.scale) !== Math.fround(want.scale))
      differ.push(`scale ${layer.scale} (the trainer's ${want.scale})`);
    for (const part of ["a", "b"]) {
      const values = layer?.[part], count = buffers[want[part]].bytes / 4;
      if (!(values instanceof Float32Array))
        throw new TypeError(`loraTrainer: weights.${module}.${part} must be a Float32Array ` +
          `(row-major), got ${values?.constructor?.name ?? typeof values}`);
      if (values.length !== count)
        differ.push(`${part} of ${values.length} values (the trainer's ${count})`);
      first[want[part]] = values;
    }
    if (differ.length) throw new RangeError(`loraTrainer: weights.${module} does not fit ` +
      `this trainer: ${differ.join("; ")}. Rank, dims and scale are baked into the step: ` +
      `export one for it (python -m lora export --train ...)`);
  }
  return first;
}

/** A trainer on ``device``: its buffers made and filled (as exported: A and B as peft
 *  initialises them, or ``weights`` {module: {a, b}} of row-major Float32Arrays), every
 *  pipeline compiled. ``step(inputs)`` records one training step into one submit; its
 *  inputs are config.given (each a TypedArray written into the trainer's own buffer, or
 *  a GPUBuffer of that size). */
export async function loraTrainer(device, weights = {}) {
  checkDevice(device, "loraTrainer");
  const first = startingWeights(weights);
  await prepare(device);
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
    const [a, b] = await Promise.all([l.a, l.b].map(name => readBack(device, own[name],
      buffers[name].bytes, `loraTrainer: ${module}'s adapter`)));
    return {a: new Float32Array(a), b: new Float32Array(b), rank: l.rank, inDim: l.inDim,
            outDim: l.outDim, alpha: l.alpha, scale: l.scale};
  };
  const lossBuffer = own[config.loss.buffer], lossBytes = buffers[config.loss.buffer].bytes;
  let history = null, capacity = 0;  // every step's loss sums, copied in the step's submit
  const hyperName = config.optimizer.buffer;
  const {init, bytes: hyperBytes} = buffers[hyperName];
  const hyper = init ? new Float32Array(bytesOfBase64(init).buffer) : new Float32Array(hyperBytes / 4);
  const values = {...config.optimizer.values};
  const grow = enc => {  // twice the steps, the old history copied in the same submit
    const old = history;
    capacity = Math.max(64, 2 * capacity);
    history = device.createBuffer({label: "lora loss history", size: capacity * lossBytes,
                                   usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST});
    if (old) enc.copyBufferToBuffer(old, 0, history, 0, taken * lossBytes);
    return old;
  };
  let taken = 0, destroyed = false;
  /** Throws where the trainer was destroyed: WebGPU would only log a validation error
   *  (a step did nothing, a read gave zeros). */
  const alive = what => {
    if (destroyed) throw new Error(`${what}: this trainer was destroyed (trainer.destroy()); ` +
                                   `make another with loraTrainer`);
  };
  /** With xent: throws for labels outside the classes in any step since the last report
   *  (read from the step's sticky record on the GPU, then cleared), as LayerTrainer's
   *  report_labels; loss(), losses(), adapters() and adapter() call it first. */
  const reportLabels = async () => {
    const name = config.loss.seen;
    if (!name || !taken) return;
    const error = labelsError(new Uint32Array(await readBack(device, own[name],
      buffers[name].bytes, "loraTrainer: the labels' record")));
    if (!error) return;
    // rows 1 and 2 cleared; row 0 (each token's step count) is the kernel's
    device.queue.writeBuffer(own[name], 4 * config.tokens, new Uint32Array(2 * config.tokens));
    throw error;
  };
  return {
    config,
    get steps() { return taken; },
    /** The optimizer's settings now ({lr, weightDecay, ...}, and the schedule). */
    get settings() { return {...values, schedule: config.optimizer.schedule}; },
    /** Change optimizer settings from the next step on (one small write; no kernel is
     *  rebuilt): lr, weightDecay, beta1, beta2, eps (or momentum), warmup, total,
     *  minRatio, maxGradNorm (clipping stays on or off as exported). */
    set(changes) {
      alive("loraTrainer.set");
      checkSettings(changes, values, "loraTrainer.set");
      for (const [key, value] of Object.entries(changes)) {
        values[key] = value;
        hyper[config.optimizer.index[key]] = value;
      }
      device.queue.writeBuffer(own[hyperName], 0, hyper);
    },
    step(inputs) {
      checkDevice(device, "loraTrainer.step");
      alive("loraTrainer.step");
      const bound = {...own};
      const unknown = Object.keys(inputs ?? {}).filter(key => !config.given.includes(key));
      if (unknown.length) throw new TypeError(`loraTrainer.step: no input named ` +
        `${unknown.join(", ")}; it takes ${config.given.join(", ")}`);
      for (const what of config.given) checkInput(what, inputs?.[what]);
      for (const what of config.given) {
        const value = inputs[what];
        if (value instanceof GPUBuffer) bound[what] = value;
        else device.queue.writeBuffer(own[what], 0, value);
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
      const old = taken === capacity ? grow(enc) : null;
      enc.copyBufferToBuffer(lossBuffer, 0, history, taken * lossBytes, lossBytes);
      device.queue.submit([enc.finish()]);
      old?.destroy();
      taken += 1;
    },
    /** The last step's loss (reads back: waits for the GPU); labels out of range in
     *  any step since the last report throw here first. */
    async loss() {
      alive("loraTrainer.loss");
      if (!taken) throw new Error("loraTrainer.loss: no step taken yet; call step(...) first");
      await reportLabels();
      return meanLoss(new Float32Array(await readBack(device, lossBuffer, lossBytes,
                                                               "loraTrainer.loss")));
    },
    /** The loss of every step taken, from a history the steps keep on the GPU (one
     *  read back, here; none per step). */
    async losses() {
      alive("loraTrainer.losses");
      if (!taken) return [];
      await reportLabels();
      const sums = new Float32Array(await readBack(device, history, taken * lossBytes,
                                                             "loraTrainer.losses"));
      const per = lossBytes / 4;
      return Array.from({length: taken}, (_, k) => meanLoss(sums.subarray(k * per, (k + 1) * per)));
    },
    /** Every adapter now: {module: {a, b, rank, inDim, outDim, alpha, scale}}. */
    async adapters() {
      alive("loraTrainer.adapters");
      await reportLabels();
      const out = {};
      for (const [module, l] of Object.entries(config.adapters))
        out[module] = await readLayer(module, l);
      return out;
    },
    /** The (first) adapter now, for writePeftAdapter({name: ...}). */
    async adapter() {
      alive("loraTrainer.adapter");
      await reportLabels();
      const [module, l] = Object.entries(config.adapters)[0];
      return readLayer(module, l);
    },
    /** Free every buffer the trainer made; any later call throws. */
    destroy() {
      for (const buf of [...Object.values(own), history]) buf?.destroy();
      destroyed = true;
    },
  };
}
