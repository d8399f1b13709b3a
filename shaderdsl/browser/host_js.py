"""The JavaScript the browser device runs in its page (``window.sd``).

Kept as a Python string so it travels with the package like any module. The
page holds the GPUDevice, the buffers (by the Python Buffer's id), shader
modules and pipelines (by the Kernel's cache key), bind groups and small
buffers for plain uniform values. ``sd.call(name, args)`` never throws: an
error comes back as ``{error: {kind, message, ...}}`` for Python to raise.
``sd.run(ops)`` plays a list of recorded operations in order with one
command encoder per stretch between writes and releases, one submit each,
then waits for the reads it contains.
"""

HOST_HTML = "<!doctype html><meta charset=utf-8><title>shaderdsl browser device</title>\n"

HOST_JS = r"""
(() => {
const S = {device: null, buffers: new Map(), kernels: new Map(), groups: new Map(),
           holders: new Map(), values: new Map(), held: new Map(), lost: null, timer: null,
           made: 0};
const CHUNK = 8 << 20;
const ACCESS = {read: "read-only-storage", read_write: "storage", uniform: "uniform"};
const U = GPUBufferUsage;
const USAGE = {storage: U.STORAGE | U.COPY_SRC | U.COPY_DST,
               uniform: U.UNIFORM | U.COPY_SRC | U.COPY_DST};

function decode(s) {
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(s);
  const bin = atob(s), out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}
function encode(bytes) {
  if (bytes.toBase64) return bytes.toBase64();
  let bin = "";
  for (let i = 0; i < bytes.length; i += 0x8000)
    bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(bin);
}

async function init(wanted) {
  if (!navigator.gpu) return {error: {kind: "webgpu", message:
    "navigator.gpu is missing: this browser has WebGPU off " +
    "(launch it with --enable-unsafe-webgpu)"}};
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter)
    return {error: {kind: "webgpu", message: "navigator.gpu.requestAdapter() gave no adapter"}};
  const requiredFeatures = wanted.filter(f => adapter.features.has(f));
  const requiredLimits = {};
  for (const k in adapter.limits)
    if (typeof adapter.limits[k] === "number") requiredLimits[k] = adapter.limits[k];
  const device = await adapter.requestDevice({requiredFeatures, requiredLimits});
  device.lost.then(info => { S.lost = `device lost (${info.reason}): ${info.message}`; });
  device.onuncapturederror = e => { S.uncaptured = e.error.message; };
  S.device = device;
  const limits = {};
  for (const k in device.limits) limits[k] = device.limits[k];
  const i = adapter.info || {};
  return {features: [...device.features], limits, adapter_features: [...adapter.features],
          info: {vendor: i.vendor, architecture: i.architecture, device: i.device,
                 description: i.description, fallback: !!i.isFallbackAdapter,
                 subgroup_min_size: i.subgroupMinSize, subgroup_max_size: i.subgroupMaxSize},
          user_agent: navigator.userAgent};
}

function create(id, size, kind, data) {
  const buf = S.device.createBuffer({size, usage: USAGE[kind], mappedAtCreation: data !== null,
                                     label: `#${id}`});
  if (data !== null) { new Uint8Array(buf.getMappedRange()).set(decode(data)); buf.unmap(); }
  S.buffers.set(id, buf);
  return {};
}

async function kernel(spec) {
  const module = S.device.createShaderModule({code: spec.wgsl, label: spec.name});
  const info = await module.getCompilationInfo();
  const errors = info.messages.filter(m => m.type === "error")
    .map(m => ({message: m.message, line: m.lineNum, column: m.linePos}));
  if (errors.length) return {error: {kind: "compile", errors}};
  const entries = spec.layout.map(([binding, access]) =>
    ({binding, visibility: GPUShaderStage.COMPUTE, buffer: {type: ACCESS[access]}}));
  const bgl = S.device.createBindGroupLayout({entries});
  const layout = S.device.createPipelineLayout({bindGroupLayouts: [bgl]});
  S.kernels.set(spec.key, {module, bgl, layout, entry: spec.entry, pipelines: new Map()});
  return {};
}

async function pipeline(key, okey, constants) {
  const k = S.kernels.get(key);
  S.device.pushErrorScope("validation");
  try {
    const p = await S.device.createComputePipelineAsync({layout: k.layout,
      compute: {module: k.module, entryPoint: k.entry, constants}});
    k.pipelines.set(okey, p);
  } catch (e) {
    await S.device.popErrorScope();
    return {error: {kind: "pipeline", message: e.message}};
  }
  const err = await S.device.popErrorScope();
  if (err) return {error: {kind: "pipeline", message: err.message}};
  return {};
}

function valueBuffer(data) {
  let buf = S.values.get(data);
  if (!buf) {
    if (S.values.size > 4096) { S.values.clear(); S.groups.clear(); S.holders.clear(); }
    const bytes = decode(data);
    buf = S.device.createBuffer({size: 16, usage: U.UNIFORM, mappedAtCreation: true});
    new Uint8Array(buf.getMappedRange()).set(bytes);
    buf.unmap();
    S.values.set(data, buf);
  }
  return buf;
}

function bindGroup(k, key, binds) {
  const gkey = key + "|" + binds.map(b => b[1] === null ? "v" + b[2] : b[1]).join(",");
  let group = S.groups.get(gkey);
  if (!group) {
    const entries = binds.map(([binding, id, value]) =>
      ({binding, resource: {buffer: id === null ? valueBuffer(value) : S.buffers.get(id)}}));
    group = S.device.createBindGroup({layout: k.bgl, entries});
    S.groups.set(gkey, group);
    S.made++;
    for (const b of binds) if (b[1] !== null) {
      if (!S.holders.has(b[1])) S.holders.set(b[1], []);
      S.holders.get(b[1]).push(gkey);
    }
  }
  return group;
}

function forget(id) {
  for (const gkey of S.holders.get(id) || []) S.groups.delete(gkey);
  S.holders.delete(id);
}

class Recorder {
  constructor() { this.encoder = null; this.pass = null; this.submits = 0; }
  enc() { return this.encoder || (this.encoder = S.device.createCommandEncoder()); }
  cpass() {
    if (!this.pass) {
      const t = S.timer, desc = {};
      if (t) {
        desc.timestampWrites = t.started ? {querySet: t.qs, endOfPassWriteIndex: 1}
          : {querySet: t.qs, beginningOfPassWriteIndex: 0, endOfPassWriteIndex: 1};
        t.started = true;
      }
      this.pass = this.enc().beginComputePass(desc);
    }
    return this.pass;
  }
  endPass() { if (this.pass) { this.pass.end(); this.pass = null; } }
  submit() {
    this.endPass();
    if (this.encoder) {
      S.device.queue.submit([this.encoder.finish()]);
      this.encoder = null;
      this.submits++;
    }
  }
}

function staging(rec, src, size) {
  const st = S.device.createBuffer({size, usage: U.MAP_READ | U.COPY_DST});
  rec.endPass();
  rec.enc().copyBufferToBuffer(src, 0, st, 0, size);
  return st;
}

function play(rec, op, reads) {
  if (op.op === "dispatch") {
    const k = S.kernels.get(op.key), pass = rec.cpass();
    pass.setPipeline(k.pipelines.get(op.okey));
    pass.setBindGroup(0, bindGroup(k, op.key, op.binds));
    pass.dispatchWorkgroups(op.grid[0], op.grid[1], op.grid[2]);
  } else if (op.op === "copy") {
    rec.endPass();
    rec.enc().copyBufferToBuffer(S.buffers.get(op.src), 0, S.buffers.get(op.dst), 0, op.n);
  } else if (op.op === "write") {
    rec.submit();
    S.device.queue.writeBuffer(S.buffers.get(op.id), op.offset || 0, decode(op.data));
  } else if (op.op === "read") {
    reads.push([op.id, staging(rec, S.buffers.get(op.id), op.size)]);
  } else if (op.op === "release") {
    rec.submit();
    forget(op.id);
    const buf = S.buffers.get(op.id);
    if (buf) { buf.destroy(); S.buffers.delete(op.id); }
  } else if (op.op === "timer_begin") {
    const qs = S.device.createQuerySet({type: "timestamp", count: 2});
    S.timer = {qs, started: false};
    rec.cpass();
  } else if (op.op === "timer_drop") {
    S.timer = null;
  } else if (op.op === "timer_end") {
    if (!rec.pass) rec.cpass();
    rec.endPass();
    const res = S.device.createBuffer({size: 16, usage: U.QUERY_RESOLVE | U.COPY_SRC});
    rec.enc().resolveQuerySet(S.timer.qs, 0, 2, res, 0);
    reads.push(["time", staging(rec, res, 16)]);
    S.timer = null;
  } else {
    throw new Error(`unknown op ${op.op}`);
  }
}

async function run(ops, wait) {
  const rec = new Recorder(), reads = [], made = S.made;
  S.device.pushErrorScope("out-of-memory");
  S.device.pushErrorScope("validation");
  try {
    for (const op of ops) play(rec, op, reads);
    rec.submit();
  } finally {
    var [verr, merr] = await Promise.all([S.device.popErrorScope(), S.device.popErrorScope()]);
  }
  if (verr || merr) return {error: {kind: verr ? "validation" : "out-of-memory",
                                    message: (verr || merr).message}};
  const out = {};
  for (const [id, st] of reads) {
    await st.mapAsync(GPUMapMode.READ);
    const bytes = new Uint8Array(st.getMappedRange());
    if (id === "time") {
      const t = new BigInt64Array(bytes.buffer.slice(0, 16));
      out.time_ns = Number(t[1] - t[0]);
    } else if (bytes.length <= CHUNK) {
      out[id] = encode(bytes);
    } else {  // too big for one answer: held for take() to fetch a piece at a time
      S.held.set(id, bytes.slice());
      out[id] = {held: bytes.length};
    }
    st.unmap(); st.destroy();
  }
  if (wait) await S.device.queue.onSubmittedWorkDone();
  out.submits = rec.submits;
  out.bind_groups = S.made - made;
  return out;
}

function take(id, offset, n) {
  const bytes = S.held.get(id);
  if (offset + n >= bytes.length) S.held.delete(id);
  return encode(bytes.subarray(offset, offset + n));
}

const API = {init, create, kernel, pipeline, run, take};
window.sd = {
  async call(name, args) {
    if (S.lost) return {error: {kind: "lost", message: S.lost}};
    try { return await API[name](...args); }
    catch (e) {
      return {error: {kind: S.lost ? "lost" : "js", message: String(e && e.stack || e)}};
    }
  },
  state: S,
};
})();
"""
