// ---- many adapters in one batch: the pool (createPool) and its forward
// (pool.record), in the form lora.core.many_plan.chosen_form picks for the batch
// (chooseForm, from config.rule), or the one a caller names: a form of ``forms``.
const ITEM = config.dtype === "f16" ? 2 : 4;  // bytes of one element of A, B, x, output
const BAKED = {inDim: config.inDim, outDim: config.outDim, dtype: config.dtype,
               maxRank: config.maxRank};

/** The name (a key of ``forms``) of the form for a batch of ``rows`` rows with
 *  an adapter, of ``used`` distinct adapters, whose rows' mean rank is
 *  ``rank``: lora.core.many_plan.chosen_form's rule, its constants config.rule's. */
export function chooseForm(rows, used, rank) {
  const rule = config.rule;
  if (rows < rule.segmentRows * Math.max(used, 1)) return rule.decode;
  if (rows >= rule.fusedRows && rank >= rule.fusedRank) return rule.highRank;
  return rule.prefill;
}

/** ``ids`` (one int per row) as an Int32Array, each -1 (no adapter) or one of
 *  ``slots``; ``bound`` ends the range [-1, bound) the messages name. Throws
 *  as lora.core.many_plan.host_ids does, with its messages. */
export function checkIds(ids, slots, bound) {
  const values = ArrayBuffer.isView(ids) || Array.isArray(ids) ? Array.from(ids) : null;
  const odd = values === null ? -1 : values.findIndex(v => !Number.isInteger(v));
  if (typeof values?.[odd] === "string")
    throw new TypeError(`ids: got the name ${JSON.stringify(values[odd])} at row ${odd}; this ` +
      `pool routes rows by slot: the number pool.add returned for that adapter, or -1 for none`);
  if (values === null || odd >= 0)
    throw new TypeError(`ids: expected integers (an adapter's index, or -1 for none), got ` +
      (values === null ? `${typeof ids}` : `${String(values[odd])} at row ${odd}`));
  const used = new Set(slots);
  const bad = values.flatMap((v, r) => v === -1 || used.has(v) ? [] : [r]);
  if (bad.length) {
    const r = bad[0], v = values[r];
    const why = v < -1 || v >= bound ? `is outside [-1, ${bound})` :
      `names slot ${v}, which holds no adapter (slots in use: [${slots.join(", ")}])`;
    throw new RangeError(`ids: id ${v} at row ${r} ${why}; -1 means no adapter ` +
                         `(${bad.length} row(s) refused, nothing ran)`);
  }
  return Int32Array.from(values);
}

/** Rows sorted by adapter (rows of -1 left out, rows of one adapter in order)
 *  and the tiles over them, as lora.core.many_plan.segments: {order, tiles:
 *  (first index into order, row count <= tileTokens, slot, 0) per tile}. */
export function segments(ids, tileTokens) {
  const order = [...ids.keys()].filter(r => ids[r] >= 0).sort((p, q) => ids[p] - ids[q] || p - q);
  const tiles = [];
  for (let start = 0, end = 0; start < order.length; start = end) {
    const slot = ids[order[start]];
    while (end < order.length && ids[order[end]] === slot) end++;
    for (let first = start; first < end; first += tileTokens)
      tiles.push(first, Math.min(tileTokens, end - first), slot, 0);
  }
  return {order: Uint32Array.from(order), tiles: Uint32Array.from(tiles)};
}

/** Throws, naming ``form`` and the module's forms, unless it is null or one of them. */
function knownForm(form, who) {
  if (form !== null && !Object.hasOwn(forms, form))
    throw new RangeError(`${who}: no form ${JSON.stringify(form)}; this module has ` +
                         `${Object.keys(forms).map(f => JSON.stringify(f)).join(", ")}`);
}

/** A grid over the device's per-dimension limit split over z, as lora.core.plan.split_grid
 *  (the kernels index workgroup_id.x + workgroup_id.z * num_workgroups.x, or y). */
function splitGrid(kernel, [x, y, z], cap) {
  if (x <= cap && y <= cap) return [x, y, z];
  if (z !== 1 || (x > cap && y > cap) || Math.max(x, y) > cap * cap)
    throw new Error(`kernel ${kernel.name}: grid [${x}, ${y}, ${z}] cannot be split over z ` +
                    `within maxComputeWorkgroupsPerDimension = ${cap}`);
  const parts = Math.ceil(Math.max(x, y) / cap), per = Math.ceil(Math.max(x, y) / parts);
  return x > cap ? [per, y, parts] : [x, per, parts];
}

function halfValue(h) {
  const e = (h >> 10) & 31, m = h & 1023, sign = h & 0x8000 ? -1 : 1;
  return sign * (e === 0 ? m * 2 ** -24 : e === 31 ? (m ? NaN : Infinity) :
                 (1024 + m) * 2 ** (e - 25));
}

/** Values as the pool stores them: a Float32Array, or float16 bits. */
function stored(values) {
  return config.dtype === "f16" ? Uint16Array.from(values, halfBits) : Float32Array.from(values);
}

/** Free room of one buffer as sorted [start, length] runs: first fit, grown at
 *  the end by doubling (pool.py's Extents). */
class Extents {
  constructor(size) { this.size = size; this.runs = [[0, size]]; }
  find(n) { return this.runs.find(([, length]) => length >= n)?.[0] ?? null; }
  take(start, n) {
    const k = this.runs.findIndex(([s, length]) => s <= start && start < s + length);
    const [s, length] = this.runs[k];
    this.runs.splice(k, 1, ...[[s, start - s], [start + n, s + length - start - n]]
      .filter(([, l]) => l > 0));
  }
  give(start, n) {
    const runs = [...this.runs, [start, n]].sort((p, q) => p[0] - q[0]), merged = [runs[0]];
    for (const [s, length] of runs.slice(1)) {
      const last = merged[merged.length - 1];
      if (last[0] + last[1] === s) merged[merged.length - 1] = [last[0], last[1] + length];
      else merged.push([s, length]);
    }
    this.runs = merged;
  }
  grow(size) { this.give(this.size, size - this.size); this.size = size; }
  /** The size the buffer must grow to (doubling) for a run of n at its end. */
  fit(n) {
    const last = this.runs[this.runs.length - 1];
    const tail = last && last[0] + last[1] === this.size ? last[1] : 0;
    let size = Math.max(this.size, 1);
    while (size - this.size + tail < n) size *= 2;
    return size;
  }
}

/** The layer's A and B as the pool stores them, its rank and scale; throws,
 *  naming it ``what``, where it does not fit the pool (nothing changed yet). */
function checkedLayer(layer, what) {
  const {inDim, outDim, maxRank} = config;
  const numbers = v => Array.isArray(v) || ArrayBuffer.isView(v);
  if (layer === null || typeof layer !== "object" || !numbers(layer.a) || !numbers(layer.b))
    throw new TypeError(`${what}: expected a layer {a, b, rank, inDim, outDim, scale} as ` +
                        `readPeftAdapter returns, a and b arrays of numbers`);
  const rank = layer.rank;
  if (!Number.isInteger(rank) || rank < 1)
    throw new RangeError(`${what}: rank must be an integer >= 1, got ${rank}`);
  const [i, o] = [layer.inDim ?? layer.a.length / rank, layer.outDim ?? layer.b.length / rank];
  if (i === inDim && o === outDim &&
      (layer.a.length !== rank * inDim || layer.b.length !== outDim * rank))
    throw new RangeError(`${what}: rank ${rank} needs A of ${rank * inDim} values ([${rank}, ` +
      `${inDim}]) and B of ${outDim * rank} ([${outDim}, ${rank}]); a has ${layer.a.length}, ` +
      `b ${layer.b.length}`);
  if (i !== inDim || o !== outDim)
    throw new RangeError(`${what}: A [${rank}, ${i}] and B [${o}, ${rank}] (${layer.a.length} ` +
      `and ${layer.b.length} values) do not fit the pool: expected A [rank, ${inDim}] and B ` +
      `[${outDim}, rank]`);
  if (rank > maxRank)
    throw new RangeError(`${what}: rank ${rank} is over the pool's max_rank ${maxRank}; export ` +
                         `the module with --max-rank >= ${rank}`);
  const scale = Math.fround(layer.scale ??
                            layer.alpha / (layer.useRslora ? Math.sqrt(rank) : rank));
  if (!Number.isFinite(scale))
    throw new RangeError(`${what}: the scale must be a finite f32 (give scale, or alpha), got ` +
                         `${layer.scale ?? layer.alpha}`);
  const [a, b] = [stored(layer.a), stored(layer.b)];
  for (const [name, values] of [["A", a], ["B", b]]) {
    const finite = ITEM === 4 ? Number.isFinite : v => (v & 0x7c00) !== 0x7c00;
    const bad = values.reduce((n, v) => n + !finite(v), 0);
    if (bad) throw new RangeError(`${what}: ${name} has ${bad} NaN or infinite value(s) as ` +
      `${config.dtype}${ITEM === 2 ? " (float16 holds at most 65504)" : ""}`);
  }
  return {a, b, rank, scale};
}

/** A pool of adapters of this module's layer on ``device``: room for ``slots``
 *  adapters and ``rows`` A rows (the sum of their ranks) to start with, doubled
 *  as adds need. inDim, outDim, dtype and maxRank are the module's (config);
 *  given, they must match. */
export function createPool(device, options = {}) {
  checkDevice(device, "createPool");
  return new AdapterPool(device, options);
}

class AdapterPool {
  constructor(device, {slots = 4, rows = 64, ...baked} = {}) {
    for (const [key, value] of Object.entries(baked)) {
      if (!(key in BAKED)) throw new TypeError(`createPool: no option '${key}'; it takes slots, ` +
                                              `rows and ${Object.keys(BAKED).join(", ")}`);
      if (value !== BAKED[key]) throw new RangeError(`createPool: ${key} ${value} is not this ` +
        `module's ${BAKED[key]}; export another with python -m lora export --many`);
    }
    for (const [key, value] of [["slots", slots], ["rows", rows]])
      if (!Number.isInteger(value) || value < 1)
        throw new RangeError(`createPool: ${key} must be an integer >= 1, got ${value}`);
    this.device = device;
    this.hostTable = new Uint32Array(slots * 4);  // per slot: A row, B element, rank, scale bits
    this.aRoom = new Extents(rows);  // A rows
    this.bRoom = new Extents(rows * config.outDim);  // B elements
    const store = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC;
    this.buffers = {A: this.make("pool.A", rows * config.inDim * ITEM, store),
                    B: this.make("pool.B", rows * config.outDim * ITEM, store),
                    table: this.make("pool.table", slots * 16, store),
                    tokens: this.make("many.tokens", 16,
                                      GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST)};
  }

  make(label, size, usage) {
    return this.device.createBuffer({label, size: Math.max(16, Math.ceil(size / 16) * 16), usage});
  }

  /** The slots holding an adapter, in order. */
  get slots() {
    return [...Array(this.hostTable.length / 4).keys()].filter(s => this.hostTable[4 * s + 2]);
  }

  get size() { return this.slots.length; }

  rank(slot) { return this.hostTable[4 * this.used(slot) + 2]; }

  scale(slot) {
    return new Float32Array(this.hostTable.buffer, 4 * (4 * this.used(slot) + 3), 1)[0];
  }

  used(slot) {
    if (!this.slots.includes(slot))
      throw new RangeError(`pool: slot ${slot} holds no adapter (slots in use: ` +
                           `[${this.slots.join(", ")}])`);
    return slot;
  }

  /** Put ``layer`` (readPeftAdapter's {a, b, rank, inDim, outDim, scale}) in the
   *  first free slot, its A and B at the first free room that holds them (the
   *  table, A or B doubled where full, the others not moved); returns the slot.
   *  Refused, naming ``name``, before anything is written. */
  add(layer, name = "the adapter") {
    this.alive("pool.add");
    const {a, b, rank, scale} = checkedLayer(layer, name);
    let slot = this.hostTable.findIndex((v, k) => k % 4 === 2 && v === 0) >> 2;
    const rows = this.growth(this.aRoom, rank, "A rows", config.inDim, name);
    const elems = this.growth(this.bRoom, b.length, "B elements", 1, name);
    if (slot < 0) {  // from here on the device changes
      slot = this.hostTable.length / 4;
      const table = new Uint32Array(2 * this.hostTable.length);
      table.set(this.hostTable);
      this.hostTable = table;
      this.buffers.table = this.make("pool.table", table.byteLength,
                                     GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST);
    }
    if (rows !== null) this.bigger("A", rows * config.inDim * ITEM, this.aRoom, rows);
    if (elems !== null) this.bigger("B", elems * ITEM, this.bRoom, elems);
    const aAt = this.aRoom.find(rank), bAt = this.bRoom.find(b.length);
    this.aRoom.take(aAt, rank);
    this.bRoom.take(bAt, b.length);
    const queue = this.device.queue;
    queue.writeBuffer(this.buffers.A, aAt * config.inDim * ITEM, a);
    queue.writeBuffer(this.buffers.B, bAt * ITEM, b);
    this.hostTable.set([aAt, bAt, rank, new Uint32Array(Float32Array.of(scale).buffer)[0]],
                       4 * slot);
    queue.writeBuffer(this.buffers.table, 0, this.hostTable);
    return slot;
  }

  /** The size ``extents`` must grow to for ``n`` more, or null where it has room;
   *  throws (naming ``name``) where the buffer would outgrow one binding. */
  growth(extents, n, what, width, name) {
    if (extents.find(n) !== null) return null;
    const size = extents.fit(n), bytes = size * width * ITEM;
    const most = this.device.limits.maxStorageBufferBindingSize;
    if (bytes > most) throw new RangeError(`${name}: no room for ${n} more ${what}: the buffer ` +
      `would grow to ${bytes} bytes, over maxStorageBufferBindingSize = ${most}; remove ` +
      `adapters or create another pool`);
    return size;
  }

  /** The pool's ``role`` buffer replaced by one of ``bytes`` holding it at its
   *  start (a copy on the GPU, submitted now); the old one is left to the
   *  garbage collector, as an encoder not yet submitted may hold it. */
  bigger(role, bytes, extents, size) {
    const old = this.buffers[role], store = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST |
      GPUBufferUsage.COPY_SRC;
    this.buffers[role] = this.make(`pool.${role}`, bytes, store);
    const enc = this.device.createCommandEncoder({label: `lora many pool.${role} growth`});
    enc.copyBufferToBuffer(old, 0, this.buffers[role], 0, old.size);
    this.device.queue.submit([enc.finish()]);
    extents.grow(size);
  }

  /** Free ``slot`` and its room; the other adapters stay where they are. */
  remove(slot) {
    this.alive("pool.remove");
    const [aAt, bAt, rank] = this.hostTable.subarray(4 * this.used(slot), 4 * slot + 3);
    this.aRoom.give(aAt, rank);
    this.bRoom.give(bAt, rank * config.outDim);
    this.hostTable.fill(0, 4 * slot, 4 * slot + 4);
    this.device.queue.writeBuffer(this.buffers.table, 0, this.hostTable);
  }

  /** The form ``record`` takes for host ``ids`` (checked): chooseForm of the
   *  rows with an adapter, the adapters they name and their mean rank. */
  formFor(ids) {
    return this.chosen(checkIds(ids, this.slots, this.hostTable.length / 4));
  }

  chosen(flat) {
    const named = flat.filter(id => id >= 0);
    const rank = named.reduce((sum, id) => sum + this.hostTable[4 * id + 2], 0) / named.length;
    return chooseForm(named.length, new Set(named).size, named.length ? rank : 0);
  }

  /** output += scale_i * B_i @ (A_i @ x) for each row's adapter i: GPUBuffers x
   *  [T, inDim] and output [T, outDim] (config.dtype, row-major), ``ids`` T host
   *  ints (-1: no delta), checked first. ``form``: a key of ``forms``, default the
   *  one chooseForm picks. Writes the route (queue.writeBuffer), then records one
   *  compute pass; submits unless given an ``encoder`` (submit it before the next
   *  record of this pool: the route is the pool's). Returns the form's name, or
   *  null where no row has an adapter (nothing recorded). */
  record({x, output}, ids, {encoder = null, form = null} = {}) {
    checkDevice(this.device, "pool.record");
    this.alive("pool.record");
    const flat = checkIds(ids, this.slots, this.hostTable.length / 4);
    knownForm(form, "pool.record");
    if (!flat.length) throw new RangeError("ids: a batch has at least 1 row, got 0 ids");
    const most = this.device.limits.maxStorageBufferBindingSize;
    for (const [name, buf, dim] of [["x", x, config.inDim], ["output", output, config.outDim]]) {
      if (!(buf instanceof GPUBuffer))
        throw new TypeError(`pool.record: ${name} must be a GPUBuffer`);
      if (buf.size < flat.length * dim * ITEM || buf.size > most)
        throw new RangeError(`pool.record: ${name} has ${buf.size} bytes, needs ` +
          `${flat.length * dim * ITEM} (${flat.length} row(s) of ${dim} ${config.dtype}), at ` +
          `most maxStorageBufferBindingSize = ${most} (it is bound whole)`);
    }
    if (x === output) throw new RangeError("pool.record: output is also the x buffer");
    if (!flat.some(id => id >= 0)) return null;  // every row -1: the base alone
    const name = form ?? this.chosen(flat), shape = forms[name];
    const hBytes = shape.fused ? 0 : 4 * flat.length * config.rankStride;
    if (hBytes > most) throw new RangeError(`pool.record: form "${name}" needs h, ${hBytes} ` +
      `bytes (${flat.length} row(s) of ${config.rankStride} f32), over ` +
      `maxStorageBufferBindingSize = ${most}; record fewer rows at a time`);
    const [route, items] = this.routed(flat, shape);
    const all = {...this.buffers, x, output, ...route};
    if (hBytes) all.h = this.sized("h", hBytes);
    this.device.queue.writeBuffer(this.buffers.tokens, 0, Uint32Array.of(items));
    const enc = encoder || this.device.createCommandEncoder({label: "lora many"});
    const pass = enc.beginComputePass({label: `lora many ${name}`});
    const cap = this.device.limits.maxComputeWorkgroupsPerDimension;
    for (const step of shape.steps) {
      const grid = [...step.grid], kernel = kernels[step.kernel];
      grid[step.items] = items;
      const buffers = Object.fromEntries(Object.entries(step.buffers)
        .map(([binding, role]) => [binding, all[role]]));
      encodeKernel(pass, this.device, kernel, buffers, splitGrid(kernel, grid, cap));
    }
    pass.end();
    if (!encoder) this.device.queue.submit([enc.finish()]);
    return name;
  }

  /** [route, work items] of checked ids for the form ``shape``, written to the
   *  pool's buffers: {ids} and a row an item, or {order, tiles} and a tile an item. */
  routed(flat, shape) {
    if (!shape.segments) return [{ids: this.route("ids", flat)}, flat.length];
    const {order, tiles} = segments(flat, shape.tileTokens);
    return [{order: this.route("order", order), tiles: this.route("tiles", tiles)},
            tiles.length / 4];
  }

  /** The pool's buffer for ``role``, of at least ``bytes`` (a power of two,
   *  within maxStorageBufferBindingSize, where it grows; the old one is left to
   *  the garbage collector, as an encoder not yet submitted may hold it). */
  sized(role, bytes) {
    const have = this.buffers[role];
    if (!have || have.size < bytes) {
      const most = Math.floor(this.device.limits.maxStorageBufferBindingSize / 16) * 16;
      this.buffers[role] = this.make(`many.${role}`,
        Math.max(bytes, Math.min(2 ** Math.ceil(Math.log2(bytes)), most)),
        GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST);
    }
    return this.buffers[role];
  }

  /** The pool's buffer for ``role`` holding ``values`` at its start. */
  route(role, values) {
    const buf = this.sized(role, values.byteLength);
    this.device.queue.writeBuffer(buf, 0, values);
    return buf;
  }

  /** base + each row's delta as a Float32Array, from host arrays: x (T * inDim
   *  numbers), ids (T ints), base (T * outDim numbers, default zeros); ``form``
   *  as record's. */
  async forward(x, ids, base = null, {form = null} = {}) {
    this.alive("pool.forward");
    knownForm(form, "pool.forward");
    const flat = checkIds(ids, this.slots, this.hostTable.length / 4), t = flat.length;
    for (const [name, values, dim] of [["x", x, config.inDim], ["base", base, config.outDim]])
      if (values !== null && values?.length !== t * dim)
        throw new RangeError(`pool.forward: ${name} has ${values?.length} values, expected ` +
                             `${t * dim} (${t} row(s) of ${dim}: a row per id, ${t} id(s))`);
    const U = GPUBufferUsage, bytes = t * config.outDim * ITEM;
    const up = values => { const buf = this.make("many.host", values.byteLength, U.STORAGE |
      U.COPY_SRC | U.COPY_DST); this.device.queue.writeBuffer(buf, 0, values); return buf; };
    const xb = up(stored(x)), ob = up(stored(base ?? new Float32Array(t * config.outDim)));
    const read = this.device.createBuffer({size: ob.size, usage: U.MAP_READ | U.COPY_DST});
    const enc = this.device.createCommandEncoder({label: "lora many forward"});
    this.record({x: xb, output: ob}, flat, {encoder: enc, form});
    enc.copyBufferToBuffer(ob, 0, read, 0, ob.size);
    this.device.queue.submit([enc.finish()]);
    await mapRead(this.device, read, "pool.forward");
    const raw = read.getMappedRange(0, bytes).slice(0);
    for (const buf of [read, xb, ob]) buf.destroy();
    return ITEM === 4 ? new Float32Array(raw) : Float32Array.from(new Uint16Array(raw), halfValue);
  }

  /** Free the pool's buffers. */
  destroy() {
    for (const buf of Object.values(this.buffers)) buf.destroy();
    this.destroyed = true;
  }

  /** Throws where the pool was destroyed: its buffers are gone, and WebGPU would only
   *  log a validation error (a forward read back zeros). */
  alive(what) {
    if (this.destroyed)
      throw new Error(`${what}: this pool was destroyed (pool.destroy()); make another ` +
                      `with createPool`);
  }
}
