// ---- the page
const page = /*PAGE*/null;  // written at export (lora.apps.web_train.digits_page)
const $ = id => document.getElementById(id);
const u8 = bytesOfBase64;
const images = (text, n) => Float32Array.from(u8(text), v => v / 16);
const f32 = name => buffers[name].init ? new Float32Array(u8(buffers[name].init).buffer)
                                        : new Float32Array(buffers[name].bytes / 4);  // zeros

function logits(x, labels, adapters) {
  // the network in float64: z1 = x W1^T + b1 + s B1 A1 x, relu, logits likewise
  const H = page.hidden, n = labels.length, w1 = f32("base.w1"), b1 = f32("base.b1"),
        w2 = f32("base.w2"), b2 = f32("base.b2"), s = config.scale;
  const layer = (inp, inDim, W, bias, outDim, ad) => {
    const out = new Float64Array(outDim);
    const h = ad ? new Float64Array(ad.rank) : null;
    if (ad) for (let r = 0; r < ad.rank; r++)
      for (let i = 0; i < inDim; i++) h[r] += ad.a[r * inDim + i] * inp[i];
    for (let o = 0; o < outDim; o++) {
      let v = bias[o];
      for (let i = 0; i < inDim; i++) v += W[o * inDim + i] * inp[i];
      if (ad) for (let r = 0; r < ad.rank; r++) v += s * ad.b[o * ad.rank + r] * h[r];
      out[o] = v;
    }
    return out;
  };
  let right = 0;
  for (let k = 0; k < n; k++) {
    const z = layer(x.subarray(k * 64, k * 64 + 64), 64, w1, b1, H, adapters?.fc1);
    const y = z.map(v => Math.max(v, 0));
    const l = layer(y, H, w2, b2, 10, adapters?.fc2);
    right += l.indexOf(Math.max(...l)) === labels[k];
  }
  return right / n;
}

function draw(losses) {
  // the loss per step on a log scale: labelled axes, the steps so far of page.steps
  const c = $("curve"), g = c.getContext("2d"), W = c.width, Hh = c.height, left = 56, pad = 28;
  const bottom = Hh - 34, right = W - 12;
  g.clearRect(0, 0, W, Hh);
  g.font = "12px system-ui"; g.fillStyle = "#57606a"; g.strokeStyle = "#8c959f"; g.lineWidth = 1;
  g.beginPath(); g.moveTo(left, pad); g.lineTo(left, bottom); g.lineTo(right, bottom); g.stroke();
  const top = Math.log(Math.max(...losses)), low = Math.log(Math.min(...losses));
  g.fillText("cross-entropy loss (log scale)", left + 6, 16);
  g.fillText(Math.exp(top).toFixed(3), 4, pad + 4); g.fillText(Math.exp(low).toFixed(3), 4, bottom);
  g.fillText("0", left - 3, bottom + 16); g.fillText(String(page.steps), right - 24, bottom + 16);
  g.fillText(`training step (${losses.length} of ${page.steps})`, (left + right) / 2 - 70, Hh - 4);
  g.strokeStyle = "#0969da"; g.lineWidth = 2; g.beginPath();
  losses.forEach((v, k) => {
    const px = left + (right - left) * (k + 1) / page.steps;
    const py = pad + (bottom - pad) * (top - Math.log(v)) / Math.max(1e-9, top - low);
    k ? g.lineTo(px, py) : g.moveTo(px, py);
  });
  g.stroke();
}

// What to try when the adapter did not help (the export options that change it).
const ADVICE = "The adapter did not help. Write the page again with more steps (--steps " +
  "400), a larger rank (--rank 16) or another seed (--seed 1). In a page of your own (lora " +
  "export --train): a loss curve that rose or jumped asks for a smaller learning rate (--lr, " +
  "or trainer.set({lr})), a flat one for a larger one or more steps.";

async function main() {
  const adapter = await navigator.gpu?.requestAdapter();
  if (!adapter) throw new Error("this browser has no WebGPU adapter");
  const device = await adapter.requestDevice();
  const train = images(page.train), trainLabels = u8(page.trainLabels);
  const test = images(page.test), testLabels = u8(page.testLabels);
  const order = new Uint16Array(u8(page.order).buffer);
  const trainer = await loraTrainer(device);
  const before = logits(test, testLabels, null);
  const x = new Float32Array(page.batch * 64), labels = new Uint32Array(page.batch);
  let progress = "";
  const t0 = performance.now();
  for (let s = 0; s < page.steps; s++) {
    for (let k = 0; k < page.batch; k++) {
      const i = order[s * page.batch + k];
      x.set(train.subarray(i * 64, i * 64 + 64), k * 64);
      labels[k] = trainLabels[i];
    }
    trainer.step({x, labels});
    if (s % 10 === 9 || s === page.steps - 1) {  // the GPU's loss history, read every 10 steps
      draw(await trainer.losses());
      $("verdict").textContent = progress = `training: step ${s + 1} of ${page.steps}`;
      await new Promise(r => setTimeout(r));
    }
  }
  const losses = await trainer.losses();
  const stepMs = (performance.now() - t0) / page.steps;
  const adapters = await trainer.adapters();
  const after = logits(test, testLabels, adapters);
  const files = writePeftAdapter(adapters, {alpha: config.alpha, targetModules: ["fc1", "fc2"]});
  const link = (name, data, type) => {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([data], {type}));
    a.download = name; a.textContent = `download ${name}`; a.style.marginRight = "16px";
    return a;
  };
  $("download").append(link("adapter_config.json", files.config, "application/json"),
                       link("adapter_model.safetensors", files.tensors, "application/octet-stream"));
  $("facts").innerHTML = [["adapter", (adapter.info?.description || adapter.info?.vendor || "?")],
    ["steps x images", `${page.steps} x ${page.batch}`], ["rank, alpha", `${config.adapters.fc1.rank}, ${config.alpha}`],
    ["loss", `${losses[0].toFixed(4)} → ${losses.at(-1).toFixed(4)}`],
    ["test accuracy (297 images)", `${(100 * before).toFixed(1)}% → ${(100 * after).toFixed(1)}%`],
    ["time per step (losses read every 10 steps)", `${stepMs.toFixed(1)} ms`]]
    .map(([k, v]) => `<tr><th>${k}</th><td class="n">${v}</td></tr>`).join("");
  $("verdict").className = after > before ? "ok" : "bad";
  $("verdict").textContent = after > before ? "trained: the adapter learned the digits 5-9"
                                            : "the adapter did not help";
  $("advice").textContent = after > before ? "" : ADVICE;
  window.loraTrainDemo = {ok: after > before, losses, accuracyBefore: before, accuracyAfter: after,
                          stepMs, config: files.config, tensors: files.tensors.toBase64(),
                          progress, advice: $("advice").textContent};
}
main().catch(e => {
  $("verdict").className = "bad"; $("verdict").textContent = `error: ${e.message}`;
  window.loraTrainDemo = {ok: false, error: String(e.stack || e)};
});
