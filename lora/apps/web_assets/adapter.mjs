// lora_adapter.js: peft adapter files (safetensors + adapter_config.json) in the page.
// No dependency; typed arrays are little-endian on every browser WebGPU runs in.

export class AdapterFileError extends Error {
  constructor(message) { super(message); this.name = "AdapterFileError"; }
}

const ITEM = new Map([["F32", 4], ["F16", 2]]);   // the dtypes written
// The dtypes read: F32 and F16, and BF16 (widened) and F64 (narrowed) as float32.
const READ_ITEM = new Map([...ITEM, ["BF16", 2], ["F64", 8]]);
const DTYPES_EXPECTED = "F32, F16, BF16 or F64 expected";
const PREFIX = "base_model.model.";
const LORA_KEY = /^(.+?)\.lora_([AB])(?:\.([^.]+))?\.weight$/;
// Names that reach the objects every script shares (Object.prototype, Object): a file
// may not use them as a part of a key, here or in Python (lora.training.adapter_io).
const RESERVED = ["__proto__", "constructor", "prototype"];
const JSON_TOKEN = /"(?:[^"\\]|\\.)*"|[{}[\],:]|[^\s{}[\],:"]+/g;

/** What JSON.parse hides of a text it accepted: the keys an object names twice (it
 * keeps the last) and the source of each top-level scalar value (it reads 2.0 as 2). */
function jsonSource(text) {
  const stack = [], twice = [], top = new Map();   // stack: {keys, key} objects, null arrays
  let wantKey = false;
  for (const [token] of text.matchAll(JSON_TOKEN)) {
    const inner = stack.at(-1);
    if (token === "{") { stack.push({keys: new Set(), key: null}); wantKey = true; }
    else if (token === "[") { stack.push(null); wantKey = false; }
    else if (token === "}" || token === "]") { stack.pop(); wantKey = false; }
    else if (token === ",") wantKey = Boolean(inner);
    else if (token === ":") wantKey = false;
    else if (wantKey) {
      const key = JSON.parse(token);
      if (inner.keys.has(key)) twice.push(key);
      inner.keys.add(key); inner.key = key; wantKey = false;
    } else if (stack.length === 1 && inner) top.set(inner.key, token);
  }
  return {twice: twice.sort(), top};
}

/** The key's first part that is a reserved name, or undefined. */
function reservedPart(key) {
  return key.split(".").find(part => RESERVED.includes(part));
}

function reservedMessage(key, part) {
  return `key ${key} holds the name '${part}'; ${RESERVED.join(", ")} are refused in ` +
         `module names (in JavaScript they reach objects every script shares)`;
}

/** {metadata, tensors: {key: {dtype, shape, data}}} of a safetensors file's bytes
 * (data: Float32Array for F32, Float64Array for F64, Uint16Array of the bits for F16 and
 * BF16); ``tensors`` has no
 * prototype, and keys naming __proto__, constructor or prototype are refused. */
export function readSafetensors(bytes, name = "adapter_model.safetensors") {
  // A plain Uint8Array even for a Node Buffer, whose slice() is a view, not a copy.
  const u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset,
                                                        bytes.byteLength) : new Uint8Array(bytes);
  const fail = why => { throw new AdapterFileError(`${name}: ${why}`); };
  if (u8.length < 8) fail(`${u8.length} bytes: too short for a safetensors file`);
  const n = Number(new DataView(u8.buffer, u8.byteOffset, 8).getBigUint64(0, true));
  if (n > u8.length - 8) fail(`not a readable safetensors file: the header says ${n} bytes, ` +
                              `${u8.length - 8} follow (truncated?)`);
  let text, header;
  try {
    text = new TextDecoder("utf-8", {fatal: true}).decode(u8.subarray(8, 8 + n));
    header = JSON.parse(text);
  } catch (e) { fail(`not a readable safetensors file: the header is not JSON (${e.message})`); }
  if (header === null || typeof header !== "object" || Array.isArray(header))
    fail("not a readable safetensors file: the header is not a JSON object");
  const [twice] = jsonSource(text).twice;
  if (twice !== undefined)
    fail(`the header names '${twice}' twice (duplicate keys are not allowed in safetensors)`);
  const keys = Object.keys(header).filter(key => key !== "__metadata__");
  for (const key of [...keys].sort()) {
    const part = reservedPart(key);
    if (part) fail(reservedMessage(key, part));
  }
  const data = u8.subarray(8 + n), tensors = Object.create(null), spans = [];
  for (const key of keys) {
    const info = header[key], item = READ_ITEM.get(info?.dtype);
    if (!item) fail(`${key} has dtype ${info?.dtype}; ${DTYPES_EXPECTED}`);
    const shape = info.shape, offsets = info.data_offsets;
    if (!Array.isArray(shape) || !shape.every(d => Number.isInteger(d) && d >= 0))
      fail(`${key}: shape ${JSON.stringify(shape)} is not a list of sizes`);
    const count = shape.reduce((p, d) => p * d, 1);
    const [begin, end] = Array.isArray(offsets) ? offsets : [];
    if (!Number.isInteger(begin) || !Number.isInteger(end) || begin < 0 || end > data.length ||
        end - begin !== count * item)
      fail(`not a readable safetensors file: ${key}'s data_offsets ` +
           `${JSON.stringify(offsets)} do not hold ${count} ${info.dtype} values ` +
           `within the ${data.length} bytes of data (truncated?)`);
    spans.push([begin, end, key]);
    const copy = data.slice(begin, end);   // a fresh, aligned buffer
    const View = {F32: Float32Array, F64: Float64Array}[info.dtype] ?? Uint16Array;
    tensors[key] = {dtype: info.dtype, shape, data: new View(copy.buffer)};
  }
  spans.sort((p, q) => p[0] - q[0]);
  let at = 0;
  for (const [begin, end, key] of spans) {
    if (begin !== at) fail(`not a readable safetensors file: ${key} starts at byte ${begin}, ` +
                           `not ${at} (the tensors must fill the data, without gaps)`);
    at = end;
  }
  if (at !== data.length) fail(`not a readable safetensors file: ${data.length - at} bytes ` +
                               `after the last tensor`);
  return {metadata: header.__metadata__ ?? {}, tensors};
}

/** The bytes of a safetensors file holding ``tensors`` ({key: {dtype, shape, data}});
 * the header is padded with spaces to 8 bytes, as the format allows. */
export function writeSafetensors(tensors, metadata = {format: "pt"}) {
  const keys = Object.keys(tensors).sort();
  const header = Object.create(null);
  header.__metadata__ = metadata;
  let at = 0;
  for (const key of keys) {
    const t = tensors[key], item = ITEM.get(t.dtype), part = reservedPart(key);
    if (part) throw new AdapterFileError(reservedMessage(key, part));
    if (!item) throw new AdapterFileError(`${key}: dtype ${t.dtype}; F32 or F16 expected`);
    const count = t.shape.reduce((p, d) => p * d, 1);
    if (t.data.length !== count)
      throw new AdapterFileError(`${key}: shape ${JSON.stringify(t.shape)} holds ${count} ` +
                                 `values, data has ${t.data.length}`);
    header[key] = {dtype: t.dtype, shape: t.shape, data_offsets: [at, at + count * item]};
    at += count * item;
  }
  let text = JSON.stringify(header);
  text += " ".repeat((8 - (new TextEncoder().encode(text).length % 8)) % 8);
  const head = new TextEncoder().encode(text);
  const out = new Uint8Array(8 + head.length + at);
  new DataView(out.buffer).setBigUint64(0, BigInt(head.length), true);
  out.set(head, 8);
  let offset = 8 + head.length;
  for (const key of keys) {
    const bytes = new Uint8Array(tensors[key].data.buffer, tensors[key].data.byteOffset,
                                 tensors[key].data.byteLength);
    out.set(bytes, offset);
    offset += bytes.length;
  }
  return out;
}

/** An IEEE half (its 16 bits) as a number. */
export function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1, exp = (bits >> 10) & 0x1f, frac = bits & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

/** A tensor's values as a Float32Array: F16 and BF16 widened exactly (a bfloat16's bits
 * are the top half of the float32's), F64 rounded to the nearest float32 and refused,
 * naming the first, where a finite value is beyond float32's range (as Python's reader). */
function float32Of(t, key, fail) {
  if (t.dtype === "F32") return t.data;
  if (t.dtype === "F16") return Float32Array.from(t.data, halfToFloat);
  if (t.dtype === "BF16") return new Float32Array(Uint32Array.from(t.data, h => h << 16).buffer);
  const out = Float32Array.from(t.data);
  const lost = t.data.filter((v, i) => Number.isFinite(v) && !Number.isFinite(out[i]));
  if (lost.length)
    fail(`${key} holds ${lost[0]}, which does not fit float32 (largest finite ` +
         `${2 ** 128 - 2 ** 104}); ${lost.length} of ${t.data.length} values are beyond it`);
  return out;
}

/** The config's target_modules as a test of a module name, by peft's rule (as
 * Python's _targets_module): a list entry is the whole name or a dotted suffix of it;
 * a string is a regex that must match the whole name; null and "all-linear" allow any. */
function targetTest(targets, cfail) {
  const list = Array.isArray(targets) && targets.every(t => typeof t === "string");
  if (!(targets == null || typeof targets === "string" || list))
    cfail(`target_modules must be a list of names, a regex string or null, ` +
          `got ${JSON.stringify(targets)}`);
  if (targets == null || targets === "all-linear") return () => true;
  if (list) return module => targets.some(t => module === t || module.endsWith(`.${t}`));
  let whole;
  try { new RegExp(targets); whole = new RegExp(`^(?:${targets})$`); }
  catch (e) { cfail(`target_modules '${targets}' is not a valid regex (${e.message})`); }
  return module => whole.test(module);
}

/** adapter_config.json's text as the checked config (the fields the reader honours:
 * r, lora_alpha, target_modules; DoRA, other peft types and the patterns refused). */
function readConfig(configText, cfgName) {
  let config;
  try { config = JSON.parse(configText); }
  catch (e) { throw new AdapterFileError(`${cfgName}: not valid JSON (${e.message})`); }
  const cfail = why => { throw new AdapterFileError(`${cfgName}: ${why}`); };
  if (config === null || typeof config !== "object" || Array.isArray(config))
    cfail("expected a JSON object");
  const has = field => Object.hasOwn(config, field);
  if (has("peft_type") && config.peft_type !== "LORA")
    cfail(`peft_type is ${JSON.stringify(config.peft_type)}, not 'LORA'`);
  if (config.use_dora) cfail("use_dora is true; DoRA adapters are not supported");
  for (const [field, what] of [["r", "the LoRA rank"], ["lora_alpha", "the scale's numerator"]])
    if (!has(field)) cfail(`missing '${field}' (${what})`);
  const rText = jsonSource(configText).top.get("r") ?? JSON.stringify(config.r);
  if (!/^\d+$/.test(rText) || !Number.isInteger(config.r) || config.r < 1)  // 2.0 is refused
    cfail(`r must be an int >= 1, got ${rText}`);
  if (typeof config.lora_alpha !== "number" || !Number.isFinite(config.lora_alpha))
    cfail(`lora_alpha must be a finite number, got ${JSON.stringify(config.lora_alpha)}`);
  for (const p of ["rank_pattern", "alpha_pattern"])
    if (config[p] && Object.keys(config[p]).length)
      cfail(`${p} is not read in the page; load this adapter with lora.load_adapter in Python`);
  return {config, targets: targetTest(config.target_modules, cfail)};
}

/** {module: {A: key, B: key}} (a Map): every module needs exactly one of each. */
function pairKeys(keys, fail, ignored) {
  const pairs = new Map();
  for (const key of keys) {
    const m = LORA_KEY.exec(key);
    if (!m) {
      if (key.includes(".lora_"))
        fail(`unexpected key ${key}; only <module>.lora_A.weight and <module>.lora_B.weight ` +
             `are supported (not DoRA's magnitudes or embedding LoRA)`);
      ignored.push(key);
      continue;
    }
    const module = m[1].startsWith(PREFIX) ? m[1].slice(PREFIX.length) : m[1];
    if (!pairs.has(module)) pairs.set(module, new Map());
    const found = pairs.get(module);
    if (found.has(m[2]))
      fail(`module ${module} has two lora_${m[2]} tensors: ${found.get(m[2])} and ${key}`);
    found.set(m[2], key);
  }
  for (const [module, found] of pairs)
    for (const [part, other] of [["A", "B"], ["B", "A"]])
      if (!found.has(part))
        fail(`module ${module} has ${found.get(other)} but no lora_${part} tensor`);
  if (!pairs.size) fail("holds no LoRA tensors");
  return pairs;
}

/** A peft LoRA adapter from its two files' contents (adapter_config.json as text,
 * adapter_model.safetensors as bytes): {config, layers: {module: {a, b, rank, inDim,
 * outDim, alpha, scale}}, ignored: [keys]} with a and b as row-major Float32Arrays
 * (A [rank, inDim], B [outDim, rank]), by the rules of Python's lora.load_adapter.
 * Tensors beside the LoRA pairs (modules_to_save heads, biases) are listed in
 * ``ignored``; DoRA and other LoRA kinds are refused. ``layers`` has no prototype. */
export function readPeftAdapter(configText, tensorBytes, names = {}) {
  const cfgName = names.config ?? "adapter_config.json";
  const file = names.tensors ?? "adapter_model.safetensors";
  const {config, targets} = readConfig(configText, cfgName);
  const {tensors} = readSafetensors(tensorBytes, file);
  const fail = why => { throw new AdapterFileError(`${file}: ${why}`); };
  const ignored = [], layers = Object.create(null), r = config.r;
  for (const [module, found] of pairKeys(Object.keys(tensors).sort(), fail, ignored)) {
    if (!targets(module))
      fail(`module ${module} does not match target_modules ` +
           `${JSON.stringify(config.target_modules)} in ${cfgName}`);
    const A = tensors[found.get("A")], B = tensors[found.get("B")];
    if (A.shape.length !== 2 || A.shape[0] !== r)
      fail(`${found.get("A")} has shape [${A.shape}]; lora_A must be [r, in] with r = ${r}`);
    if (B.shape.length !== 2 || B.shape[1] !== r)
      fail(`${found.get("B")} has shape [${B.shape}]; lora_B must be [out, r] with r = ${r}`);
    const a = float32Of(A, found.get("A"), fail), b = float32Of(B, found.get("B"), fail);
    for (const [key, values] of [[found.get("A"), a], [found.get("B"), b]]) {
      const bad = values.reduce((n, v) => n + !Number.isFinite(v), 0);
      if (bad) fail(`${key}: ${bad} of ${values.length} values are NaN or infinite`);
    }
    const alpha = config.lora_alpha;
    layers[module] = {a, b, rank: r, inDim: A.shape[1], outDim: B.shape[0], alpha,
                      scale: config.use_rslora ? alpha / Math.sqrt(r) : alpha / r};
  }
  return {config, layers, ignored};
}

/** The two files of a peft adapter for ``layers`` ({module: {a, b, rank, inDim, outDim}},
 * a and b row-major Float32Arrays of one rank): {config: text, tensors: bytes}. */
export function writePeftAdapter(layers, {alpha, targetModules, useRslora = false} = {}) {
  const modules = Object.keys(layers);
  if (!modules.length) throw new AdapterFileError("layers must hold at least one module");
  const ranks = new Set(modules.map(m => layers[m].rank));
  if (ranks.size !== 1)
    throw new AdapterFileError(`one rank per adapter file, got ranks ${[...ranks]}`);
  if (!Number.isFinite(alpha)) throw new AdapterFileError(`alpha must be a finite number`);
  const tensors = Object.create(null);
  for (const m of modules) {
    const {a, b, rank, inDim, outDim} = layers[m];
    tensors[`${PREFIX}${m}.lora_A.weight`] = {dtype: "F32", shape: [rank, inDim], data: a};
    tensors[`${PREFIX}${m}.lora_B.weight`] = {dtype: "F32", shape: [outDim, rank], data: b};
  }
  const config = {peft_type: "LORA", task_type: null, r: [...ranks][0], lora_alpha: alpha,
                  target_modules: targetModules ?? [...new Set(modules.map(m => m.split(".").pop()))].sort(),
                  use_rslora: useRslora, fan_in_fan_out: false, lora_dropout: 0.0, bias: "none",
                  init_lora_weights: true, inference_mode: true, use_dora: false,
                  rank_pattern: {}, alpha_pattern: {}, modules_to_save: null,
                  base_model_name_or_path: null, revision: null, layers_to_transform: null,
                  layers_pattern: null};  // the fields lora.save_adapter writes
  return {config: JSON.stringify(config, null, 1), tensors: writeSafetensors(tensors)};
}
