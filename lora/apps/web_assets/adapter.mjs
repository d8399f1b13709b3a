// lora_adapter.js: peft adapter files (safetensors + adapter_config.json) in the page.
// No dependency; typed arrays are little-endian on every browser WebGPU runs in.

export class AdapterFileError extends Error {
  constructor(message) { super(message); this.name = "AdapterFileError"; }
}

const ITEM = {F32: 4, F16: 2};           // the dtypes read and written
const PREFIX = "base_model.model.";
const LORA_KEY = /^(.+?)\.lora_([AB])(?:\.([^.]+))?\.weight$/;

/** {metadata, tensors: {key: {dtype, shape, data}}} of a safetensors file's bytes
 * (data: Float32Array for F32, Uint16Array of the bits for F16). */
export function readSafetensors(bytes, name = "adapter_model.safetensors") {
  const u8 = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const fail = why => { throw new AdapterFileError(`${name}: ${why}`); };
  if (u8.length < 8) fail(`${u8.length} bytes: too short for a safetensors file`);
  const n = Number(new DataView(u8.buffer, u8.byteOffset, 8).getBigUint64(0, true));
  if (n > u8.length - 8) fail(`not a readable safetensors file: the header says ${n} bytes, ` +
                              `${u8.length - 8} follow (truncated?)`);
  let header;
  try {
    header = JSON.parse(new TextDecoder("utf-8", {fatal: true}).decode(u8.subarray(8, 8 + n)));
  } catch (e) { fail(`not a readable safetensors file: the header is not JSON (${e.message})`); }
  if (header === null || typeof header !== "object" || Array.isArray(header))
    fail("not a readable safetensors file: the header is not a JSON object");
  const data = u8.subarray(8 + n), tensors = {}, spans = [];
  for (const [key, info] of Object.entries(header)) {
    if (key === "__metadata__") continue;
    const item = ITEM[info?.dtype];
    if (!item) fail(`${key} has dtype ${info?.dtype}; float32 (F32) or float16 (F16) expected`);
    const shape = info.shape, [begin, end] = info.data_offsets ?? [];
    if (!Array.isArray(shape) || !shape.every(d => Number.isInteger(d) && d >= 0))
      fail(`${key}: shape ${JSON.stringify(shape)} is not a list of sizes`);
    const count = shape.reduce((p, d) => p * d, 1);
    if (!Number.isInteger(begin) || !Number.isInteger(end) || begin < 0 || end > data.length ||
        end - begin !== count * item)
      fail(`not a readable safetensors file: ${key}'s data_offsets ` +
           `${JSON.stringify(info.data_offsets)} do not hold ${count} ${info.dtype} values ` +
           `within the ${data.length} bytes of data (truncated?)`);
    spans.push([begin, end, key]);
    const copy = data.slice(begin, end);   // a fresh, aligned buffer
    tensors[key] = {dtype: info.dtype, shape,
                    data: info.dtype === "F32" ? new Float32Array(copy.buffer)
                                               : new Uint16Array(copy.buffer)};
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
  const header = {__metadata__: metadata};
  let at = 0;
  for (const key of keys) {
    const t = tensors[key], item = ITEM[t.dtype];
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

function float32Of(t) {
  return t.dtype === "F32" ? t.data : Float32Array.from(t.data, halfToFloat);
}

/** A peft LoRA adapter from its two files' contents (adapter_config.json as text,
 * adapter_model.safetensors as bytes): {config, layers: {module: {a, b, rank, inDim,
 * outDim, alpha, scale}}, ignored: [keys]} with a and b as row-major Float32Arrays
 * (A [rank, inDim], B [outDim, rank]). Tensors beside the LoRA pairs (modules_to_save
 * heads, biases) are listed in ``ignored``; DoRA and other LoRA kinds are refused. */
export function readPeftAdapter(configText, tensorBytes, names = {}) {
  const cfgName = names.config ?? "adapter_config.json";
  const file = names.tensors ?? "adapter_model.safetensors";
  let config;
  try { config = JSON.parse(configText); }
  catch (e) { throw new AdapterFileError(`${cfgName}: not valid JSON (${e.message})`); }
  const cfail = why => { throw new AdapterFileError(`${cfgName}: ${why}`); };
  if (config === null || typeof config !== "object" || Array.isArray(config))
    cfail("expected a JSON object");
  if ("peft_type" in config && config.peft_type !== "LORA")
    cfail(`peft_type is ${JSON.stringify(config.peft_type)}, not 'LORA'`);
  if (config.use_dora) cfail("use_dora is true; DoRA adapters are not supported");
  for (const [field, what] of [["r", "the rank"], ["lora_alpha", "the scale's numerator"]])
    if (!(field in config)) cfail(`missing '${field}' (${what})`);
  if (!Number.isInteger(config.r) || config.r < 1) cfail(`r must be an int >= 1, got ${config.r}`);
  if (!Number.isFinite(config.lora_alpha)) cfail(`lora_alpha must be a finite number`);
  for (const p of ["rank_pattern", "alpha_pattern"])
    if (config[p] && Object.keys(config[p]).length)
      cfail(`${p} is not read in the page; load this adapter with lora.load_adapter in Python`);
  const {tensors} = readSafetensors(tensorBytes, file);
  const fail = why => { throw new AdapterFileError(`${file}: ${why}`); };
  const pairs = {}, ignored = [];
  for (const key of Object.keys(tensors).sort()) {
    const m = LORA_KEY.exec(key);
    if (!m) {
      if (key.includes(".lora_"))
        fail(`unexpected key ${key}; only <module>.lora_A.weight and <module>.lora_B.weight ` +
             `are supported (not DoRA's magnitudes or embedding LoRA)`);
      ignored.push(key);
      continue;
    }
    const module = m[1].startsWith(PREFIX) ? m[1].slice(PREFIX.length) : m[1];
    const found = pairs[module] ??= {};
    if (found[m[2]]) fail(`module ${module} has two lora_${m[2]} tensors: ${found[m[2]]} and ${key}`);
    found[m[2]] = key;
  }
  const layers = {};
  for (const [module, found] of Object.entries(pairs)) {
    for (const [part, other] of [["A", "B"], ["B", "A"]])
      if (!found[part]) fail(`module ${module} has ${found[other]} but no lora_${part} tensor`);
    const A = tensors[found.A], B = tensors[found.B], r = config.r;
    if (A.shape.length !== 2 || A.shape[0] !== r)
      fail(`${found.A} has shape [${A.shape}]; lora_A must be [r, in] with r = ${r}`);
    if (B.shape.length !== 2 || B.shape[1] !== r)
      fail(`${found.B} has shape [${B.shape}]; lora_B must be [out, r] with r = ${r}`);
    const a = float32Of(A), b = float32Of(B);
    for (const [key, values] of [[found.A, a], [found.B, b]]) {
      const bad = values.reduce((n, v) => n + !Number.isFinite(v), 0);
      if (bad) fail(`${key}: ${bad} of ${values.length} values are NaN or infinite`);
    }
    const alpha = config.lora_alpha;
    layers[module] = {a, b, rank: r, inDim: A.shape[1], outDim: B.shape[0], alpha,
                      scale: config.use_rslora ? alpha / Math.sqrt(r) : alpha / r};
  }
  if (!Object.keys(layers).length) fail("holds no LoRA tensors");
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
  const tensors = {};
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
