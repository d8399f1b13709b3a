// ---- what the LoRA modules share (web_assets/common.mjs, written into each module)
const prepared = new WeakMap();  // GPUDevice -> Promise of every pipeline

const lostOf = new WeakMap();  // GPUDevice -> its GPUDeviceLostInfo once lost (null before)

/** Throws, in the caller's words (``what``), unless ``device`` is a GPUDevice not known to
 *  be lost, given the module's features: undefined, a Promise (a call before ``await
 *  adapter.requestDevice()``) or a destroyed device would otherwise fail deep inside
 *  WebGPU, or silently, and a missing feature be named by the first kernel needing it. */
function checkDevice(device, what) {
  if (device === null || typeof device !== "object" ||
      typeof device.createBuffer !== "function" || !device.queue) {
    const got = typeof device?.then === "function" ? "a Promise (await adapter.requestDevice() " +
      "before passing the device)" : device === null ? "null" :
      device?.constructor?.name ?? typeof device;
    throw new TypeError(`${what}: device must be a GPUDevice (from await ` +
                        `adapter.requestDevice()), got ${got}`);
  }
  if (!lostOf.has(device)) {
    lostOf.set(device, null);
    device.lost?.then(info => lostOf.set(device, info));
  }
  const info = lostOf.get(device);
  if (info) throw lostError(what, info);
  const missing = config.features.filter(f => !device.features?.has(f));
  if (missing.length) throw new Error(`${what}: this module needs the WebGPU feature(s) ` +
    `${missing.join(", ")}, which the device was not given: request them with ` +
    `adapter.requestDevice({requiredFeatures: ${JSON.stringify(missing)}}) where ` +
    `adapter.features has them` + (missing.includes("shader-f16") ? "; where it has not " +
    "(SwiftShader, some GPUs), export the module with --dtype f32" : ""));
}

function lostError(what, info) {
  return new Error(`${what}: the GPUDevice was lost (${info.reason ?? "unknown"}` +
    `${info.message ? `: ${info.message}` : ""}); its buffers and pipelines are gone: ` +
    `request a new device and make the trainer, pool or inputs again`);
}

/** ``buffer.mapAsync(READ)``; where it fails because the device was lost (WebGPU rejects
 *  with an empty AbortError), the error says so. */
async function mapRead(device, buffer, what) {
  try {
    await buffer.mapAsync(GPUMapMode.READ);
  } catch (error) {
    const info = await Promise.race([device.lost, Promise.resolve(null)]);
    if (info) throw lostError(what, info);
    throw error;
  }
}

/** Compile every kernel's pipeline (once per device); rejects on WGSL errors. */
export function prepare(device) {
  checkDevice(device, "prepare");
  if (!prepared.has(device))
    prepared.set(device, Promise.all(kernels.map(k => prepareKernel(device, k))));
  return prepared.get(device);
}

/** The first ``bytes`` of ``buffer``, copied to the host in a submit of their own. */
async function readBack(device, buffer, bytes, label = "lora read") {
  const staging = device.createBuffer({size: bytes, usage: GPUBufferUsage.MAP_READ |
                                                           GPUBufferUsage.COPY_DST});
  const enc = device.createCommandEncoder({label});
  enc.copyBufferToBuffer(buffer, 0, staging, 0, bytes);
  device.queue.submit([enc.finish()]);
  await mapRead(device, staging, label);
  const out = staging.getMappedRange().slice(0);
  staging.unmap();
  staging.destroy();
  return out;
}

const one = new Float32Array(1), oneBits = new Uint32Array(one.buffer);

/** The float16 bits nearest ``value`` (ties to even), as numpy's astype(float16). */
export function halfBits(value) {
  one[0] = value;
  const x = oneBits[0], sign = (x >>> 16) & 0x8000, exp = (x >>> 23) & 0xff, man = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (man ? 0x200 : 0);  // infinity, NaN
  const e = exp - 112;  // the float16 exponent field
  if (e >= 31) return sign | 0x7c00;
  const [m, shift] = e > 0 ? [man, 13] : [man | 0x800000, 14 - e];  // subnormal: the hidden bit
  if (shift > 24) return sign;
  const rest = m % 2 ** shift, half = 2 ** (shift - 1);
  let h = (e > 0 ? e << 10 : 0) + Math.floor(m / 2 ** shift);
  if (rest > half || (rest === half && h & 1)) h++;  // a carry may reach the exponent: right
  return sign | h;
}
