"""A language model's work for one batch shape on the GPU: the activation
buffers and the plans of the forward (and, for training, the loss, the
backward through every layer down to the lowest adapted one, and the
optimizer), recorded in order.

Per decoder layer l, with x[l] the f32 residual stream:
    n1 = rms_norm(x[l]);  q, k, v = n1 Wq^T (+ LoRA), ...;  rope(q), rope(k)
    o = attention(q, k, v);  mid[l] = x[l] + o Wo^T (+ LoRA)
    n2 = rms_norm(mid[l]);  a = silu(n2 Wg^T) * (n2 Wu^T);  x[l+1] = mid[l] + a Wd^T
then the final norm, the LM head and the loss. A training graph keeps each
layer's activations for its backward; an inference graph reuses one set.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shaderdsl.devicebuffer import DeviceBuffer

from ..core import tuning
from ..core.forward import forward_plan
from ..core.plan import Plan
from ..core.weight import wgsl_dtype
from ..kernels.attention_matrix_grad import grad_tiling
from ..kernels.matrix import FRAGMENT
from ..training.backward import backward_plan, dropout_plan, train_forward_plan
from ..training.network import base_kernel

F32 = np.float32
U32 = np.uint32


def op(device, label: str, kernel: str, params: dict, **bound) -> Plan:
    """One dispatch of ``kernel`` with every buffer bound (recorded with no arguments)."""
    return Plan(device, label, [(kernel, params)], {}, bound=bound)


def _buffers(items: list, seen: dict, skip: set) -> None:
    """{id: bytes} of every device buffer among ``items`` ((name, value) pairs,
    lists, tuples and dicts of them), ``skip``'s objects left out."""
    for _, value in items:
        if id(value) in skip:
            continue
        if isinstance(value, DeviceBuffer):
            seen[id(value)] = value.nbytes
        elif isinstance(value, dict):
            _buffers(list(value.items()), seen, skip)
        elif isinstance(value, (list, tuple)):
            _buffers([(None, v) for v in value], seen, skip)


class _Mixed:
    """A module's pool plan, with the route its graph holds now: y += each
    row's own adapter's delta."""

    def __init__(self, graph, name: str):
        self.graph, self.name = graph, name

    def record(self, x, y) -> None:
        self.graph.mixed_plans[self.name].record(x, y)


class Graph:
    """The buffers and plans of ``model`` (a lora.CausalLM) for [batch, seq]
    token batches; ``training``: keep every activation and build the backward.
    ``cache`` (a lora.models.generate.KVCache): the queries' keys and values go
    into it at its ``past`` and attention reads it; only each sequence's last
    row reaches the head, whose argmax goes into the cache's ids at its
    ``offset``; a one-token graph (decode) reads its ids there too and
    advances ``past``, the positions and ``offset`` after its step: every
    decode step is the same dispatches on the same buffers."""

    def __init__(self, model, batch: int, seq: int, training: bool, cache=None,
                 mixed: bool = False):
        self.model, self.batch, self.seq, self.training = model, batch, seq, training
        self.device, self.config = model.device, model.config
        self.cache: Any = cache
        self.tokens = t = batch * seq
        self.dtype = model.dtype
        self.wgsl = wgsl_dtype(self.dtype)
        dev, c = self.device, self.config
        decode = cache is not None and seq == 1
        self.ids = self.cache.ids if decode else dev.empty((t,), U32, name="lm.ids")
        self.keep = self.cache.keep if cache else dev.empty((t,), U32, name="lm.keep")
        self.positions = self.cache.positions if decode else \
            dev.empty((t,), U32, name="lm.positions")
        self.labels = dev.empty((t,), U32, name="lm.labels") if training else None
        # queries start at key 0 (a cache's past: where this step's queries sit in it)
        self.past = cache.past if cache else dev.empty((1,), U32, name="lm.past")
        self.lora_forwards: dict = {}  # module name -> its adapter's forward plan (h kept)
        self.dropped: dict = {}  # module name -> its adapter's dropped input (lora_dropout)
        self.drops: dict = {}    # module name -> the plan dropping it
        self.scratch: dict = {}  # (role, width) -> a buffer between two dispatches
        # mixed: each row's adapter from the model's pools (the plans with their
        # routes in ``mixed_plans``, set before each record), not the model's own
        self.mixed, self.mixed_plans = mixed, {}
        self.step_graph = None   # the first training step, captured to replay
        layers = c.num_hidden_layers
        self.x = [dev.empty((t, c.hidden_size), F32, name=f"lm.x{i}")
                  for i in range(layers + 1 if training else 2)]
        self.head_tokens = batch if cache else t
        self.logits = dev.empty((self.head_tokens, c.vocab_size), self.dtype, name="lm.logits")
        self.saved = [self._layer_buffers(i) for i in range(layers if training else 1)]
        self.forwards: list = self._embedding(decode)
        for layer in range(layers):
            self.forwards += self._layer_forward(layer)
        self.forwards += self._head()
        if cache:
            self.forwards += self._next_ids(decode)
        self.backwards: list = self._backward() if training else []

    # ------------------------------------------------------------ buffers

    def _layer_buffers(self, i: int) -> dict:
        """A layer's activations: what its backward reads (or, inference, one set for all)."""
        dev, c, t, dt = self.device, self.config, self.tokens, self.dtype
        qw, kvw = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes = {"n1": (c.hidden_size, dt), "q": (qw, dt), "k": (kvw, dt), "v": (kvw, dt),
                  "o": (qw, dt), "mid": (c.hidden_size, F32), "n2": (c.hidden_size, dt),
                  "gate": (c.intermediate_size, dt), "up": (c.intermediate_size, dt),
                  "act": (c.intermediate_size, dt), "y": (c.hidden_size, dt),
                  "rstd1": (None, F32), "rstd2": (None, F32)}
        out = {name: dev.empty((t,) if w is None else (t, w), d, name=f"lm.{i}.{name}")
               for name, (w, d) in shapes.items()}
        out["lse"] = dev.empty((self.batch * c.num_attention_heads * self.seq,), F32,
                               name=f"lm.{i}.lse")
        return out

    def _saved(self, layer: int) -> dict:
        return self.saved[layer if self.training else 0]

    def _x(self, layer: int):
        """The residual stream entering ``layer`` (two buffers in turn for inference)."""
        return self.x[layer if self.training else layer % 2]

    # ------------------------------------------------------------ forward

    def _embedding(self, decode: bool) -> list:
        """x[0] = the embedding of the ids (decode: read at the cache's offset)."""
        dev, c = self.device, self.config
        where = {"offset": self.cache.offset} if decode else {}
        return [(op(dev, f"embed rows {first}+", "embed", dict(
            tokens=self.tokens, hidden=c.hidden_size, rows=chunk.shape[0], first_row=first,
            dtype=self.wgsl, id_offset=decode), ids=self.ids, E=chunk, x=self._x(0), **where),
            ()) for first, chunk in self.model.frozen.embed]

    def _norm(self, label: str, x, w, y, rstd, tokens: int = 0) -> tuple:
        c = self.config
        return (op(self.device, label, "rms_norm", dict(
            tokens=tokens or self.tokens, hidden=c.hidden_size, eps=c.rms_norm_eps,
            dtype=self.wgsl), x=x, w=w, y=y, rstd=rstd), ())

    def _linear(self, name: str, x, y) -> list:
        """y = x W^T (+ b) (+ LoRA), the module ``name``'s base product and adapter."""
        frozen, dev = self.model.frozen, self.device
        w, b = frozen.linears[name]
        in_dim, out_dim = frozen.shape_of(name)
        kernel = base_kernel("dense", dev, self.wgsl, in_dim=in_dim, out_dim=out_dim,
                             tokens=self.tokens, bias=b is not None)
        bound = {"x": x, "W": w, "y": y, **({"bias": b} if b is not None else {})}
        steps: list = [(Plan(dev, f"{name} base", [kernel], {}, bound=bound), ())]
        if self.mixed:
            if name in self.model.mixed.pools:
                steps.append((_Mixed(self, name), (x, y)))
            return steps
        adapter = self.model.adapted.get(name)
        if adapter is not None:
            drop = self._dropout(name, adapter, in_dim)
            if drop is not None:
                steps.append((drop, (x, self.dropped[name])))
                x = self.dropped[name]
            if self.training:   # keeps h = A x for the backward
                plan = train_forward_plan(dev, adapter.weight, adapter.scale, self.tokens,
                                          given=())
                self.lora_forwards[name] = plan
            else:   # lora.forward's strategy, its token count baked (no uniform value)
                w = adapter.weight
                plan = forward_plan(dev, w, adapter.scale, self.tokens,
                                    tuning.choose(dev, w, adapter.scale, self.tokens))
            steps.append((plan, (x, y)))
        return steps

    def _dropout(self, name: str, adapter, in_dim: int):
        """In training with lora_dropout, the plan dropping the adapter's input
        (peft's lora_dropout before lora_A; the base sees x) into
        ``dropped[name]``, its mask lora.kernels.dropout's hash of (dropout_seed
        + the module's index, the step, the element); else None."""
        p = self.model.lora_dropout
        if not self.training or not p:
            return None
        seed = (self.model.dropout_seed + list(self.model.adapted).index(name)) % 2**32
        self.dropped[name] = self.device.empty((self.tokens, in_dim), self.dtype,
                                               name=f"{name}.x_dropped")
        self.drops[name] = dropout_plan(self.device, adapter.weight, self.tokens, p, seed,
                                        self.model.optimizer.state)
        return self.drops[name]

    def _layer_forward(self, layer: int) -> list:
        dev, c, s, lw = self.device, self.config, self._saved(layer), self.model.frozen.layers
        name = f"model.layers.{layer}"
        x, nxt = self._x(layer), self._x(layer + 1)
        steps = [self._norm(f"{name} input norm", x, lw[layer]["input_layernorm"], s["n1"],
                            s["rstd1"])]
        for proj in ("q", "k", "v"):
            steps += self._linear(f"{name}.self_attn.{proj}_proj", s["n1"], s[proj])
        steps.append(self._rope_pair(s["q"], s["k"]))
        if self.cache is not None:
            steps += self._cache_write(layer, s)
        steps.append(self._attention(s, layer))
        steps += self._linear(f"{name}.self_attn.o_proj", s["o"], s["y"])
        steps += self._residual(x, s["y"], s["mid"])
        steps.append(self._norm(f"{name} post-attention norm", s["mid"],
                                lw[layer]["post_attention_layernorm"], s["n2"], s["rstd2"]))
        steps += self._linear(f"{name}.mlp.gate_proj", s["n2"], s["gate"])
        steps += self._linear(f"{name}.mlp.up_proj", s["n2"], s["up"])
        steps.append((op(dev, f"{name} swiglu", "swiglu", dict(
            inter=c.intermediate_size, tokens=self.tokens, dtype=self.wgsl),
            gate=s["gate"], up=s["up"], act=s["act"]), ()))
        steps += self._linear(f"{name}.mlp.down_proj", s["act"], s["y"])
        steps += self._residual(s["mid"], s["y"], nxt)
        return steps

    def _rope_pair(self, q, k, inverse: bool = False) -> tuple:
        """q and k rotated in place by their tokens' positions (inverse: back)."""
        frozen, c = self.model.frozen, self.config
        return (op(self.device, "rope", "rope", dict(
            tokens=self.tokens, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim, inverse=inverse, dtype=self.wgsl),
            q=q, k=k, positions=self.positions, cosines=frozen.cos, sines=frozen.sin), ())

    def _attention(self, s: dict, layer: int) -> tuple:
        """o = attention of q over the keys and values: the step's own, or the cache's."""
        c, cache = self.config, self.cache
        k, v, kv_len = (s["k"], s["v"], self.seq) if cache is None else \
            (cache.k[layer], cache.v[layer], cache.length)
        params: dict = dict(batch=self.batch, q_len=self.seq, kv_len=kv_len,
                            heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                            head_dim=c.head_dim)
        # The SIMT forward, also in f16 on matrix units: on the H100 under Dawn it ran
        # 403 / 544 us at SmolLM2's / Qwen2.5's 8 x 512, attention_matrix 561 / 826 us
        # (docs/benchmarks.md, round 5); the backward is faster on them (_attention_grad_kernels)
        return (op(self.device, "attention", "attention", dict(params, dtype=self.wgsl),
                   q=s["q"], k=k, v=v, keep=self.keep, past=self.past, o=s["o"],
                   lse=s["lse"]), ())

    def _cache_write(self, layer: int, s: dict) -> list:
        """This step's (rotated) keys and values into the cache at its past."""
        c, cache = self.config, self.cache
        params = dict(batch=self.batch, rows=self.seq, kv_len=cache.length,
                      width=c.num_key_value_heads * c.head_dim, dtype=self.wgsl)
        return [(op(self.device, f"cache {part}", "kv_write", params, src=s[part],
                    past=self.past, cache=store[layer]), ())
                for part, store in (("k", cache.k), ("v", cache.v))]

    def _residual(self, x, y, out) -> list:
        """out = x + y: the residual stream (f32) past a block whose output y is stored."""
        return [(op(self.device, "residual", "residual", dict(
            hidden=self.config.hidden_size, tokens=self.tokens, dtype=self.wgsl),
            x=x, y=y, out=out), ())]

    def _head(self) -> list:
        """The final norm and the LM head's logits [tokens, vocab], a chunk of
        the vocabulary per binding of the head's weight."""
        c, frozen, dev, rows = self.config, self.model.frozen, self.device, self.head_tokens
        self.final_n = dev.empty((rows, c.hidden_size), self.dtype, name="lm.final_n")
        self.final_rstd = dev.empty((rows,), F32, name="lm.final_rstd")
        x, steps = self._x(c.num_hidden_layers), []
        if rows != self.tokens:   # a prefill: each sequence's last row
            last = dev.empty((rows, c.hidden_size), F32, name="lm.last_rows")
            steps.append((op(dev, "last rows", "last_rows", dict(
                batch=self.batch, seq=self.seq, width=c.hidden_size), src=x, dst=last), ()))
            x = last
        steps.append(self._norm("final norm", x, frozen.norm, self.final_n, self.final_rstd,
                                rows))
        for first, chunk in frozen.head:
            params = dict(in_dim=c.hidden_size, out_dim=chunk.shape[0], tokens=rows,
                          bias=False, y_stride=c.vocab_size, y_column=first)
            steps.append((Plan(dev, f"lm_head rows {first}+", [base_kernel(
                "dense", dev, self.wgsl, **params)], {},
                bound={"x": self.final_n, "W": chunk, "y": self.logits}), ()))
        return steps

    def _next_ids(self, decode: bool) -> list:
        """The greedy next ids into the cache's ids: a prefill's at its offset
        (0), a decode step's one slot after the ids it read (offset + batch),
        then past, positions and offset advanced for the next step."""
        dev, cache = self.device, self.cache
        steps: list = [(op(dev, "argmax", "argmax", dict(
            vocab=self.config.vocab_size, tokens=self.batch, dtype=self.wgsl,
            subgroups=dev.has_feature("subgroup"), ahead=self.batch if decode else 0),
            logits=self.logits, ids=cache.ids, offset=cache.offset), ())]
        if decode:
            steps.append((op(dev, "advance", "decode_advance", dict(batch=self.batch),
                             past=cache.past, positions=cache.positions,
                             offset=cache.offset), ()))
        return steps

    # ------------------------------------------------------------ loss and backward

    @property
    def loss_scale(self) -> float:
        """The loss gradient's scale: 1 in f32; in f16 the token count (the
        gradient of a mean over T tokens is ~1 / (vocab T) an element, under
        f16's least value at a real vocabulary; scaled, the activations'
        gradients are ~1, far from f16's limits both ways), undone by the
        optimizer's scale_gradients. A fixed scale, not GradScaler's dynamic one."""
        return float(self.tokens) if self.dtype == np.float16 else 1.0

    def _loss(self) -> list:
        """softmax cross-entropy of the logits against the shifted labels, the
        ignored ones left out, its gradient written over the logits."""
        c, dev = self.config, self.device
        self.losses = dev.empty((self.tokens,), F32, name="lm.losses")
        return [(op(dev, "loss", "softmax_xent", dict(
            classes=c.vocab_size, tokens=self.tokens, dtype=self.wgsl, ignore=True,
            in_place=True, subgroups=dev.has_feature("subgroup"), grad_scale=self.loss_scale),
            logits=self.logits, labels=self.labels, losses=self.losses), ())]

    def _backward(self) -> list:
        """The loss, then the gradient from the logits down to the lowest
        adapted layer: each adapter's dA and dB, the frozen weights none."""
        c, dev, t, dt = self.config, self.device, self.tokens, self.dtype
        self.dres = dev.empty((t, c.hidden_size), F32, name="lm.dres")
        self.dres_stored = self.dres if dt == np.float32 else \
            dev.empty((t, c.hidden_size), dt, name="lm.dres16")
        shapes = {"dn": c.hidden_size, "do": c.num_attention_heads * c.head_dim,
                  "dq": c.num_attention_heads * c.head_dim,
                  "dk": c.num_key_value_heads * c.head_dim,
                  "dv": c.num_key_value_heads * c.head_dim, "d_act": c.intermediate_size}
        self.grads = {k: dev.empty((t, w), dt, name=f"lm.{k}") for k, w in shapes.items()}
        self.stats = dev.empty((self.batch * c.num_attention_heads * self.seq, 2), F32,
                               name="lm.attention_stats")
        steps = self._loss()
        for first, chunk in self.model.frozen.head:
            params = dict(in_dim=c.hidden_size, out_dim=chunk.shape[0], tokens=t,
                          accumulate=first > 0, g_stride=c.vocab_size, g_column=first)
            steps.append((Plan(dev, f"lm_head grad rows {first}+", [base_kernel(
                "dense_grad_input", dev, self.wgsl, **params)], {},
                bound={"g": self.logits, "W": chunk, "dx": self.grads["dn"]}), ()))
        steps.append(self._norm_grad("final norm grad", self.grads["dn"],
                                     self._x(c.num_hidden_layers), self.model.frozen.norm,
                                     self.final_rstd, accumulate=False))
        for layer in reversed(range(self.model.lowest_adapted, c.num_hidden_layers)):
            steps += self._layer_backward(layer, bottom=layer == self.model.lowest_adapted)
        return steps

    def _norm_grad(self, label: str, dy, x, w, rstd, accumulate: bool = True) -> tuple:
        c = self.config
        return (op(self.device, label, "rms_norm_grad", dict(
            hidden=c.hidden_size, tokens=self.tokens, dtype=self.wgsl, accumulate=accumulate),
            dy=dy, x=x, w=w, rstd=rstd, dres=self.dres), ())

    def _to_stored(self) -> list:
        """The residual's f32 gradient as the Linear layers' g (an f16 copy in f16)."""
        if self.dres_stored is self.dres:
            return []
        n = self.dres.size
        return [(op(self.device, "dres to f16", "to_f16", dict(sizes=(n,)),
                    p0=self.dres, h0=self.dres_stored), ())]

    def _linear_grad(self, name: str, g, x, dx, first: bool) -> list:
        """dx (+)= g W (+ the adapter's dh A), and the adapter's dA and dB."""
        dev = self.device
        w, _ = self.model.frozen.linears[name]
        in_dim, out_dim = self.model.frozen.shape_of(name)
        steps: list = [(Plan(dev, f"{name} grad", [base_kernel(
            "dense_grad_input", dev, self.wgsl, in_dim=in_dim, out_dim=out_dim,
            tokens=self.tokens, accumulate=not first)], {},
            bound={"g": g, "W": w, "dx": dx}), ())]
        adapter = self.model.adapted.get(name)
        if adapter is not None:
            forward = self.lora_forwards[name]
            plan = backward_plan(dev, adapter.weight, adapter.scale, self.tokens,
                                 with_dx=False)   # every strategy leaves dh as scratch
            steps.append((plan, (g, self.dropped.get(name, x), forward.h, *adapter.grads)))
            steps += self._adapter_input_grad(name, adapter, plan.scratch["dh"], in_dim, dx)
        return steps

    def _adapter_input_grad(self, name: str, adapter, dh, in_dim: int, dx) -> list:
        """dx += dh A, through the dropout's mask where the input was dropped."""
        dev, t = self.device, self.tokens
        params = dict(in_dim=in_dim, rank=adapter.rank, tokens=t, dtype=self.wgsl)
        if name not in self.drops:
            return [(op(dev, f"{name} adapter input grad", "grad_input",
                        dict(params, accumulate=True), dh=dh, A=adapter.weight.a, dx=dx), ())]
        raw, masked = (self._scratch(f"dx{k}", in_dim) for k in range(2))
        return [(op(dev, f"{name} adapter input grad", "grad_input", dict(params),
                    dh=dh, A=adapter.weight.a, dx=raw), ()),
                (self.drops[name], (raw, masked)),
                (op(dev, f"{name} adapter input grad add", "add_scaled", dict(
                    num_elements=t * in_dim, scale=1.0, dtype=self.wgsl, y_dtype=self.wgsl),
                    y=masked, output=dx), ())]

    def _scratch(self, role: str, width: int):
        """A [tokens, width] buffer of the storage dtype for passing values
        between two dispatches, one per (role, width)."""
        key = (role, width)
        if key not in self.scratch:
            self.scratch[key] = self.device.empty((self.tokens, width), self.dtype,
                                                  name=f"lm.{role}.{width}")
        return self.scratch[key]

    def _layer_backward(self, layer: int, bottom: bool) -> list:
        """Layer ``layer``'s backward: dres holds the gradient of its output on
        entry and of its input on exit (not computed for the bottom layer)."""
        c, s, d, lw = self.config, self._saved(layer), self.grads, self.model.frozen.layers
        name, dev = f"model.layers.{layer}", self.device
        steps = self._to_stored()
        steps += self._linear_grad(f"{name}.mlp.down_proj", self.dres_stored, s["act"],
                                   d["d_act"], first=True)
        steps.append((op(dev, f"{name} swiglu grad", "swiglu_grad", dict(
            inter=c.intermediate_size, tokens=self.tokens, dtype=self.wgsl, in_place=True),
            d_act=d["d_act"], gate=s["gate"], up=s["up"]), ()))
        steps += self._linear_grad(f"{name}.mlp.gate_proj", s["gate"], s["n2"], d["dn"],
                                   first=True)
        steps += self._linear_grad(f"{name}.mlp.up_proj", s["up"], s["n2"], d["dn"],
                                   first=False)
        steps.append(self._norm_grad(f"{name} post-attention norm grad", d["dn"], s["mid"],
                                     lw[layer]["post_attention_layernorm"], s["rstd2"]))
        steps += self._to_stored()
        steps += self._linear_grad(f"{name}.self_attn.o_proj", self.dres_stored, s["o"],
                                   d["do"], first=True)
        steps += self._attention_grad(s)
        for k, proj in enumerate(("q", "k", "v")):
            steps += self._linear_grad(f"{name}.self_attn.{proj}_proj", d[f"d{proj}"], s["n1"],
                                       d["dn"], first=k == 0)
        if not bottom:
            steps.append(self._norm_grad(f"{name} input norm grad", d["dn"], self._x(layer),
                                         lw[layer]["input_layernorm"], s["rstd1"]))
        return steps

    def _attention_grad(self, s: dict) -> list:
        """dq, dk, dv from do (dq and dk rotated back: RoPE's transpose)."""
        c, d, dev = self.config, self.grads, self.device
        sizes = dict(batch=self.batch, heads=c.num_attention_heads, head_dim=c.head_dim,
                     seq=self.seq, dtype=self.wgsl)
        both = dict(sizes, kv_heads=c.num_key_value_heads)
        inputs = dict(q=s["q"], k=s["k"], v=s["v"], dout=d["do"], stats=self.stats,
                      keep=self.keep)
        prefix, grads = self._attention_grad_kernels(both)
        return [(op(dev, "attention delta", "attention_delta", sizes, dout=d["do"], o=s["o"],
                    lse=s["lse"], stats=self.stats), ()),
                (op(dev, "attention grad kv", f"{prefix}grad_kv", grads, **inputs,
                    dk=d["dk"], dv=d["dv"]), ()),
                (op(dev, "attention grad q", f"{prefix}grad_q", grads, **inputs, dq=d["dq"]),
                 ()),
                self._rope_pair(d["dq"], d["dk"], inverse=True)]

    def _attention_grad_kernels(self, params: dict) -> tuple[str, dict]:
        """The backward's kernels (their name's prefix) and parameters: on matrix
        units where the model is f16 and the device has f16 16x16x16 fragments
        and both tile within its workgroup memory (on the H100: 135 + 87 us at
        SmolLM2's 8 x 512, the SIMT ones 701 + 459), else the SIMT ones."""
        if self.wgsl != "f16" or FRAGMENT not in getattr(self.device,
                                                         "subgroup_matrix_configs", ()):
            return "attention_", params
        matrix = {k: v for k, v in params.items() if k != "dtype"}
        matrix["limit"] = self.device.limits.get("max-compute-workgroup-storage-size", 16384)
        try:
            for kind in ("grad_kv", "grad_q"):
                grad_tiling(kind, matrix["heads"], matrix["kv_heads"], matrix["head_dim"],
                            matrix["seq"], matrix["limit"])
        except ValueError:
            return "attention_", params
        return "attention_matrix_", matrix

    def nbytes(self) -> int:
        """Bytes of the buffers this graph made (activations, gradients, the
        plans' scratch), not the model's weights or a cache's."""
        seen: dict[int, int] = {}
        skip = {id(self.cache)} | ({id(b) for b in vars(self.cache).values()}
                                   if self.cache is not None else set())
        _buffers(list(vars(self).items()), seen, skip | {id(self.model)})
        for plan, _ in self.forwards + self.backwards:
            _buffers(list(getattr(plan, "scratch", {}).items()), seen, skip)
        return sum(seen.values())

    # ------------------------------------------------------------ recording

    def record_forward(self) -> None:
        for plan, args in self.forwards:
            plan.record(*args)

    def record_step(self) -> None:
        """Forward, loss, backward, optimizer, f16 copies: one submit. Every
        step is the same dispatches on the same buffers (the batch's values
        are written into them before), so the first is captured and the rest
        replay it (device.capture / replay), without each plan's lookups."""
        dev = self.device
        with dev.batch():
            if self.step_graph is not None:
                dev.replay(self.step_graph)
                return
            with dev.capture() as graph:
                self._record_step()
            self.step_graph = None if graph.refused else graph

    def _record_step(self) -> None:
        self.record_forward()
        for plan, args in self.backwards:
            plan.record(*args)
        self.model.optimizer.record()
        for adapter in self.model.adapted.values():
            if adapter.to_f16 is not None:
                adapter.to_f16.record()
