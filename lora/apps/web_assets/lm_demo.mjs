// ---- the page (lora.apps.web_lm.demo_page): this module's model fine-tuned on a text
const page = /*PAGE*/null;   // written at export: {steps, lr, command}
const $ = id => document.getElementById(id);
const BYTE_IDS = 256;   // the text is read as bytes: ids 0-255 (no tokenizer in the page)

/** The text's ids: its UTF-8 bytes (as python -m lora finetune-lm reads a folder without
 *  tokenizer.json). */
function textIds(bytes) {
  if (config.model.vocabSize < BYTE_IDS)
    throw new Error(`this model has ${config.model.vocabSize} token ids, fewer than the 256 ` +
      `byte values the page reads a text as (it has no tokenizer): export the page for a ` +
      `model whose vocab_size is at least 256`);
  return bytes;
}

/** The text of byte ids (an id past 255 shown as U+FFFD, as Python's byte codec). */
function textOf(ids) {
  const raw = ids.flatMap(i => i < BYTE_IDS ? [i] : [0xEF, 0xBF, 0xBD]);
  return new TextDecoder().decode(Uint8Array.from(raw));
}

/** The text cut into training sequences of the module's length (the rest dropped). */
function sequences(ids) {
  const S = config.shapes.seq, n = Math.floor(ids.length / S);
  if (!n) throw new Error(`the text holds ${ids.length} bytes; a training sequence is ${S} ` +
                          `(--seq at export)`);
  return Array.from({length: n}, (_, k) => Array.from(ids.subarray(k * S, (k + 1) * S)));
}

/** {weights, text, note} from the URL (?model=a.safetensors[,b.safetensors]&text=t.txt)
 *  or from the files picked; null until both are there. */
function chosen() {
  const query = new URLSearchParams(location.search);
  if (query.get("model") && query.get("text"))
    return {weights: query.get("model").split(","), text: fetch(query.get("text"))
      .then(r => r.arrayBuffer()), config: null, note: query.get("model")};
  const files = [...$("folder").files, ...$("files").files];
  const weights = files.filter(f => f.name.endsWith(".safetensors"))
    .sort((p, q) => p.name < q.name ? -1 : 1);
  const text = $("text").files[0], cfg = files.find(f => f.name === "config.json");
  if (!weights.length || !text) return null;
  return {weights, text: text.arrayBuffer(), config: cfg?.text() ?? null,
          note: weights.map(f => f.name).join(", ")};
}

function draw(losses, steps) {
  // the loss per step: labelled axes, the steps so far of ``steps``
  const c = $("curve"), g = c.getContext("2d"), W = c.width, H = c.height, left = 56, pad = 28;
  const bottom = H - 34, right = W - 12, top = Math.max(...losses), low = Math.min(...losses);
  g.clearRect(0, 0, W, H);
  g.font = "12px system-ui"; g.fillStyle = "#57606a"; g.strokeStyle = "#8c959f"; g.lineWidth = 1;
  g.beginPath(); g.moveTo(left, pad); g.lineTo(left, bottom); g.lineTo(right, bottom); g.stroke();
  g.fillText("cross-entropy loss (nats a token)", left + 6, 16);
  g.fillText(top.toFixed(3), 4, pad + 4); g.fillText(low.toFixed(3), 4, bottom);
  g.fillText("0", left - 3, bottom + 16); g.fillText(String(steps), right - 24, bottom + 16);
  g.fillText(`training step (${losses.length} of ${steps})`, (left + right) / 2 - 70, H - 4);
  g.strokeStyle = "#0969da"; g.lineWidth = 2; g.beginPath();
  losses.forEach((v, k) => {
    const px = left + (right - left) * (k + 1) / steps;
    const py = pad + (bottom - pad) * (top - v) / Math.max(1e-9, top - low);
    k ? g.lineTo(px, py) : g.moveTo(px, py);
  });
  g.stroke();
}

async function sample(lm, prompt) {
  const out = await lm.generate([prompt], {maxNewTokens: config.shapes.newTokens});
  return textOf(out[0].slice(prompt.length));
}

function link(name, data, type) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(new Blob([data], {type}));
  a.download = name; a.textContent = `download ${name}`; a.style.marginRight = "16px";
  return a;
}

/** Fine-tune on the text: samples before, ``steps`` steps (the loss plotted as it falls),
 *  samples after, the adapter offered for download. */
async function run(picked, steps, lr) {
  const gpu = await navigator.gpu?.requestAdapter();
  if (!gpu) throw new Error("this browser has no WebGPU adapter");
  // what the module needs where the adapter has it (loadCausalLM names what is missing)
  const device = await gpu.requestDevice({
    requiredFeatures: config.features.filter(f => gpu.features.has(f)),
    requiredLimits: Object.fromEntries(Object.entries(config.limits).filter(([k, v]) =>
      v <= (gpu.limits[k] ?? 0)))});
  const differ = picked.config ? configDifferences(await picked.config) : [];
  if (differ.length) throw new Error(`the folder's config.json is not this page's model: ` +
                                     differ.join("; "));
  const verdict = $("verdict");
  const lm = await loadCausalLM(device, picked.weights, {onProgress: ({loaded, total}) => {
    verdict.textContent = `loading the weights: ${(100 * loaded / total).toFixed(0)}%`; }});
  const ids = textIds(new Uint8Array(await picked.text)), rows = sequences(ids);
  const prompt = Array.from(ids.subarray(0, Math.min(config.shapes.prompt, ids.length)));
  const before = await sample(lm, prompt);
  const initial = writePeftAdapter((await lm.keptAdapter()).layers, lm.peftOptions);
  lm.set({lr});
  const B = config.shapes.batch, t0 = performance.now();
  for (let s = 0; s < steps; s++) {
    await lm.step(Array.from({length: B}, (_, r) => rows[(s * B + r) % rows.length]));
    if (s % 5 === 4 || s === steps - 1) {
      draw(await lm.losses(), steps);
      verdict.textContent = `training: step ${s + 1} of ${steps}`;
    }
  }
  const losses = await lm.losses(), stepMs = (performance.now() - t0) / steps;
  const after = await sample(lm, prompt);
  const files = writePeftAdapter(await lm.adapters(), lm.peftOptions);
  $("download").append(link("adapter_config.json", files.config, "application/json"),
                       link("adapter_model.safetensors", files.tensors, "application/octet-stream"));
  return {lm, losses, before, after, files, initial, stepMs, prompt, sequences: rows.length,
          adapter: gpu.info?.description || gpu.info?.vendor || "?"};
}

function show(r, picked) {
  // each step trains on other sequences: the first five steps' mean against the last five's
  const mean = list => list.reduce((p, q) => p + q) / list.length;
  const first = mean(r.losses.slice(0, 5)), last = mean(r.losses.slice(-5)), ok = last < first;
  const cell = text => `<pre>${text.replace(/[&<>]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;"})[c])}</pre>`;
  $("samples").innerHTML = [["prompt", r.prompt], ["before", r.before], ["after", r.after]]
    .map(([k, v]) => `<tr><th>${k}</th><td>${cell(typeof v === "string" ? v : textOf(v))}</td></tr>`).join("");
  $("facts").innerHTML = [["model", `${config.model.architecture}, ${picked.note}`],
    ["adapter", r.adapter], ["steps x sequences x tokens", `${r.losses.length} x ` +
      `${config.shapes.batch} x ${config.shapes.seq} (of ${r.sequences} in the text)`],
    ["loss (the mean of the first five steps, of the last five)",
     `${first.toFixed(4)} → ${last.toFixed(4)}`],
    ["time per step", `${r.stepMs.toFixed(1)} ms`],
    ["GPU memory (bytes)", Object.entries(r.lm.memory()).map(([k, v]) => `${k} ${v}`).join(", ")]]
    .map(([k, v]) => `<tr><th>${k}</th><td>${v}</td></tr>`).join("");
  $("verdict").className = ok ? "ok" : "bad";
  $("verdict").textContent = ok ? "trained: the loss fell" : "the loss did not fall: try more " +
    "steps or another learning rate";
  const base64 = bytes => bytes.toBase64?.() ??
    btoa(Array.from(bytes, b => String.fromCharCode(b)).join(""));
  window.loraLmDemo = {ok, losses: r.losses, first, last, before: r.before, after: r.after,
                       stepMs: r.stepMs, config: r.files.config, tensors: base64(r.files.tensors),
                       initial: {config: r.initial.config, tensors: base64(r.initial.tensors)}};
}

async function start() {
  const picked = chosen();
  if (!picked) { $("verdict").textContent = "pick the model's files and a text file first"; return; }
  const query = new URLSearchParams(location.search);
  const steps = Number(query.get("steps") ?? $("steps").value), lr = Number($("lr").value);
  $("start").disabled = true;
  $("verdict").className = "wait";
  try { show(await run(picked, steps, lr), picked); }
  catch (e) {
    $("verdict").className = "bad"; $("verdict").textContent = `error: ${e.message}`;
    window.loraLmDemo = {ok: false, error: String(e.stack || e)};
  } finally { $("start").disabled = false; }
}

$("about").textContent = `${config.model.architecture} (hidden ${config.model.hiddenSize}, ` +
  `${config.model.layers} layers, vocabulary ${config.model.vocabSize}) with LoRA on ` +
  `${config.targetModules.join(", ")}, rank ${Object.values(config.adapters)[0].rank}: the ` +
  `weights are read from the files you pick, the text as bytes (this page has no ` +
  `tokenizer), and everything runs on this browser's WebGPU; nothing leaves the page.`;
$("steps").value = page.steps;
$("lr").value = page.lr;
$("start").onclick = start;
if (new URLSearchParams(location.search).get("model")) start();
