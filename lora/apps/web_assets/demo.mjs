// ---- the demo
const demo = /*DEMO*/null;  // written at export (lora.apps.web.demo_page)
const embedded = /*WEIGHTS*/null;
const $ = id => document.getElementById(id);

function rows(table, entries, head) {
  $(table).innerHTML = `<tr><th colspan="2">${head}</th></tr>` + entries.map(([k, v]) =>
    `<tr><td>${k}</td><td class="n">${v}</td></tr>`).join("");
}

function normals(seed, n) {
  let s = seed >>> 0;
  const uniform = () => { s = (s + 0x6D2B79F5) >>> 0; let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1); t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296; };
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = Math.sqrt(-2 * Math.log(uniform())) * Math.cos(2 * Math.PI * uniform());
  return out;
}

function fromBase64(text) {
  const bin = atob(text), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Float32Array(bytes.buffer);
}

function reference(A, B, X, base) {   // float64: out, and the error bound of lora.reference
  const {rank: R, inDim: I, outDim: O, tokens: T, scale: s} = config;
  const {rtol, atol, f16Rounding} = demo.tolerance;  // lora.core.reference's
  const out = new Float64Array(T * O), tol = new Float64Array(T * O);
  for (let t = 0; t < T; t++) {
    const h = new Float64Array(R), habs = new Float64Array(R);
    for (let r = 0; r < R; r++) for (let k = 0; k < I; k++) {
      h[r] += A[r * I + k] * X[t * I + k]; habs[r] += Math.abs(A[r * I + k] * X[t * I + k]); }
    for (let i = 0; i < O; i++) {
      let y = 0, yabs = 0;
      for (let r = 0; r < R; r++) { y += B[i * R + r] * h[r]; yabs += Math.abs(B[i * R + r]) * habs[r]; }
      out[t * O + i] = base[t * O + i] + s * y;
      tol[t * O + i] = rtol * (Math.abs(s) * yabs + Math.abs(base[t * O + i])) + atol;
      if (config.dtype === "f16") tol[t * O + i] += f16Rounding * Math.abs(out[t * O + i]);
    }
  }
  return {out, tol};
}

function upload(device, values) {
  const data = config.dtype === "f16" ? new Float16Array(values) : values;
  const buf = device.createBuffer({size: Math.max(16, Math.ceil(data.byteLength / 4) * 4),
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    mappedAtCreation: true});
  new data.constructor(buf.getMappedRange(), 0, data.length).set(data);
  buf.unmap();
  return buf;
}

async function download(device, buf, n) {
  const st = device.createBuffer({size: buf.size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST});
  const enc = device.createCommandEncoder();
  enc.copyBufferToBuffer(buf, 0, st, 0, buf.size);
  device.queue.submit([enc.finish()]);
  await st.mapAsync(GPUMapMode.READ);
  const Arr = config.dtype === "f16" ? Float16Array : Float32Array;
  const out = Float64Array.from(new Arr(st.getMappedRange()).subarray(0, n));
  st.unmap(); st.destroy();
  return out;
}

async function setup() {
  if (!navigator.gpu) throw new Error("this browser has no WebGPU (navigator.gpu is missing)");
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) throw new Error("navigator.gpu.requestAdapter() found no adapter");
  const missing = config.features.filter(f => !adapter.features.has(f));
  if (missing.length) throw new Error(`this adapter lacks ${missing.join(", ")}, which ${config.strategy} (${config.dtype}) needs`);
  const device = await adapter.requestDevice({requiredFeatures: config.features});
  const {rank: R, inDim: I, outDim: O, tokens: T} = config;
  const A = embedded ? fromBase64(embedded.a) : normals(demo.seed + 1, R * I);
  const B = embedded ? fromBase64(embedded.b) : normals(demo.seed + 2, O * R);
  const X = normals(demo.seed + 3, T * I), base = normals(demo.seed + 4, T * O);
  const q = v => config.dtype === "f16" ? Float32Array.from(new Float16Array(v)) : v;
  return {adapter, device, A: q(A), B: q(B), X: q(X), base: q(base)};
}

async function time(device, buffers) {
  const t0 = performance.now();
  for (let i = 0; i < demo.repeat; i++) await loraForward(device, buffers);
  await device.queue.onSubmittedWorkDone();
  return (performance.now() - t0) / demo.repeat;
}

async function main() {
  const {adapter, device, A, B, X, base} = await setup();
  const buffers = {a: upload(device, A), b: upload(device, B), x: upload(device, X), output: upload(device, base)};
  const t0 = performance.now();
  await prepare(device);
  const t1 = performance.now();
  await loraForward(device, buffers);
  await device.queue.onSubmittedWorkDone();
  const timings = {compile: t1 - t0, first: performance.now() - t1};
  const got = await download(device, buffers.output, config.tokens * config.outDim);
  const {out, tol} = reference(A, B, X, base);
  let bad = 0, maxErr = 0, maxRatio = 0;
  for (let i = 0; i < out.length; i++) {
    const err = Math.abs(got[i] - out[i]);
    if (!(err <= tol[i])) bad++;
    maxErr = Math.max(maxErr, err); maxRatio = Math.max(maxRatio, err / tol[i]);
  }
  timings.each = await time(device, buffers);
  const info = adapter.info || {};
  const sum = v => v.reduce((p, c) => p + c, 0);
  return {status: "done", ok: bad === 0, bad, elements: out.length, maxErr, maxRatio, timings,
          adapter: [info.vendor, info.architecture, info.description].filter(Boolean).join(" / "),
          config, weights: embedded ? `adapter ${demo.adapter.name} (${demo.adapter.source})` : `random, seed ${demo.seed}`,
          checksum: {a: sum(A), b: sum(B)}};
}

function show(r) {
  const v = $("verdict");
  v.className = r.ok ? "ok" : "bad";
  v.textContent = r.error ? `error: ${r.error}` : r.ok
    ? `matches the float64 reference: ${r.elements} outputs, max error ${r.maxErr.toExponential(2)} (${(100 * r.maxRatio).toFixed(2)}% of the bound)`
    : `${r.bad} of ${r.elements} outputs outside the error bound (max error ${r.maxErr.toExponential(2)})`;
  if (r.error) return;
  const c = r.config;
  rows("setup", [["adapter", r.adapter], ["strategy", c.strategy], ["storage", c.dtype],
    ["rank, in, out", `${c.rank}, ${c.inDim}, ${c.outDim}`], ["tokens", c.tokens], ["scale", c.scale],
    ["weights", r.weights], ["dispatches per forward", steps.length]], "setup");
  rows("timings", [["compile (all pipelines)", `${r.timings.compile.toFixed(1)} ms`],
    ["first forward (with its wait)", `${r.timings.first.toFixed(2)} ms`],
    [`forward, mean of ${demo.repeat}`, `${r.timings.each.toFixed(3)} ms`]], "timings (wall clock)");
}

main().catch(e => ({status: "done", ok: false, error: String(e && e.message || e)}))
  .then(r => { window.loraDemo = r; show(r); document.title = `LoRA demo: ${r.ok ? "ok" : "FAILED"}`; });
