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
 * keeps the last), the source of each top-level scalar value (it reads 2.0 as 2), and
 * for each top-level object value, its keys in the text's order (JSON.parse puts keys
 * like "0" first) with the source of each scalar value (null for others). */
function jsonSource(text) {
  const stack = [], twice = [], top = new Map(), inner = new Map();  // null: an array
  let wantKey = false;
  for (const [token] of text.matchAll(JSON_TOKEN)) {
    const at = stack.at(-1), topKey = stack[0]?.key;
    const nested = stack.length === 2 && at && inner.has(topKey) ? inner.get(topKey) : null;
    if (token === "{" || token === "[") {
      if (stack.length === 1 && at) {
        top.delete(topKey); inner.delete(topKey);
        if (token === "{") inner.set(topKey, new Map());
      }
      stack.push(token === "{" ? {keys: new Set(), key: null} : null); wantKey = token === "{";
    }
    else if (token === "}" || token === "]") { stack.pop(); wantKey = false; }
    else if (token === ",") wantKey = Boolean(at);
    else if (token === ":") wantKey = false;
    else if (wantKey) {
      const key = JSON.parse(token);
      if (at.keys.has(key)) twice.push(key);
      at.keys.add(key); at.key = key; wantKey = false;
      nested?.set(key, null);
    } else if (stack.length === 1 && at) { top.set(topKey, token); inner.delete(topKey); }
    else nested?.set(at.key, token);
  }
  return {twice: twice.sort(), top, inner};
}

/** A string as Python's repr writes it, for messages alike in both readers. */
function pyStr(text) {
  const quote = text.includes("'") && !text.includes('"') ? '"' : "'";
  const named = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", [quote]: `\\${quote}`};
  return quote + text.replace(/[\\\n\r\t'"\x00-\x1f\x7f-\xa0]/g, c => named[c] ??
    (c === "'" || c === '"' ? c : `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`)) + quote;
}

/** A float as Python's repr writes it (16.0, 1e-05, 1e+16, inf). */
function pyFloat(x) {
  if (!Number.isFinite(x)) return Number.isNaN(x) ? "nan" : x > 0 ? "inf" : "-inf";
  const [digits, exp] = x.toExponential().split("e"), e = Number(exp);
  if (e < -4 || e >= 16) return `${digits}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
  const text = Object.is(x, -0) ? "-0" : String(x);
  return text.includes(".") ? text : `${text}.0`;
}

/** Python's repr of a value JSON.parse read, from its source token where there is one
 * (2.0 stays 2.0); arrays and objects element by element (their numbers as ints if whole). */
function pyRepr(value, token = null) {
  if (token !== null && !/^[[{"]/.test(token)) {
    if (/^-?\d+$/.test(token)) return token === "-0" ? "0" : token;
    if (/^-?\d/.test(token)) return pyFloat(Number(token));
    return {true: "True", false: "False", null: "None"}[token];
  }
  if (value === null) return "None";
  if (typeof value === "boolean") return value ? "True" : "False";
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : pyFloat(value);
  if (typeof value === "string") return pyStr(value);
  if (Array.isArray(value)) return `[${value.map(v => pyRepr(v)).join(", ")}]`;
  return `{${Object.entries(value).map(([k, v]) => `${pyStr(k)}: ${pyRepr(v)}`).join(", ")}}`;
}

/** The name of a JSON value's Python type (list, str, int, ...), from its source text. */
function pyType(value, text) {
  if (value === null) return "NoneType";
  if (typeof value === "number") return /^\s*-?\d+\s*$/.test(text) ? "int" : "float";
  return Array.isArray(value) ? "list" : {string: "str", boolean: "bool"}[typeof value];
}

/** What a JSON value is, in JSON's words (as Python's _json_kind): a string, a number, ... */
function jsonKind(value) {
  if (typeof value === "string") return "a string";
  if (Array.isArray(value)) return "a list";
  return typeof value === "object" ? "an object" : "a number";
}

/** A shape as Python's tuple repr writes it: (2, 3), (5,), (). */
function pyShape(shape) {
  return shape.length === 1 ? `(${shape[0]},)` : `(${shape.join(", ")})`;
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
/** What a caller passed instead of a file's text or bytes, for the message. */
function passed(value) {
  if (typeof value?.then === "function") return "a Promise (await it first)";
  if (value === null || typeof value !== "object") return String(typeof value);
  return value.constructor?.name ?? "an object";
}

export function readSafetensors(bytes, name = "adapter_model.safetensors") {
  if (!(bytes instanceof ArrayBuffer || ArrayBuffer.isView(bytes) || Array.isArray(bytes)))
    throw new AdapterFileError(`${name}: expected the file's bytes (an ArrayBuffer or a ` +
      `Uint8Array: await file.arrayBuffer(), or await response.arrayBuffer()), got ` +
      passed(bytes));
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
          `got ${pyRepr(targets)}`);
  if (targets == null || targets === "all-linear") return () => true;
  if (list) return module => targets.some(t => module === t || module.endsWith(`.${t}`));
  let whole;
  try { new RegExp(targets); whole = new RegExp(`^(?:${targets})$`); }
  catch (e) { cfail(`target_modules '${targets}' is not a valid regex (${e.message})`); }
  return module => whole.test(module);
}

/** The config's rank_pattern and alpha_pattern checked (as Python's _check_patterns):
 * each [[key, value, test]] in the file's order, test matching a module's dotted suffix. */
function readPatterns(config, source, cfail) {
  const checks = {rank_pattern: [(v, t) => /^\d+$/.test(t ?? "") && v >= 1, "an int >= 1"],
                  alpha_pattern: [v => typeof v === "number" && Number.isFinite(v),
                                  "a finite number"]};
  const out = {};
  for (const [name, [valid, what]] of Object.entries(checks)) {
    let pattern = config[name];
    const empty = pattern == null || pattern === false || pattern === 0 || pattern === "" ||
                  (Array.isArray(pattern) && !pattern.length);   // Python's falsy: {}
    if (empty) pattern = {};
    else if (typeof pattern !== "object" || Array.isArray(pattern))
      cfail(`${name} must be an object, got ${pyRepr(pattern, source.top.get(name) ?? null)}`);
    out[name] = [...(empty ? [] : source.inner.get(name)).entries()].map(([key, token]) => {
      let test;
      try { new RegExp(key); test = new RegExp(`^(?:(.*\\.)?(${key}))$`); }
      catch (e) { cfail(`${name} key ${pyStr(key)} is not a valid regex (${e.message})`); }
      const value = pattern[key];
      if (!valid(value, token))
        cfail(`${name}[${pyStr(key)}] must be ${what}, got ${pyRepr(value, token)}`);
      return [key, value, test];
    });
  }
  return out;
}

/** peft's pattern lookup (as Python's _pattern_value): the first key matching a dotted
 * suffix of the module name, else the default. */
function patternValue(entries, module, fallback) {
  return entries.find(([, , test]) => test.test(module))?.[1] ?? fallback;
}

/** adapter_config.json's text as the checked config (the fields the reader honours:
 * r, lora_alpha, rank_pattern, alpha_pattern, target_modules; DoRA and other peft
 * types refused), with the patterns and target_modules as tests of a module name. */
function readConfig(configText, cfgName) {
  if (typeof configText !== "string")
    throw new AdapterFileError(`${cfgName}: expected the file's text (a string: await ` +
      `file.text(), or await response.text()), got ${passed(configText)}`);
  let config;
  try { config = JSON.parse(configText); }
  catch (e) { throw new AdapterFileError(`${cfgName}: not valid JSON (${e.message})`); }
  const cfail = why => { throw new AdapterFileError(`${cfgName}: ${why}`); };
  if (config === null || typeof config !== "object" || Array.isArray(config))
    cfail(`expected a JSON object, got ${pyType(config, configText)}`);
  const has = field => Object.hasOwn(config, field), source = jsonSource(configText);
  const repr = field => pyRepr(config[field], source.top.get(field) ?? null);
  if (has("peft_type") && config.peft_type !== "LORA")
    cfail(`peft_type is ${repr("peft_type")}, not 'LORA'`);
  for (const field of ["use_rslora", "fan_in_fan_out", "use_dora"])  // "false" is truthy
    if (config[field] != null && typeof config[field] !== "boolean")
      cfail(`${field} must be true or false (a JSON boolean), got ${repr(field)}, ` +
            jsonKind(config[field]));
  if (config.use_dora) cfail("use_dora is true; DoRA adapters are not supported");
  for (const [field, what] of [["r", "the LoRA rank"], ["lora_alpha", "the scale's numerator"]])
    if (!has(field)) cfail(`missing '${field}' (${what})`);
  const rText = source.top.get("r") ?? JSON.stringify(config.r);
  if (!/^\d+$/.test(rText) || !Number.isInteger(config.r) || config.r < 1)  // 2.0 is refused
    cfail(`r must be an int >= 1, got ${pyRepr(config.r, rText)}`);
  if (typeof config.lora_alpha !== "number" || !Number.isFinite(config.lora_alpha))
    cfail(`lora_alpha must be a finite number, got ${repr("lora_alpha")}`);
  const patterns = readPatterns(config, source, cfail);
  return {config, patterns, targets: targetTest(config.target_modules, cfail)};
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
  const {config, patterns, targets} = readConfig(configText, cfgName);
  const {tensors} = readSafetensors(tensorBytes, file);
  const fail = why => { throw new AdapterFileError(`${file}: ${why}`); };
  const ignored = [], layers = Object.create(null);
  for (const [module, found] of pairKeys(Object.keys(tensors).sort(), fail, ignored)) {
    if (!targets(module))
      fail(`module ${module} does not match target_modules ` +
           `${pyRepr(config.target_modules)} in ${cfgName}`);
    const r = patternValue(patterns.rank_pattern, module, config.r);
    const alpha = patternValue(patterns.alpha_pattern, module, config.lora_alpha);
    const A = tensors[found.get("A")], B = tensors[found.get("B")];
    if (A.shape.length !== 2 || A.shape[0] !== r)
      fail(`${found.get("A")} has shape ${pyShape(A.shape)}; lora_A must be [r, in] with ` +
           `r = ${r}`);
    if (B.shape.length !== 2 || B.shape[1] !== r)
      fail(`${found.get("B")} has shape ${pyShape(B.shape)}; lora_B must be [out, r] with ` +
           `r = ${r}`);
    const a = float32Of(A, found.get("A"), fail), b = float32Of(B, found.get("B"), fail);
    for (const [key, values] of [[found.get("A"), a], [found.get("B"), b]]) {
      const bad = values.reduce((n, v) => n + !Number.isFinite(v), 0);
      if (bad) fail(`${key}: ${bad} of ${values.length} values are NaN or infinite`);
    }
    layers[module] = {a, b, rank: r, inDim: A.shape[1], outDim: B.shape[0], alpha,
                      scale: config.use_rslora ? alpha / Math.sqrt(r) : alpha / r};
  }
  return {config, layers, ignored};
}

/** A float written as Python's json writes it (16.0, not 16). */
class PyFloat { constructor(value) { this.value = value; } }

/** ``value`` as Python's ``json.dumps(value, indent=2)`` writes it (non-ASCII escaped,
 * floats as PyFloat), so the page's config text is the one save_adapter writes. A Map is
 * an object whose keys keep their order (a plain object puts keys like "0" first). */
function pyJson(value, pad = "") {
  const inner = `${pad}  `;
  if (value instanceof PyFloat) return pyFloat(value.value);
  if (typeof value === "string")
    return JSON.stringify(value).replace(/[\u007f-\uffff]/g,
                                         c => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
  if (value === null || typeof value !== "object") return JSON.stringify(value);
  const [open, close, items] = Array.isArray(value) ? ["[", "]", value.map(v => pyJson(v, inner))]
    : ["{", "}", [...(value instanceof Map ? value : Object.entries(value))].map(
        ([k, v]) => `${pyJson(k)}: ${pyJson(v, inner)}`)];
  return items.length ? `${open}\n${inner}${items.join(`,\n${inner}`)}\n${pad}${close}`
                      : `${open}${close}`;
}

/** The value most modules have (the largest on a tie), as Python's _most_common. */
function mostCommon(values) {
  const counts = new Map();
  for (const v of values) counts.set(v, (counts.get(v) ?? 0) + 1);
  return [...counts].reduce((p, q) => q[1] > p[1] || (q[1] === p[1] && q[0] > p[0]) ? q : p)[0];
}

/** Python's re.escape, for the pattern keys (module names) save_adapter writes. */
function pyEscape(text) {
  return text.replace(/[()[\]{}?*+\-|^$\\.&~# \t\n\r\v\f]/g, "\\$&");
}

/** peft's rank_pattern or alpha_pattern (a Map) for ``values`` ({module: value}), as
 * Python's _pattern: the escaped name of each module whose value is not ``fallback``,
 * longest first, and of each module of ``fallback`` that such a key would match too. */
function patternOf(values, fallback, wrap = v => v) {
  const modules = Object.keys(values);
  const keyed = new Set(modules.filter(m => values[m] !== fallback));
  for (let caught = true; caught;) {
    caught = modules.filter(m => !keyed.has(m) && [...keyed].some(k => m.endsWith(`.${k}`)));
    caught.forEach(m => keyed.add(m));
    caught = caught.length > 0;
  }
  const order = [...keyed].sort((p, q) => q.length - p.length || (p < q ? -1 : p > q ? 1 : 0));
  return new Map(order.map(m => [pyEscape(m), wrap(values[m])]));
}

/** Each module's alpha: ``alpha`` one number, ``{module: number}`` naming every module,
 * or, left out, each layer's own ``alpha`` (as readPeftAdapter returns it). */
function alphasOf(layers, modules, alpha) {
  const finite = (v, what) => {
    if (typeof v !== "number" || !Number.isFinite(v))
      throw new AdapterFileError(`${what} must be a finite number, got ${pyRepr(v ?? null)}`);
    return v;
  };
  if (typeof alpha === "number" || alpha === null || typeof alpha !== "object") {
    if (alpha === undefined)
      return Object.fromEntries(modules.map(m => [m, finite(layers[m].alpha, `alpha of ${m}`)]));
    finite(alpha, "alpha");
    return Object.fromEntries(modules.map(m => [m, alpha]));
  }
  const missing = modules.filter(m => !Object.hasOwn(alpha, m)).sort();
  const extra = Object.keys(alpha).filter(m => !modules.includes(m)).sort();
  if (missing.length || extra.length)
    throw new AdapterFileError(`alpha as a dict must name every module of layers and no ` +
                               `other; missing ${pyRepr(missing)}, extra ${pyRepr(extra)}`);
  return Object.fromEntries(modules.map(m => [m, finite(alpha[m], `alpha[${pyStr(m)}]`)]));
}

/** use_rslora for ``layers``: ``useRslora`` where given, else what the layers' own
 *  scales say (readPeftAdapter's layers of an rslora file have scale alpha / sqrt(r));
 *  throws where a layer's scale and alpha fit neither rule, or not the one written, as
 *  peft would then scale that module otherwise than the layer does. */
function rsloraOf(layers, modules, useRslora) {
  const f = Math.fround, said = [];
  for (const m of modules) {
    const {scale, alpha, rank} = layers[m];
    if (typeof scale !== "number" || typeof alpha !== "number" || rank === 1) continue;
    const plain = alpha / rank, rs = alpha / Math.sqrt(rank);
    if (f(scale) !== f(plain) && f(scale) !== f(rs))
      throw new AdapterFileError(`module ${m}: scale ${scale} is neither alpha / r (${plain}) ` +
        `nor alpha / sqrt(r) (${rs}) for alpha ${alpha}, r ${rank}; peft would not read it back`);
    said.push([m, f(scale) === f(rs)]);
  }
  const chosen = useRslora ?? (said.length ? said[0][1] : false);
  const off = said.filter(([, rs]) => rs !== Boolean(chosen)).map(([m]) => m);
  if (off.length)
    throw new AdapterFileError(`use_rslora would be ${Boolean(chosen)}, but module(s) ` +
      `${off.join(", ")} have scale alpha / ${chosen ? "r" : "sqrt(r) (rslora)"}: peft would ` +
      `scale them otherwise; give {useRslora: ${!chosen}} or layers of one rule`);
  return Boolean(chosen);
}

// peft's TaskType values (PEFT_TASK_TYPES in lora.training.adapter_io)
const TASK_TYPES = ["SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS",
                    "FEATURE_EXTRACTION"];

/** writePeftAdapter's options for the config, refused by name as save_adapter refuses them. */
function checkSaveOptions(taskType, loraDropout, baseModelNameOrPath) {
  if (typeof loraDropout !== "number" || !(loraDropout >= 0 && loraDropout < 1))
    throw new AdapterFileError(`loraDropout must be a probability in [0, 1), got ` +
                               pyRepr(loraDropout ?? null));
  if (taskType !== null && !TASK_TYPES.includes(taskType))
    throw new AdapterFileError(`taskType must be null or one of peft's ` +
                               `${TASK_TYPES.join(", ")}, got ${pyRepr(taskType)}`);
  if (baseModelNameOrPath !== null && typeof baseModelNameOrPath !== "string")
    throw new AdapterFileError(`baseModelNameOrPath must be a string or null, got ` +
                               pyRepr(baseModelNameOrPath));
}

/** The two files of a peft adapter for ``layers`` ({module: {a, b, rank, inDim, outDim}},
 * a and b row-major Float32Arrays): {config: text, tensors: bytes}. As Python's
 * save_adapter (the same config text for the same layers): ``alpha`` one number,
 * ``{module: number}``, or left out for each layer's ``alpha``; r and lora_alpha the most
 * common values, rank_pattern and alpha_pattern the modules that differ; use_rslora
 * ``useRslora``, else what the layers' scales say (rsloraOf); ``taskType`` ("CAUSAL_LM"
 * for a language model: peft then makes a PeftModelForCausalLM), ``loraDropout`` and
 * ``baseModelNameOrPath`` as save_adapter's task_type, lora_dropout and
 * base_model_name_or_path. */
export function writePeftAdapter(layers, {alpha, targetModules, useRslora, taskType = null,
                                          loraDropout = 0, baseModelNameOrPath = null} = {}) {
  const modules = Object.keys(layers);
  if (!modules.length) throw new AdapterFileError("layers must hold at least one module");
  const rslora = rsloraOf(layers, modules, useRslora);
  const alphas = alphasOf(layers, modules, alpha);
  const ranks = Object.fromEntries(modules.map(m => [m, layers[m].rank]));
  const tensors = Object.create(null);
  for (const m of modules) {
    const {a, b, rank, inDim, outDim} = layers[m];
    tensors[`${PREFIX}${m}.lora_A.weight`] = {dtype: "F32", shape: [rank, inDim], data: a};
    tensors[`${PREFIX}${m}.lora_B.weight`] = {dtype: "F32", shape: [outDim, rank], data: b};
  }
  let targets = targetModules ?? modules.map(m => m.split(".").pop());
  if (typeof targets !== "string") targets = [...new Set(targets)].sort();
  const matches = targetTest(targets, why => { throw new AdapterFileError(why); });
  for (const m of modules)
    if (!matches(m))
      throw new AdapterFileError(`module ${m} does not match target_modules ${pyRepr(targets)}`);
  checkSaveOptions(taskType, loraDropout, baseModelNameOrPath);
  const r = mostCommon(Object.values(ranks)), loraAlpha = mostCommon(Object.values(alphas));
  const config = {alpha_pattern: patternOf(alphas, loraAlpha, v => new PyFloat(v)),
                  base_model_name_or_path: baseModelNameOrPath, bias: "none",
                  fan_in_fan_out: false,
                  inference_mode: true, init_lora_weights: true, layers_pattern: null,
                  layers_to_transform: null, lora_alpha: new PyFloat(loraAlpha),
                  lora_dropout: new PyFloat(loraDropout), modules_to_save: null,
                  peft_type: "LORA", r,
                  rank_pattern: patternOf(ranks, r), revision: null, target_modules: targets,
                  task_type: taskType, use_dora: false, use_rslora: rslora};
  return {config: `${pyJson(config)}\n`, tensors: writeSafetensors(tensors)};
}
