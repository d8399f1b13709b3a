// ---- the forward: every step into one compute pass
const scratchOf = new WeakMap();  // GPUDevice -> {h, y}
const prepared = new WeakMap();   // GPUDevice -> Promise of every pipeline

/** Compile every kernel's pipeline (once per device); rejects on WGSL errors. */
export function prepare(device) {
  if (!prepared.has(device))
    prepared.set(device, Promise.all(kernels.map(k => prepareKernel(device, k))));
  return prepared.get(device);
}

function checkBuffers(given) {
  for (const name of ["x", "a", "b", "output"]) {
    const buf = given[name];
    if (!(buf instanceof GPUBuffer)) throw new Error(`loraForward: ${name} must be a GPUBuffer`);
    if (buf.size < sizes[name]) throw new Error(`loraForward: ${name} has ${buf.size} bytes, ` +
      `needs ${sizes[name]} (${config.dtype}, rank ${config.rank}, in ${config.inDim}, ` +
      `out ${config.outDim}, ${config.tokens} token(s))`);
    if (name !== "output" && buf === given.output)
      throw new Error(`loraForward: output is also the ${name} buffer`);
  }
}

function scratch(device) {
  let s = scratchOf.get(device);
  if (!s) {
    s = {};
    const used = new Set(steps.flatMap(step => Object.values(step.buffers)));
    for (const name of ["h", "y"].filter(n => used.has(n)))
      s[name] = device.createBuffer({label: `lora ${name}`, size: Math.max(16, sizes[name]),
                                     usage: GPUBufferUsage.STORAGE});
    scratchOf.set(device, s);
  }
  return s;
}

/** output += scale * B @ (A @ x): GPUBuffers x [tokens, inDim], a [rank, inDim],
 *  b [outDim, rank], output [tokens, outDim] (row-major, config.dtype). Submits
 *  unless given an ``encoder``; resolves once the work is queued. */
export async function loraForward(device, {x, a, b, output}, {encoder = null} = {}) {
  const given = {x, a, b, output};
  checkBuffers(given);
  await prepare(device);
  const all = {...given, ...scratch(device)};
  const enc = encoder || device.createCommandEncoder({label: "loraForward"});
  const pass = enc.beginComputePass({label: `loraForward ${config.strategy}`});
  for (const step of steps) {
    const buffers = {};
    for (const [binding, role] of Object.entries(step.buffers)) buffers[binding] = all[role];
    encodeKernel(pass, device, kernels[step.kernel], buffers, step.grid);
  }
  pass.end();
  if (!encoder) device.queue.submit([enc.finish()]);
}
