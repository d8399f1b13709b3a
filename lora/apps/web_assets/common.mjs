// ---- what the LoRA modules share (web_assets/common.mjs, written into each module)
const prepared = new WeakMap();  // GPUDevice -> Promise of every pipeline

/** Compile every kernel's pipeline (once per device); rejects on WGSL errors. */
export function prepare(device) {
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
  await staging.mapAsync(GPUMapMode.READ);
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
