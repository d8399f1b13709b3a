// ---- the causal LM (lora_lm.js): loadCausalLM streams a safetensors file's weights
// to the GPU; the model's logits, greedy generation with a KV cache and training steps
// replay the graphs lora.CausalLM recorded (lora.apps.web_lm), kernel for kernel.
const LM = config.model, SHAPES = config.shapes;
const IGNORED = 0xFFFFFFFF;   // an ignored label as the loss kernel reads it (-100)
const IGNORE_INDEX = -100;
const STORED_BYTES = {F32: 4, F16: 2, BF16: 2};   // the dtypes a weights file may hold
const EMBEDDING = "model.embed_tokens.weight", HEAD = "lm_head.weight";
const IGNORED_SUFFIX = ".rotary_emb.inv_freq";   // older files' buffers: not weights
const PIECE = 1 << 20;   // elements converted and written at a time while loading
const GRAPH_GROUP = {train: "train", logits: "logits", prefill: "generate",
                     decode: "generate"};

/** A weights file that does not hold this module's model (names, shapes, dtypes, values). */
export class ModelError extends Error {
  constructor(message) { super(message); this.name = "ModelError"; }
}

function base64Bytes(text) {
  const raw = atob(text), out = new Uint8Array(raw.length);
  for (let k = 0; k < raw.length; k++) out[k] = raw.charCodeAt(k);
  return out;
}

// ---------------------------------------------------------------- inputs, as Python checks them

/** What a caller passed, for a message: "Float64Array [3]", "Array [2, 3]", "ragged rows". */
function describedInput(value) {
  if (value === null || value === undefined) return String(value);
  if (typeof value !== "object") return typeof value;
  const rows = Array.isArray(value) ? value : null;
  if (rows && rows.length && rows.every(r => Array.isArray(r) || ArrayBuffer.isView(r))) {
    const lengths = [...new Set(rows.map(r => r.length))];
    return lengths.length > 1 ? `rows of ${lengths.join(" and ")} values` :
      `${rows.length} row(s) of ${lengths[0]} (${rows.find(r => [...r].some(v =>
        !Number.isInteger(v))) ? "not all integers" : "integers"})`;
  }
  const length = value.length ?? "?";
  return `${value.constructor?.name ?? "object"} [${length}]`;
}

/** ``value`` as rows of integers [batch, seq]: an array of rows (arrays or TypedArrays of
 *  one length), or, for inputIds, one row (a flat array); TypeError naming ``what``. */
function integerRows(value, what, call) {
  const isRow = v => ArrayBuffer.isView(v) || (Array.isArray(v) && !v.some(x =>
    Array.isArray(x) || ArrayBuffer.isView(x)));
  let rows = null;
  if (what === "inputIds" && isRow(value)) rows = [value];
  else if (Array.isArray(value) && value.length && value.every(isRow)) rows = value;
  const plain = rows?.map(r => Array.from(r, v => typeof v === "boolean" && what ===
    "attentionMask" ? Number(v) : typeof v === "bigint" ? Number(v) : v));
  const seq = plain?.[0]?.length ?? 0;
  if (!plain || !seq || plain.some(r => r.length !== seq || r.some(v => !Number.isInteger(v))))
    throw new TypeError(`${call}: ${what} must be integers [batch, seq] (a 1-D row is one ` +
                        `sequence for inputIds), got ${describedInput(value)}`);
  return plain;
}

function firstWhere(rows, bad) {
  for (let b = 0; b < rows.length; b++)
    for (let s = 0; s < rows[b].length; s++) if (bad(rows[b][s])) return [b, s];
  return null;
}

/** The attention mask [batch, seq] of 0 and 1 (all ones when null). */
function maskRows(mask, batch, seq, call) {
  if (mask === null || mask === undefined) return Array.from({length: batch}, () =>
    new Array(seq).fill(1));
  const rows = integerRows(mask, "attentionMask", call);
  if (rows.length !== batch || rows[0].length !== seq)
    throw new RangeError(`${call}: attentionMask must have inputIds' shape [${batch}, ${seq}], ` +
                         `got [${rows.length}, ${rows[0].length}]`);
  const odd = [...new Set(rows.flat())].filter(v => v !== 0 && v !== 1).sort((p, q) => p - q);
  if (odd.length) throw new RangeError(`${call}: attentionMask must hold 0 (padding) and 1 (a ` +
    `token), got the values [${odd.slice(0, 5).join(", ")}]`);
  return rows;
}

/** Labels shifted left by one (position s learns token s + 1) with IGNORED for -100 and
 *  each row's last position, and how many are counted (lora.models.inputs._labels). */
function shiftedLabels(labels, batch, seq, call) {
  const rows = integerRows(labels, "labels", call);
  if (rows.length !== batch || rows[0].length !== seq)
    throw new RangeError(`${call}: labels must have inputIds' shape [${batch}, ${seq}], got ` +
                         `[${rows.length}, ${rows[0].length}]`);
  const vocab = LM.vocabSize;
  const bad = firstWhere(rows, v => (v < 0 || v >= vocab) && v !== IGNORE_INDEX);
  if (bad) throw new RangeError(`${call}: labels[${bad[0]}, ${bad[1]}] = ` +
    `${rows[bad[0]][bad[1]]} is neither a token id (0..${vocab - 1}) nor ${IGNORE_INDEX} ` +
    `(ignored)`);
  let counted = 0;
  const shifted = rows.map(r => r.map((_, s) => {
    const v = s + 1 < seq ? r[s + 1] : IGNORE_INDEX;
    if (v === IGNORE_INDEX) return IGNORED;
    counted += 1;
    return v;
  }));
  return {shifted, counted};
}

/** A batch checked as lora.models.inputs.check_batch checks it, with its messages (the
 *  arguments in their JavaScript spelling): {batch, seq, ids, keep, positions, labels,
 *  counted}, each [batch][seq]; positions 0..seq-1, or generate's cumsum(mask) - 1. */
function checkBatch(inputIds, labels, attentionMask, call, withLabels, generate = false) {
  const ids = integerRows(inputIds, "inputIds", call);
  const batch = ids.length, seq = ids[0].length, vocab = LM.vocabSize;
  const bad = firstWhere(ids, v => v < 0 || v >= vocab);
  if (bad) throw new RangeError(`${call}: inputIds[${bad[0]}, ${bad[1]}] = ` +
    `${ids[bad[0]][bad[1]]} is outside the vocabulary (ids 0..${vocab - 1})`);
  if (seq > LM.maxPositions)
    throw new RangeError(`${call}: sequences of ${seq} tokens are longer than the model's ` +
                         `max_position_embeddings (${LM.maxPositions})`);
  const keep = maskRows(attentionMask, batch, seq, call);
  const positions = keep.map(row => {
    let seen = 0;
    return row.map((k, s) => generate ? (k ? seen++ : 0) : s);
  });
  const out = {batch, seq, ids, keep, positions, labels: null, counted: 0};
  if (withLabels || (labels !== null && labels !== undefined)) {
    const {shifted, counted} = shiftedLabels(labels ?? ids, batch, seq, call);
    Object.assign(out, {labels: shifted, counted});
  }
  return out;
}

/** The checked batch in the module's baked [rows, cols] (u32, row-major): right-padded
 *  (training, logits: pads after every token, which the causal mask hides from them) or
 *  left-padded (generation: masked, at position 0); rows past the batch repeat row 0
 *  with every label ignored. Refused, naming the export option, where it does not fit. */
function baked(batch, rows, cols, call, left, [rowsOption, colsOption]) {
  if (batch.batch > rows)
    throw new RangeError(`${call}: ${batch.batch} sequences, but this module runs ${rows} ` +
      `at a time (${rowsOption} ${rows} at export); give at most ${rows}`);
  if (batch.seq > cols)
    throw new RangeError(`${call}: sequences of ${batch.seq} tokens are longer than this ` +
      `module's ${cols} (${colsOption} ${cols} at export)`);
  const n = rows * cols, out = {ids: new Uint32Array(n), keep: new Uint32Array(n),
                                positions: new Uint32Array(n), labels: new Uint32Array(n)};
  const shift = left ? cols - batch.seq : 0;
  for (let r = 0; r < rows; r++) {
    const src = r < batch.batch ? r : 0;
    for (let c = 0; c < cols; c++) {
      const s = c - shift, at = r * cols + c, real = s >= 0 && s < batch.seq;
      out.ids[at] = real ? batch.ids[src][s] : 0;
      out.keep[at] = real ? batch.keep[src][s] : left ? 0 : 1;
      out.positions[at] = real ? batch.positions[src][s] : left ? 0 : c;
      out.labels[at] = real && r < batch.batch && batch.labels ? batch.labels[src][s] : IGNORED;
    }
  }
  return out;
}

// ---------------------------------------------------------------- weights files

/** A file's bytes in memory (an ArrayBuffer or a view of one: Node's Buffer too). */
class BytesSource {
  constructor(bytes, name) {
    this.u8 = ArrayBuffer.isView(bytes) ? new Uint8Array(bytes.buffer, bytes.byteOffset,
                                                         bytes.byteLength) : new Uint8Array(bytes);
    this.name = name;
    this.size = this.u8.length;
  }
  async read(begin, end) { return this.u8.subarray(begin, Math.min(end, this.size)); }
}

/** A Blob or File (a picked file; Node's fs.openAsBlob): each range read when needed. */
class BlobSource {
  constructor(blob, name) { this.blob = blob; this.name = name; this.size = blob.size; }
  async read(begin, end) { return new Uint8Array(await this.blob.slice(begin, end).arrayBuffer()); }
}

/** A fetch Response's body, read once from start to end: ranges in increasing order. */
class StreamSource {
  constructor(response, name) {
    this.reader = response.body.getReader();
    this.name = name;
    const length = Number(response.headers?.get?.("content-length"));
    this.size = Number.isFinite(length) && length > 0 ? length : null;
    this.at = 0;              // the file offset of buf[0]
    this.buf = new Uint8Array(0);
  }
  async read(begin, end) {
    const out = new Uint8Array(end - begin);
    let filled = 0;
    while (filled < out.length) {
      if (!this.buf.length) {
        const {done, value} = await this.reader.read();
        if (done) return out.subarray(0, filled);   // the caller reports the truncation
        this.buf = value;
        continue;
      }
      const want = begin + filled;
      if (want < this.at) throw new Error(`${this.name}: byte ${want} was read past (a ` +
                                          `stream is read once, in order)`);
      const skip = want - this.at;
      if (skip >= this.buf.length) { this.at += this.buf.length; this.buf = this.buf.subarray(this.buf.length); continue; }
      const take = Math.min(this.buf.length - skip, out.length - filled);
      out.set(this.buf.subarray(skip, skip + take), filled);
      filled += take;
      this.at += skip + take;
      this.buf = this.buf.subarray(skip + take);
    }
    return out;
  }
}

/** A source of a weights file: a URL (fetched and streamed), a Response, a Blob or File,
 *  or its bytes. */
async function openSource(source, k) {
  if (typeof source === "string" || (typeof URL !== "undefined" && source instanceof URL)) {
    const response = await fetch(source);
    if (!response.ok) throw new ModelError(`${source}: the fetch answered ${response.status} ` +
                                           `${response.statusText}`);
    return new StreamSource(response, String(source));
  }
  if (typeof Response !== "undefined" && source instanceof Response)
    return new StreamSource(source, source.url || `weights file ${k + 1}`);
  if (typeof Blob !== "undefined" && source instanceof Blob)
    return new BlobSource(source, source.name || `weights file ${k + 1}`);
  if (source instanceof ArrayBuffer || ArrayBuffer.isView(source))
    return new BytesSource(source, `weights file ${k + 1}`);
  const got = typeof source?.then === "function" ? "a Promise (await it first)" :
    source === null ? "null" : source?.constructor?.name ?? typeof source;
  throw new TypeError(`loadCausalLM: a weights file must be a URL, a Response, a Blob or File, ` +
                      `or its bytes (an ArrayBuffer or Uint8Array), got ${got}`);
}

/** A safetensors file's tensors: {key: {dtype, shape, begin, end, source}} (file offsets),
 *  each dtype one the page reads and each range inside the file. */
async function readHeader(src) {
  const fail = why => { throw new ModelError(`${src.name}: ${why}`); };
  const head = await src.read(0, 8);
  if (head.length < 8) fail(`${head.length} bytes: too short for a safetensors file`);
  const n = Number(new DataView(head.buffer, head.byteOffset, 8).getBigUint64(0, true));
  if (n > 100_000_000 || (src.size !== null && 8 + n > src.size))
    fail(`not a safetensors file: its header would be ${n} bytes`);
  let header;
  try { header = JSON.parse(new TextDecoder("utf-8", {fatal: true}).decode(await src.read(8, 8 + n))); }
  catch (e) { fail(`not a safetensors file: the header is not JSON (${e.message})`); }
  if (header === null || typeof header !== "object" || Array.isArray(header))
    fail("not a safetensors file: the header is not a JSON object");
  const tensors = new Map();
  for (const [key, info] of Object.entries(header)) {
    if (key === "__metadata__" || key.endsWith(IGNORED_SUFFIX)) continue;
    const item = STORED_BYTES[info?.dtype];
    if (!item) fail(`${key} is stored as ${info?.dtype}; lora reads F32, F16, BF16`);
    const [b, e] = Array.isArray(info.data_offsets) ? info.data_offsets : [];
    const count = Array.isArray(info.shape) ? info.shape.reduce((p, d) => p * d, 1) : NaN;
    if (!Number.isInteger(b) || !Number.isInteger(e) || e - b !== count * item || b < 0 ||
        (src.size !== null && 8 + n + e > src.size))
      fail(`not a readable safetensors file: ${key}'s data_offsets ${JSON.stringify(
        info.data_offsets)} do not hold its ${info.dtype} ${JSON.stringify(info.shape)}`);
    tensors.set(key, {dtype: info.dtype, shape: info.shape, begin: 8 + n + b, end: 8 + n + e,
                      source: src});
  }
  return tensors;
}

/** Every tensor of the files by name, checked against the module's model as
 *  lora.models.weights checks a folder: each expected tensor once, of its shape, nothing
 *  else; a tied model's lm_head.weight compared with the embedding when loaded. */
function checkedTensors(files) {
  const found = new Map(), where = `the config of this module (${LM.folder})`;
  for (const tensors of files)
    for (const [key, t] of tensors) {
      if (found.has(key)) throw new ModelError(`${t.source.name}: ${key} is also in ` +
        `${found.get(key).source.name}: a tensor listed twice`);
      found.set(key, t);
    }
  const expected = {...config.tensors};
  if (!LM.tied || found.has(HEAD)) expected[HEAD] = [LM.vocabSize, LM.hiddenSize];
  if (LM.tied && found.has(HEAD) && !found.has(EMBEDDING)) {   // the head is the embedding
    found.set(EMBEDDING, found.get(HEAD));
    found.delete(HEAD);
    delete expected[HEAD];
  }
  const first = files[0]?.values().next().value?.source.name ?? "the weights";
  for (const [name, shape] of Object.entries(expected)) {
    const t = found.get(name);
    if (!t) throw new ModelError(`${first}: ${name} [${shape.join(", ")}] is missing (${where} ` +
                                 `implies it: ${LM.architecture})`);
    if (t.shape.join() !== shape.join())
      throw new ModelError(`${t.source.name}: ${name} has shape [${t.shape.join(", ")}]; ` +
        `${where} implies [${shape.join(", ")}]`);
  }
  for (const [name, t] of found)
    if (!(name in expected)) throw new ModelError(`${t.source.name}: holds ${name}, which ` +
      `${LM.architecture} of ${where} does not have`);
  return found;
}

let halfTable = null;   // every float16 bit pattern's value, made once

function halfFloats() {
  if (!halfTable) {
    halfTable = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) {
      const e = (h >> 10) & 31, m = h & 1023, sign = h & 0x8000 ? -1 : 1;
      halfTable[h] = sign * (e === 0 ? m * 2 ** -24 : e === 31 ? (m ? NaN : Infinity) :
                             (1024 + m) * 2 ** (e - 25));
    }
  }
  return halfTable;
}

let bfloatTable = null;   // every bfloat16 bit pattern's float16 bits (halfBits of its value)

function bfloatHalves() {
  if (!bfloatTable) {
    bfloatTable = new Uint16Array(65536);
    const wide = new Float32Array(1), bits = new Uint32Array(wide.buffer);
    for (let b = 0; b < 65536; b++) {
      bits[0] = b << 16;
      bfloatTable[b] = halfBits(wide[0]);
    }
  }
  return bfloatTable;
}

/** A piece of a tensor (``bytes``, stored as ``from``) as the GPU stores it (``to``:
 *  float32 or float16): BF16 and F16 widened exactly, float16 rounded as numpy rounds;
 *  with the count of NaN or infinite values and of finite ones beyond float16. */
function converted(bytes, from, to) {
  const n = bytes.length / STORED_BYTES[from];
  const u8 = bytes.byteOffset % 4 ? bytes.slice() : bytes;   // views need aligned offsets
  const tally = {nonFinite: 0, beyond: 0, firstBeyond: null};
  if (from === "F16") {
    const bits = new Uint16Array(u8.buffer, u8.byteOffset, n);
    for (let i = 0; i < n; i++) tally.nonFinite += (bits[i] & 0x7c00) === 0x7c00;
    return {data: to === "float16" ? bits : Float32Array.from(bits, h => halfFloats()[h]), tally};
  }
  if (from === "BF16" && to === "float16") {   // every bfloat16 pattern's float16, made once
    const bits = new Uint16Array(u8.buffer, u8.byteOffset, n), half = new Uint16Array(n);
    const table = bfloatHalves();
    for (let i = 0; i < n; i++) {
      const h = table[bits[i]];
      half[i] = h;
      if ((h & 0x7c00) === 0x7c00 && (bits[i] & 0x7f80) !== 0x7f80) {   // finite, beyond
        tally.beyond += 1;
        tally.firstBeyond ??= new Float32Array(Uint32Array.of(bits[i] << 16).buffer)[0];
      } else tally.nonFinite += (bits[i] & 0x7f80) === 0x7f80;
    }
    return {data: half, tally};
  }
  let f32;
  if (from === "BF16") {
    const bits = new Uint16Array(u8.buffer, u8.byteOffset, n), wide = new Uint32Array(n);
    for (let i = 0; i < n; i++) wide[i] = bits[i] << 16;
    f32 = new Float32Array(wide.buffer);
  } else f32 = new Float32Array(u8.buffer, u8.byteOffset, n);
  if (to === "float32") {
    for (let i = 0; i < n; i++) tally.nonFinite += !Number.isFinite(f32[i]);
    return {data: f32, tally};
  }
  const half = new Uint16Array(n);
  for (let i = 0; i < n; i++) {
    half[i] = halfBits(f32[i]);
    const finite = Number.isFinite(f32[i]);
    tally.nonFinite += (half[i] & 0x7c00) === 0x7c00 && !finite;
    if (finite && (half[i] & 0x7c00) === 0x7c00) {
      tally.beyond += 1;
      tally.firstBeyond ??= f32[i];
    }
  }
  return {data: half, tally};
}

/** A running hash of stored values (-0 as 0), to tell a tied head from the embedding. */
function hashed(hash, data) {
  const words = data instanceof Float32Array ? new Uint32Array(data.buffer, data.byteOffset,
                                                               data.length) : data;
  const zero = data instanceof Float32Array ? 0x80000000 : 0x8000;
  let [h1, h2, n] = hash;   // n: the values hashed before (a tensor comes in pieces)
  for (let i = 0; i < words.length; i++, n++) {
    const w = words[i] === zero ? 0 : words[i];
    h1 = Math.imul(h1 ^ w, 16777619) >>> 0;
    h2 = Math.imul(h2 ^ ((w + n) >>> 0), 2246822519) >>> 0;
  }
  return [h1, h2, n];
}

/** What loading reads, in file order: per weight buffer its tensor's elements (a chunk of
 *  rows for the embedding or head past the binding limit), and a tied model's
 *  lm_head.weight where the file holds one (read to compare, not kept). */
function loadReads(found) {
  const reads = [], tensors = [...new Set([...found.values()].map(t => t.source))];
  const cols = name => found.get(name).shape.length > 1 ? found.get(name).shape[1] :
    found.get(name).shape[0];
  for (const w of config.weights)
    reads.push({tensor: w.tensor, t: found.get(w.tensor), buffer: w.buffer, to: w.dtype,
                start: w.first * cols(w.tensor), count: w.rows * cols(w.tensor)});
  if (LM.tied && found.has(HEAD))
    reads.push({tensor: HEAD, t: found.get(HEAD), buffer: null, to: config.dtype === "f16" ?
                "float16" : "float32", start: 0, count: LM.vocabSize * LM.hiddenSize});
  const order = r => [tensors.indexOf(r.t.source), r.t.begin + r.start * STORED_BYTES[r.t.dtype]];
  return reads.sort((p, q) => order(p)[0] - order(q)[0] || order(p)[1] - order(q)[1]);
}

/** A tensor's tally, once its last piece is read: ModelError as lora.models.weights words
 *  a value float16 cannot hold and a NaN or infinite one. */
function checkTally(t, tensor, tally) {
  const size = t.shape.reduce((p, d) => p * d, 1);
  if (tally.beyond) throw new ModelError(`${t.source.name}: ${tensor} holds ` +
    `${tally.firstBeyond}, which does not fit float16 (largest finite 65504.0); ` +
    `${tally.beyond} of ${size} values are beyond it`);
  if (tally.nonFinite) throw new ModelError(`${t.source.name}: ${tensor}: ${tally.nonFinite} ` +
    `of ${size} values are NaN or infinite`);
}

/** Every weight into its buffer, a piece at a time (only that piece in memory). */
async function uploadWeights(device, own, found, onProgress) {
  const reads = loadReads(found), left = new Map(), tallies = new Map();
  for (const r of reads) left.set(r.tensor, (left.get(r.tensor) ?? 0) + 1);
  const hashes = {[EMBEDDING]: [2166136261, 0, 0], [HEAD]: [2166136261, 0, 0]};
  const total = reads.reduce((n, r) => n + r.count * STORED_BYTES[r.t.dtype], 0);
  let loaded = 0;
  for (const r of reads) {
    const item = STORED_BYTES[r.t.dtype], tally = tallies.get(r.tensor) ?? {nonFinite: 0,
      beyond: 0, firstBeyond: null};
    tallies.set(r.tensor, tally);
    for (let at = 0; at < r.count; at += PIECE) {
      const n = Math.min(PIECE, r.count - at), begin = r.t.begin + (r.start + at) * item;
      const bytes = await r.t.source.read(begin, begin + n * item);
      if (bytes.length < n * item) throw new ModelError(`${r.t.source.name}: the file ends ` +
        `within ${r.tensor} (byte ${begin + bytes.length}; truncated?)`);
      const {data, tally: piece} = converted(bytes, r.t.dtype, r.to);
      tally.nonFinite += piece.nonFinite;
      tally.beyond += piece.beyond;
      tally.firstBeyond ??= piece.firstBeyond;
      if (r.tensor in hashes && LM.tied && found.has(HEAD))
        hashes[r.tensor] = hashed(hashes[r.tensor], data);
      if (r.buffer) writePadded(device, own[r.buffer], at * (r.to === "float16" ? 2 : 4), data);
      loaded += n * item;
      onProgress?.({loaded, total, tensor: r.tensor});
    }
    left.set(r.tensor, left.get(r.tensor) - 1);
    if (!left.get(r.tensor)) checkTally(r.t, r.tensor, tally);
  }
  if (LM.tied && found.has(HEAD) && hashes[HEAD].join() !== hashes[EMBEDDING].join())
    throw new ModelError(`${found.get(HEAD).source.name}: ${HEAD} holds other values than ` +
      `${EMBEDDING}, so Python's loader would not tie them, but this module was exported ` +
      `with a tied head; export it from this model's folder`);
}

/** queue.writeBuffer of ``data`` at ``offset``, padded to whole 4 bytes. */
function writePadded(device, buffer, offset, data) {
  let bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (bytes.length % 4) {
    const padded = new Uint8Array(bytes.length + 4 - (bytes.length % 4));
    padded.set(bytes);
    bytes = padded;
  }
  device.queue.writeBuffer(buffer, offset, bytes);
}

// ---------------------------------------------------------------- adapters

/** A fresh adapter as peft makes one: A uniform in +-1/sqrt(inDim) (Kaiming-uniform with
 *  a = sqrt(5)), B = 0; drawn by a seeded generator of this page (mulberry32 of seed +
 *  the module's index), not numpy's: Python's fresh A differs; give both one adapter. */
function freshLayer(info, seed) {
  let state = (seed * 0x9E3779B1 + 0x7F4A7C15) >>> 0;
  const next = () => {
    state = (state + 0x6D2B79F5) >>> 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const bound = 1 / Math.sqrt(info.inDim);
  const a = Float32Array.from({length: info.rank * info.inDim}, () => (2 * next() - 1) * bound);
  return {a, b: new Float32Array(info.outDim * info.rank)};
}

/** ``layers`` ({module: {a, b, rank?, inDim?, outDim?, scale?}}: readPeftAdapter's, or
 *  adapters()') checked against the module's adapters: each module one of them, of its
 *  rank, dims and scale (baked into the kernels), a and b Float32Arrays of their sizes. */
function checkedLayers(layers, who, exact) {
  const mine = Object.keys(config.adapters);
  if (layers === null || typeof layers !== "object" || ArrayBuffer.isView(layers))
    throw new TypeError(`${who}: expected {module: {a, b, ...}} (readPeftAdapter's layers), ` +
                        `got ${layers === null ? "null" : layers?.constructor?.name ?? typeof layers}`);
  const names = Object.keys(layers), listed = list => `[${list.slice(0, 4).join(", ")}` +
    `${list.length > 4 ? `, and ${list.length - 4} more` : ""}]`;
  const unknown = names.filter(n => !mine.includes(n));
  if (unknown.length || (exact && names.length !== mine.length))
    throw new RangeError(`${who}: the adapter adapts ${listed(names.sort())}; this model adapts ` +
                         `${listed([...mine].sort())}`);
  for (const [module, layer] of Object.entries(layers)) {
    const want = config.adapters[module];
    const differ = ["rank", "inDim", "outDim"].filter(k => layer?.[k] !== undefined &&
      layer[k] !== want[k]).map(k => `${k} ${layer[k]} (this model's ${want[k]})`);
    if (typeof layer?.scale === "number" && Math.fround(layer.scale) !== Math.fround(want.scale))
      differ.push(`scale ${layer.scale} (this model's ${want.scale})`);
    for (const [part, count] of [["a", want.rank * want.inDim], ["b", want.outDim * want.rank]]) {
      if (!(layer?.[part] instanceof Float32Array))
        throw new TypeError(`${who}: ${module}.${part} must be a Float32Array (row-major), got ` +
                            `${layer?.[part]?.constructor?.name ?? typeof layer?.[part]}`);
      if (layer[part].length !== count) differ.push(`${part} of ${layer[part].length} values ` +
                                                    `(this model's ${count})`);
    }
    if (differ.length) throw new RangeError(`${who}: ${module} does not fit this model: ` +
      `${differ.join("; ")}. Rank and scale are baked into the kernels: export the module ` +
      `with the adapter's rank and alpha (--rank, --alpha)`);
  }
  return layers;
}

/** The adapters' host values {module: {a, b, rank, inDim, outDim, alpha, scale}}. */
function layersOf(values) {
  const out = {};
  for (const [module, info] of Object.entries(config.adapters)) {
    const {a, b} = values[module];
    out[module] = {a, b, rank: info.rank, inDim: info.inDim, outDim: info.outDim,
                   alpha: info.alpha, scale: info.scale};
  }
  return out;
}

/** Write adapters' A and B where the optimizer keeps them (f32) and, in an f16 model,
 *  where the kernels read them (float16, rounded as numpy rounds). */
function writeLayers(device, own, layers) {
  for (const [module, {a, b}] of Object.entries(layers)) {
    const info = config.adapters[module];
    for (const [values, master, stored] of [[a, info.masterA, info.a], [b, info.masterB, info.b]]) {
      device.queue.writeBuffer(own[master], 0, values);
      if (stored !== master) writePadded(device, own[stored], 0, Uint16Array.from(values, halfBits));
    }
  }
}

// ---------------------------------------------------------------- buffers and graphs

/** A group's buffers made (zeros, or their first contents from the module); refused,
 *  naming the group and its bytes, where the device cannot make them. */
async function allocate(device, own, group, who) {
  device.pushErrorScope("out-of-memory");
  device.pushErrorScope("validation");
  const made = [];
  for (const [name, info] of Object.entries(buffers)) {
    if (info.group !== group) continue;
    own[name] = device.createBuffer({label: `lora ${name}`, size: Math.max(16,
      Math.ceil(info.bytes / 4) * 4), usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC |
      GPUBufferUsage.COPY_DST});
    made.push(name);
    if (info.init) writePadded(device, own[name], 0, base64Bytes(info.init));
  }
  const [invalid, full] = [await device.popErrorScope(), await device.popErrorScope()];
  if (invalid || full) {
    for (const name of made) { own[name].destroy(); delete own[name]; }
    throw new Error(`${who}: the device could not make the ${group} buffers ` +
      `(${config.memory[group]} bytes): ${(full ?? invalid).message}`);
  }
}

/** The limits the module's kernels were built within, checked against the device's. */
function checkLimits(device, who) {
  const short = Object.entries(config.limits).filter(([k, v]) => (device.limits?.[k] ?? 0) < v);
  if (short.length) throw new Error(`${who}: this module binds up to ` +
    `${short.map(([k, v]) => `${k} = ${v}`).join(" and ")} bytes, over the device's ` +
    `${short.map(([k]) => device.limits?.[k]).join(" and ")}: request them with ` +
    `adapter.requestDevice({requiredLimits: ${JSON.stringify(Object.fromEntries(short))}}) ` +
    `where adapter.limits allows, or export with smaller --max-binding-size / --max-buffer-size`);
}

/** A graph's steps ready to encode: per dispatch its pipeline, bind group and grid (the
 *  uniforms' values at decode step ``k``), per copy its buffers. */
function compiled(device, own, steps, k, uniform) {
  return steps.map(st => {
    if (st.copy) return {copy: [own[st.copy[0]], own[st.copy[1]], st.copy[2]]};
    const kernel = kernels[st.kernel], use = {};
    for (const [binding, name] of Object.entries(st.buffers)) use[binding] = own[name];
    for (const [binding, [first, per]] of Object.entries(st.uniforms ?? {}))
      use[binding] = uniform(first + per * k);
    const s = stateOf(device, kernel);
    return {pipeline: pipelineOf(device, kernel, s, {}), grid: grid3(kernel, st.grid),
            group: bindGroupOf(device, kernel, s, resourcesOf(device, kernel, use))};
  });
}

/** Record a compiled graph into ``enc`` (its dispatches in compute passes, copies between). */
function encodeGraph(enc, ops, label) {
  let pass = null;
  for (const op of ops) {
    if (op.copy) {
      pass?.end();
      pass = null;
      enc.copyBufferToBuffer(op.copy[0], 0, op.copy[1], 0, op.copy[2]);
      continue;
    }
    pass ??= enc.beginComputePass({label});
    pass.setPipeline(op.pipeline);
    pass.setBindGroup(0, op.group);
    pass.dispatchWorkgroups(...op.grid);
  }
  pass?.end();
}

// ---------------------------------------------------------------- generation's host part

/** One token id or several, each in the vocabulary (lora.models.generate._ids). */
function tokenIds(value, what) {
  const ids = typeof value === "number" ? [value] : Array.isArray(value) ||
    ArrayBuffer.isView(value) ? Array.from(value) : null;
  if (!ids || ids.some(i => !Number.isInteger(i) || i < 0 || i >= LM.vocabSize))
    throw new RangeError(`CausalLM.generate: ${what} must be token ids (0..${LM.vocabSize - 1}), ` +
                         `got ${JSON.stringify(value)}`);
  return ids;
}

/** Steps up to the one where the last sequence gave its first eos id (generate._end). */
function endOf(made, eos) {
  const rows = made[0].length;
  let end = 0;
  for (let j = 0; j < rows; j++) end = Math.max(end, made.findIndex(step => eos.includes(step[j])) + 1);
  return end;
}

/** The prompt rows and the new ids, each row's ids after its first eos replaced by
 *  ``pad`` as transformers pads a finished sequence (generate._finished). */
function finished(prompt, made, eos, pad) {
  return prompt.map((row, j) => {
    const out = made.map(step => step[j]);
    const hit = out.findIndex(id => eos.includes(id));
    if (hit >= 0) out.fill(pad, hit + 1);
    return [...row, ...out];
  });
}

/** generate's checks beyond the batch's: the new tokens' count, the positions they
 *  reach, the module's baked sizes; the eos ids and the pad id. */
function generationPlan(batch, options) {
  const call = "CausalLM.generate", {maxNewTokens, eosTokenId = null, padTokenId = null} = options;
  if (!Number.isInteger(maxNewTokens) || maxNewTokens < 1)
    throw new RangeError(`${call}: maxNewTokens must be a positive int, got ` +
                         `${JSON.stringify(maxNewTokens) ?? String(maxNewTokens)}`);
  const last = Math.max(...batch.positions.map(row => row[batch.seq - 1]));
  if (last + maxNewTokens > LM.maxPositions)
    throw new RangeError(`${call}: the prompt's last position ${last} plus ${maxNewTokens} new ` +
      `tokens passes the model's max_position_embeddings (${LM.maxPositions})`);
  if (maxNewTokens > SHAPES.newTokens)
    throw new RangeError(`${call}: maxNewTokens ${maxNewTokens} is over this module's ` +
      `${SHAPES.newTokens} (--new-tokens ${SHAPES.newTokens} at export: the KV cache holds ` +
      `the prompt and that many)`);
  const eos = tokenIds(eosTokenId ?? LM.eosTokenIds, "eosTokenId");
  const pad = padTokenId !== null ? tokenIds(padTokenId, "padTokenId")[0] :
    LM.padTokenId ?? eos[0] ?? 0;
  return {count: maxNewTokens, eos, pad};
}

// ---------------------------------------------------------------- the model

const copyLayers = layers => Object.fromEntries(Object.entries(layers).map(([m, l]) =>
  [m, {...l, a: Float32Array.from(l.a), b: Float32Array.from(l.b)}]));

class CausalLM {
  constructor(device, own, layers, keep) {
    this.device = device;
    this.own = own;
    this.groups = new Map([["model", Promise.resolve()]]);
    this.prepared = new Map();
    this.cache = new Map();      // compiled graphs ("decode k": decode step k's)
    this.uniforms = new Map();   // u32 value -> its uniform buffer
    this.taken = 0;
    this.counted = [];
    this.history = null;
    this.capacity = 0;
    this.keep = keep;
    this.kept = {steps: 0, layers: copyLayers(layers)};
    this.pending = new Set();
    this.values = {...config.optimizer.values};
    const hyper = buffers[config.optimizer.buffer];
    this.hyper = new Float32Array(base64Bytes(hyper.init).buffer.slice(0));
    this.destroyed = false;
  }

  get config() { return config; }
  /** Training steps taken. */
  get steps() { return this.taken; }
  /** The optimizer's settings now ({lr, weightDecay, ...}, and the schedule). */
  get settings() { return {...this.values, schedule: config.optimizer.schedule}; }
  /** writePeftAdapter's options for this model's adapters (Python's save_adapter's). */
  get peftOptions() {
    const first = Object.values(config.adapters)[0];
    return {targetModules: config.targetModules, useRslora: first.useRslora,
            taskType: "CAUSAL_LM", loraDropout: config.loraDropout};
  }

  /** Change optimizer settings from the next step on (one small write): lr, weightDecay,
   *  beta1, beta2, eps (or momentum), warmup, total, minRatio, maxGradNorm. */
  set(changes) {
    this.alive("CausalLM.set");
    checkSettings(changes, this.values, "CausalLM.set");
    for (const [key, value] of Object.entries(changes)) {
      this.values[key] = value;
      this.hyper[config.optimizer.index[key]] = value;
    }
    this.device.queue.writeBuffer(this.own[config.optimizer.buffer], 0, this.hyper);
  }

  /** Throws where the model was destroyed or its device lost (saying where the last
   *  kept adapter is). */
  alive(what) {
    if (this.destroyed) throw new Error(`${what}: this model was destroyed (lm.destroy()); ` +
                                        `load another with loadCausalLM`);
    try { checkDevice(this.device, what); } catch (e) { throw this.lostNote(e); }
  }

  lostNote(error) {
    if (!this.keep || !String(error?.message).includes("GPUDevice was lost")) return error;
    return new Error(`${error.message}. The adapter of step ${this.kept.steps} (the last ` +
                     `whose copy came back) is kept: await lm.keptAdapter()`);
  }

  /** The group of ``graph`` (and the buffers groups share) allocated and its pipelines
   *  compiled (once). */
  async ready(graph, who) {
    for (const group of ["shared", GRAPH_GROUP[graph]]) {
      if (!this.groups.has(group)) {
        const made = allocate(this.device, this.own, group, who);
        this.groups.set(group, made);
        made.catch(() => this.groups.delete(group));
      }
      await this.groups.get(group);
    }
    if (!this.prepared.has(graph)) this.prepared.set(graph, Promise.all([...new Set(
      graphs[graph].filter(st => !st.copy).map(st => st.kernel))].map(k =>
      prepareKernel(this.device, kernels[k]))));
    await this.prepared.get(graph);
  }

  ops(graph, k = 0) {
    const key = graph === "decode" ? `decode ${k}` : graph;
    if (!this.cache.has(key))
      this.cache.set(key, compiled(this.device, this.own, graphs[graph], k, v => this.uniform(v)));
    return this.cache.get(key);
  }

  uniform(value) {
    if (!this.uniforms.has(value)) {
      const buf = this.device.createBuffer({label: `lora uniform ${value}`, size: 16,
                                            usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST});
      this.device.queue.writeBuffer(buf, 0, Uint32Array.of(value, 0, 0, 0));
      this.uniforms.set(value, buf);
    }
    return this.uniforms.get(value);
  }

  write(name, values) { this.device.queue.writeBuffer(this.own[name], 0, values); }

  async read(name, bytes, what) {
    try { return await readBack(this.device, this.own[name], bytes, what); }
    catch (e) { throw this.lostNote(e); }
  }

  /** Run ``graph`` once (its inputs written), in one submit. */
  submit(graph, label, extra = null) {
    const enc = this.device.createCommandEncoder({label});
    encodeGraph(enc, this.ops(graph), label);
    const after = extra?.(enc);
    this.device.queue.submit([enc.finish()]);
    return after;
  }

  /** The adapted model's logits, a Float32Array [batch, seq, vocab] (row-major) of
   *  ``inputIds`` [batch, seq] (a flat array: one sequence); positions 0..seq-1 in every
   *  row, as lora.CausalLM.logits (a query that sees no key, a left pad, gets 0 from
   *  attention). Padded into the module's [batch, seq] after the tokens. */
  async logits(inputIds, {attentionMask = null} = {}) {
    const call = "CausalLM.logits";
    this.alive(call);
    const batch = checkBatch(inputIds, null, attentionMask, call, false);
    const fit = baked(batch, SHAPES.batch, SHAPES.seq, call, false, ["--batch", "--seq"]);
    await this.ready("logits", call);
    this.alive(call);
    const io = config.io.logits, V = LM.vocabSize, item = config.dtype === "f16" ? 2 : 4;
    for (const key of ["ids", "keep", "positions"]) this.write(io[key], fit[key]);
    this.submit("logits", call);
    const raw = await this.read(io.logits, SHAPES.batch * SHAPES.seq * V * item, call);
    const all = item === 2 ? Float32Array.from(new Uint16Array(raw), h => halfFloats()[h]) :
      new Float32Array(raw);
    const out = new Float32Array(batch.batch * batch.seq * V);
    for (let r = 0; r < batch.batch; r++)
      out.set(all.subarray(r * SHAPES.seq * V, (r * SHAPES.seq + batch.seq) * V),
              r * batch.seq * V);
    return out;
  }

  /** Greedy decoding with a KV cache on the GPU, as lora.CausalLM.generate (and
   *  transformers' generate(do_sample=False)): the prompt rows and the new ids, one array a
   *  row. Options: maxNewTokens (required), eosTokenId (one or several; default the
   *  config's), attentionMask (0 at left padding), padTokenId, onToken({step, ids}) for
   *  each new token as read back (ids: one a sequence), stepsPerSubmit (decode steps
   *  between reads, default 8). Prompts are left-padded into the module's [genBatch,
   *  prompt] (masked, so each row's result is its own). */
  async generate(inputIds, options = {}) {
    const call = "CausalLM.generate";
    this.alive(call);
    const batch = checkBatch(inputIds, null, options.attentionMask ?? null, call, false, true);
    const plan = generationPlan(batch, options);
    const fit = baked(batch, SHAPES.genBatch, SHAPES.prompt, call, true,
                      ["--gen-batch", "--prompt-tokens"]);
    await this.ready("prefill", call);
    if (plan.count > 1) await this.ready("decode", call);
    this.alive(call);
    const made = await this.decode(this.prefill(fit), batch.batch, plan, options);
    return finished(batch.ids, made, plan.eos, plan.pad);
  }

  /** The prompt's pass: the cache's mask, ids and positions written, past 0; returns the
   *  first decode step's positions (each row's last position + 1). */
  prefill(fit) {
    const io = config.io.generate, G = SHAPES.genBatch, P = SHAPES.prompt;
    const L = P + SHAPES.newTokens, keep = new Uint32Array(G * L).fill(1);
    for (let r = 0; r < G; r++) keep.set(fit.keep.subarray(r * P, (r + 1) * P), r * L);
    this.write(io.keep, keep);
    this.write(io.ids, fit.ids);
    this.write(io.positions, fit.positions);
    this.write(io.past, Uint32Array.of(0));
    this.write(io.offset, Uint32Array.of(0));   // where decode steps read their ids
    this.submit("prefill", "CausalLM.generate prefill");
    return Uint32Array.from({length: G}, (_, r) => fit.positions[(r + 1) * P - 1] + 1);
  }

  /** Decode steps until every sequence gave an eos id or plan.count ids are made
   *  (generate._decode): [steps][rows] of the first ``rows`` sequences. */
  async decode(next, rows, plan, options) {
    const io = config.io.generate, G = SHAPES.genBatch, {count, eos} = plan;
    const per = options.stepsPerSubmit ?? config.stepsPerSubmit;
    if (!Number.isInteger(per) || per < 1) throw new RangeError(`CausalLM.generate: ` +
      `stepsPerSubmit must be a positive int, got ${per}`);
    this.write(io.past, Uint32Array.of(SHAPES.prompt));
    this.write(io.next, next);
    let made = 1, told = 0;
    for (;;) {
      const all = new Uint32Array(await this.read(io.out, SHAPES.newTokens * G * 4,
                                                  "CausalLM.generate"));
      const ids = Array.from({length: made}, (_, s) => Array.from(all.subarray(s * G, s * G + rows)));
      const done = eos.length > 0 && ids[0].every((_, j) => ids.some(step => eos.includes(step[j])));
      const end = done ? endOf(ids, eos) : made;
      for (; told < end; told++) options.onToken?.({step: told, ids: ids[told]});
      if (done || made === count) return ids.slice(0, end);
      const steps = Math.min(per, count - made);
      const enc = this.device.createCommandEncoder({label: "CausalLM.generate"});
      for (let k = 0; k < steps; k++) encodeGraph(enc, this.ops("decode", made - 1 + k),
                                                  "CausalLM.generate decode");
      this.device.queue.submit([enc.finish()]);
      made += steps;
    }
  }

  /** One training step on ``inputIds`` [batch, seq] with transformers' meaning (labels
   *  default to the ids, shifted inside, -100 ignored; attentionMask 0 at padding), as
   *  lora.CausalLM.step: the forward, loss, backward and optimizer in one submit, nothing
   *  read back. Padded into the module's [batch, seq] after the tokens, the pads'
   *  labels ignored (the loss and gradients are the batch's own). */
  async step(inputIds, {labels = null, attentionMask = null} = {}) {
    const call = "CausalLM.step";
    this.alive(call);
    const batch = checkBatch(inputIds, labels, attentionMask, call, true);
    const fit = baked(batch, SHAPES.batch, SHAPES.seq, call, false, ["--batch", "--seq"]);
    await this.ready("train", call);
    this.alive(call);
    const io = config.io.train, lossBytes = SHAPES.batch * SHAPES.seq * 4;
    for (const key of ["ids", "keep", "positions", "labels"]) this.write(io[key], fit[key]);
    let old = null;
    const staging = this.submit("train", call, enc => {
      if (this.taken === this.capacity) old = this.grow(enc, lossBytes);
      enc.copyBufferToBuffer(this.own[io.losses], 0, this.history, this.taken * lossBytes,
                             lossBytes);
      return this.keep ? this.copyAdapters(enc) : null;
    });
    old?.destroy();
    this.taken += 1;
    this.counted.push(batch.counted);
    if (staging) this.keepWhenRead(staging, this.taken);
  }

  /** A history of every step's per-token losses, twice as long, the old one copied in. */
  grow(enc, lossBytes) {
    const old = this.history;
    this.capacity = Math.max(64, 2 * this.capacity);
    this.history = this.device.createBuffer({label: "lora loss history",
      size: this.capacity * lossBytes, usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST});
    if (old) enc.copyBufferToBuffer(old, 0, this.history, 0, this.taken * lossBytes);
    return old;
  }

  /** Every adapter's f32 A and B copied into one staging buffer (in ``enc``). */
  copyAdapters(enc) {
    const parts = Object.values(config.adapters).flatMap(a => [a.masterA, a.masterB]);
    const bytes = parts.reduce((n, name) => n + buffers[name].bytes, 0);
    const staging = this.device.createBuffer({label: "lora adapter copy", size: bytes,
      usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST});
    let at = 0;
    for (const name of parts) {
      enc.copyBufferToBuffer(this.own[name], 0, staging, at, buffers[name].bytes);
      at += buffers[name].bytes;
    }
    return staging;
  }

  /** The adapters of a staging copy, {module: {a, b}}. */
  static layersIn(raw) {
    const out = {};
    let at = 0;
    for (const [module, info] of Object.entries(config.adapters)) {
      const [na, nb] = [info.rank * info.inDim, info.outDim * info.rank];
      out[module] = {a: new Float32Array(raw, at, na).slice(), b: new Float32Array(raw,
        at + buffers[info.masterA].bytes, nb).slice()};
      at += buffers[info.masterA].bytes + buffers[info.masterB].bytes;
    }
    return layersOf(out);
  }

  /** Keep step ``steps``' adapters on the host once their copy is read (a lost device
   *  rejects the read: the last kept stays). */
  keepWhenRead(staging, steps) {
    const done = staging.mapAsync(GPUMapMode.READ).then(() => {
      const layers = CausalLM.layersIn(staging.getMappedRange());
      if (steps > this.kept.steps) this.kept = {steps, layers};
      staging.unmap();
    }, () => {}).finally(() => { staging.destroy(); this.pending.delete(done); });
    this.pending.add(done);
  }

  /** {steps, layers}: the adapters of the last step whose copy came back to the host (or
   *  as loaded), for writePeftAdapter, also after the device was lost; waits for the
   *  copies under way. */
  async keptAdapter() {
    await Promise.all([...this.pending]);
    return {steps: this.kept.steps, layers: copyLayers(this.kept.layers)};
  }

  /** The last step's loss, of the forward before its update (reads back). */
  async loss() {
    this.alive("CausalLM.loss");
    if (!this.taken) throw new Error("CausalLM.loss: no step recorded yet; call " +
                                     "step(inputIds) first");
    const sums = new Float32Array(await this.read(config.io.train.losses,
                                                  SHAPES.batch * SHAPES.seq * 4, "CausalLM.loss"));
    return meanOf(sums, this.counted[this.taken - 1]);
  }

  /** The loss of every step taken, from the history the steps keep on the GPU. */
  async losses() {
    this.alive("CausalLM.losses");
    if (!this.taken) return [];
    const per = SHAPES.batch * SHAPES.seq;
    let raw;
    try { raw = await readBack(this.device, this.history, this.taken * per * 4, "CausalLM.losses"); }
    catch (e) { throw this.lostNote(e); }
    const sums = new Float32Array(raw);
    return this.counted.map((n, k) => meanOf(sums.subarray(k * per, (k + 1) * per), n));
  }

  /** Every adapter now: {module: {a, b, rank, inDim, outDim, alpha, scale}} (the f32 values
   *  the optimizer keeps), for writePeftAdapter(layers, lm.peftOptions). */
  async adapters() {
    this.alive("CausalLM.adapters");
    const enc = this.device.createCommandEncoder({label: "CausalLM.adapters"});
    const staging = this.copyAdapters(enc);
    this.device.queue.submit([enc.finish()]);
    try { await mapRead(this.device, staging, "CausalLM.adapters"); }
    catch (e) { staging.destroy(); throw this.lostNote(e); }
    const layers = CausalLM.layersIn(staging.getMappedRange());
    staging.unmap();
    staging.destroy();
    return layers;
  }

  /** Every adapter's A and B from ``layers`` (readPeftAdapter's: the model's adapted
   *  modules exactly, each of its rank and scale), as lora.CausalLM.load_adapter. */
  loadAdapter(layers) {
    this.alive("CausalLM.loadAdapter");
    checkedLayers(layers, "CausalLM.loadAdapter", true);
    writeLayers(this.device, this.own, layers);
    this.kept = {steps: this.taken, layers: copyLayers(layersOf(layers))};
  }

  /** Bytes on the device by part: the weights (and RoPE's tables), the adapters with
   *  their optimizer, and each of training, logits and generation once used. */
  memory() {
    const weights = new Set(config.weights.map(w => w.buffer));
    const out = {weights: 0, adapters: 0, train: 0, logits: 0, generate: 0, shared: 0};
    for (const [name, info] of Object.entries(buffers)) {
      if (!this.own[name]) continue;
      const part = info.group !== "model" ? info.group : weights.has(name) ||
        name.startsWith("rope.") ? "weights" : "adapters";
      out[part] += info.bytes;
    }
    return out;
  }

  /** Free every buffer the model made; any later call throws. */
  destroy() {
    for (const buf of [...Object.values(this.own), this.history, ...this.uniforms.values()])
      buf?.destroy();
    this.destroyed = true;
  }
}

function meanOf(sums, counted) {
  let total = 0;
  for (const v of sums) total += v;
  return counted ? total / counted : 0;
}

/** The model of this module on ``device``: its weights streamed from ``weights`` (a
 *  safetensors file: a URL, a Response, a Blob or File, its bytes, or an array of them
 *  for a sharded model; F32, F16 or BF16), every name and shape checked first; its
 *  adapters ``adapter`` (readPeftAdapter's layers, any of the adapted modules) or fresh
 *  ones (``seed``: this page's generator, see freshLayer). ``keepAdapter``: after each
 *  step copy the adapters back to the host (keptAdapter). ``onProgress({loaded, total,
 *  tensor})`` as the weights load. */
export async function loadCausalLM(device, weights, options = {}) {
  const {adapter = null, seed = config.seed, keepAdapter = true, onProgress = null} = options;
  checkDevice(device, "loadCausalLM");
  checkLimits(device, "loadCausalLM");
  if (!Number.isInteger(seed) || seed < 0 || seed >= 2 ** 32)
    throw new RangeError(`loadCausalLM: seed must be an int in [0, 2^32), got ${seed}`);
  const given = adapter === null ? {} : checkedLayers(adapter, "loadCausalLM: adapter", false);
  const list = Array.isArray(weights) ? weights : [weights];
  const sources = [];
  for (const [k, w] of list.entries()) sources.push(await openSource(w, k));
  const headers = [];
  for (const src of sources) headers.push(await readHeader(src));
  const found = checkedTensors(headers);
  const own = {};
  try {
    await allocate(device, own, "model", "loadCausalLM");
    await uploadWeights(device, own, found, onProgress);
    const start = Object.fromEntries(Object.keys(config.adapters).map((m, k) => [m, given[m] ?
      {a: given[m].a, b: given[m].b} : freshLayer(config.adapters[m], seed + k)]));
    writeLayers(device, own, start);
    return new CausalLM(device, own, layersOf(start), keepAdapter);
  } catch (e) {
    for (const buf of Object.values(own)) buf.destroy();
    throw e;
  }
}

/** The differences between a model folder's config.json (its text) and the one this
 *  module was exported for, as messages ([] where it fits). */
export function configDifferences(text) {
  let c;
  try { c = JSON.parse(text); } catch (e) { return [`config.json is not JSON (${e.message})`]; }
  const keys = {model_type: LM.modelType, vocab_size: LM.vocabSize, hidden_size: LM.hiddenSize,
                intermediate_size: LM.intermediateSize, num_hidden_layers: LM.layers,
                num_attention_heads: LM.heads};
  return Object.entries(keys).filter(([k, v]) => c?.[k] !== v).map(([k, v]) =>
    `${k} is ${JSON.stringify(c?.[k])}, this module's ${JSON.stringify(v)}`);
}
