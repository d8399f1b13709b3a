// ---- the forward: every step into one compute pass
const ownOf = new WeakMap();      // GPUDevice -> {h, y, and x, a, b, output where arrays came}
const INPUTS = ["x", "a", "b", "output", "adapter"];
const ITEM = config.dtype === "f16" ? 2 : 4;
const SHAPES = {x: ["tokens", "inDim"], a: ["rank", "inDim"], b: ["outDim", "rank"],
                output: ["tokens", "outDim"]};

function shapeText(name) {
  const [rows, cols] = SHAPES[name];
  return `[${rows} ${config[rows]}, ${cols} ${config[cols]}] ${config.dtype}`;
}

/** Throws, naming what differs, unless ``layer`` (readPeftAdapter's {a, b, rank, inDim,
 *  outDim, scale}) is the adapter this module was exported for: its rank and dims, and
 *  its scale as the f32 the kernels hold (alpha / r, or alpha / sqrt(r) for rslora). */
export function checkAdapter(layer, what = "adapter") {
  if (layer === null || typeof layer !== "object" || !ArrayBuffer.isView(layer.a) ||
      !ArrayBuffer.isView(layer.b))
    throw new TypeError(`loraForward: ${what} must be a layer {a, b, rank, inDim, outDim, ` +
                        `scale} as readPeftAdapter returns, a and b TypedArrays`);
  const differ = [];
  for (const key of ["rank", "inDim", "outDim"])
    if (layer[key] !== config[key]) differ.push(`${key} ${layer[key]} (the module's ${config[key]})`);
  if (typeof layer.scale !== "number" || Math.fround(layer.scale) !== Math.fround(config.scale))
    differ.push(`scale ${layer.scale} (the module's ${config.scale}: alpha / r, or alpha / ` +
                `sqrt(r) with rslora)`);
  for (const part of ["a", "b"]) {
    const want = sizes[part] / ITEM;
    if (layer[part].length !== want)
      differ.push(`${part} of ${layer[part].length} values (the module's ${want}: ` +
                  `${shapeText(part)})`);
  }
  if (differ.length)
    throw new RangeError(`loraForward: ${what} does not fit this module: ${differ.join("; ")}. ` +
      `Rank, dims and scale are baked into the kernels: export a module for it (python -m ` +
      `lora export --rank ${layer.rank} --in-dim ${layer.inDim} --out-dim ${layer.outDim} ` +
      `--scale ${layer.scale} ...)`);
}

/** An argument given as a TypedArray, as the buffer stores it (f32, or f16 bits). */
function storedArray(name, value) {
  const ok = value instanceof Float32Array || (ITEM === 2 && value instanceof Uint16Array);
  if (!ok) throw new TypeError(`loraForward: ${name} must be a GPUBuffer or a Float32Array` +
    `${ITEM === 2 ? " (or a Uint16Array of float16 bits)" : ""}, got ` +
    `${value?.constructor?.name ?? typeof value}`);
  const want = sizes[name] / ITEM;
  if (value.length !== want)
    throw new RangeError(`loraForward: ${name} has ${value.length} values, the module takes ` +
                         `${want} (${shapeText(name)})`);
  return ITEM === 4 || value instanceof Uint16Array ? value : Uint16Array.from(value, halfBits);
}

function checkBuffer(name, buf, given) {
  if (!(buf.usage & GPUBufferUsage.STORAGE))
    throw new Error(`loraForward: ${name} lacks GPUBufferUsage.STORAGE`);
  if (buf.size < sizes[name]) throw new RangeError(`loraForward: ${name} has ${buf.size} ` +
    `bytes, needs ${sizes[name]} (${shapeText(name)}, ${config.tokens} token(s))`);
  if (name !== "output" && buf === given.output)
    throw new Error(`loraForward: output is also the ${name} buffer`);
}

function own(device, name, bytes) {
  let s = ownOf.get(device);
  if (!s) ownOf.set(device, s = {});
  s[name] ??= device.createBuffer({label: `lora ${name}`, size: Math.max(16, bytes),
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC});
  return s[name];
}

/** {x, a, b, output} as GPUBuffers: arrays checked and written into the module's own
 *  buffers, GPUBuffers checked; every check before anything is written. */
function bound(device, inputs) {
  const given = {...inputs};
  if (given.adapter !== undefined) {
    if (given.a !== undefined || given.b !== undefined)
      throw new Error("loraForward: give adapter, or a and b, not both");
    checkAdapter(given.adapter);
    [given.a, given.b] = [given.adapter.a, given.adapter.b];
  }
  const arrays = {};
  for (const name of ["x", "a", "b", "output"]) {
    const value = given[name];
    if (value instanceof GPUBuffer) checkBuffer(name, value, given);
    else arrays[name] = storedArray(name, value);
  }
  const all = {...given};
  for (const [name, values] of Object.entries(arrays)) {
    all[name] = own(device, name, sizes[name]);
    device.queue.writeBuffer(all[name], 0, values);
  }
  const used = new Set(steps.flatMap(step => Object.values(step.buffers)));
  for (const name of ["h", "y"].filter(n => used.has(n))) all[name] = own(device, name, sizes[name]);
  return all;
}

/** output += scale * B @ (A @ x): x [tokens, inDim], a [rank, inDim], b [outDim, rank],
 *  output [tokens, outDim] (row-major, config.dtype), each a GPUBuffer or a TypedArray
 *  (written into the module's own buffer); or ``adapter`` (readPeftAdapter's layer,
 *  checked by checkAdapter) instead of a and b. Submits unless given an ``encoder``;
 *  resolves once the work is queued, or, where output is a TypedArray, with the new
 *  output read back (a new array; the one given is left as it was). */
export async function loraForward(device, inputs, {encoder = null} = {}) {
  checkDevice(device, "loraForward");
  if (inputs === null || typeof inputs !== "object")
    throw new TypeError("loraForward: expected {x, a, b, output} or {x, adapter, output}");
  const unknown = Object.keys(inputs).filter(key => !INPUTS.includes(key));
  if (unknown.length) throw new TypeError(`loraForward: no input named ${unknown.join(", ")}; ` +
                                          `it takes x, output and a, b (or adapter)`);
  if (encoder && !(inputs.output instanceof GPUBuffer))
    throw new Error("loraForward: with an encoder, output must be a GPUBuffer (an array's " +
                    "result is read back after a submit of the module's own)");
  await prepare(device);
  const all = bound(device, inputs);
  const enc = encoder || device.createCommandEncoder({label: "loraForward"});
  const pass = enc.beginComputePass({label: `loraForward ${config.strategy}`});
  for (const step of steps) {
    const buffers = {};
    for (const [binding, role] of Object.entries(step.buffers)) buffers[binding] = all[role];
    encodeKernel(pass, device, kernels[step.kernel], buffers, step.grid);
  }
  pass.end();
  if (!encoder) device.queue.submit([enc.finish()]);
  if (inputs.output instanceof GPUBuffer) return;
  const out = await readBack(device, all.output, sizes.output, "loraForward");
  return ITEM === 2 ? new Uint16Array(out) : new Float32Array(out);
}
