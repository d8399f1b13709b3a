"""Greedy decoding with a KV cache on the GPU, as transformers' greedy
``generate`` does it: the prompt's positions from its attention mask
(cumsum - 1), each step's token the argmax of the last logits, a finished
sequence (one that gave an end-of-sequence id) padded until every sequence
has finished or ``max_new_tokens`` are made.

The prompt runs once (the prefill), writing every layer's keys and values
into the cache; then each decode step runs one token per sequence against
the cache. A step's next ids are written on the GPU where the next step's
embedding reads them, and its position, place in the cache and where its
ids are read advance on the GPU too, so every step is the same dispatches:
the first is captured (``device.capture``) and the rest replay it, several
in one submit; the ids are read back after each submit, to stop at the end
of every sequence.

The cache, both graphs and their captures are kept on the model for the
next call of the same shape (:class:`Generation`): building a graph's
plans and recording its dispatches took 200 ms of host time a call at
SmolLM2-135M's 30 layers, 20 times the prefill's GPU time on an H100
(docs/optimisation-notes.md, "Prefill: ..."); a call of a kept shape
builds nothing and replays both.
"""
from __future__ import annotations

import numpy as np

from . import inputs as I
from .graph import Graph

STEPS_PER_SUBMIT = 8   # decode steps recorded between reads of the ids
CACHE_ROWS = 128       # a KV cache's length is a multiple of this (attention and kv_write
                       # bake it in: fewer lengths, fewer pipelines; keys past a query's
                       # place are never read)
GENERATIONS = 2        # shapes whose cache and graphs a model keeps, most recent first


class KVCache:
    """Every layer's keys and values for ``batch`` sequences of up to
    ``length`` tokens (storage dtype, [batch * length, kv_heads * head_dim]),
    the mask of the keys (u32 [batch * length]), ``past`` (u32 [1]: where the
    next queries sit), the next decode step's positions (u32 [batch]) and the
    generated ids (u32 [steps, batch]) and ``offset`` (u32 [1]: where the next
    decode step reads its ids among them)."""

    def __init__(self, model, batch: int, length: int, steps: int):
        dev, c = model.device, model.config
        width = c.num_key_value_heads * c.head_dim
        self.length = length
        self.k = [dev.empty((batch * length, width), model.dtype, name=f"cache.k{i}")
                  for i in range(c.num_hidden_layers)]
        self.v = [dev.empty((batch * length, width), model.dtype, name=f"cache.v{i}")
                  for i in range(c.num_hidden_layers)]
        self.keep = dev.empty((batch * length,), np.uint32, name="cache.keep")
        self.past = dev.empty((1,), np.uint32, name="cache.past")
        self.positions = dev.empty((batch,), np.uint32, name="cache.positions")
        self.ids = dev.empty((steps * batch,), np.uint32, name="cache.ids")
        self.offset = dev.empty((1,), np.uint32, name="cache.offset")


def generate(model, input_ids, max_new_tokens: int, eos_token_id=None, attention_mask=None,
             pad_token_id=None, adapter_names=None) -> np.ndarray:
    """The prompt and the greedy continuation, int64 [batch, prompt + new]
    (lora.CausalLM.generate documents the arguments)."""
    c = model.config
    new = _count(max_new_tokens)
    batch = I.check_batch(input_ids, None, attention_mask, vocab=c.vocab_size,
                          max_positions=c.max_position_embeddings, call="CausalLM.generate",
                          with_labels=False, generate_positions=True)
    b, p = batch.batch, batch.seq
    last = int(batch.positions.reshape(b, p)[:, -1].max())
    if last + new > c.max_position_embeddings:
        raise ValueError(f"CausalLM.generate: the prompt's last position {last} plus "
                         f"{new} new tokens passes the model's max_position_embeddings "
                         f"({c.max_position_embeddings})")
    eos = _ids(c.eos_token_ids if eos_token_id is None else eos_token_id, c.vocab_size,
               "eos_token_id")
    pad = _pad(pad_token_id, c, eos)
    mixed = None if adapter_names is None else \
        [model.mixed.ids(adapter_names, b, rows) for rows in (p, 1)]
    gen = prepared(model, b, p, new, mixed is not None)
    cache, dev = gen.cache, model.device
    keep = np.ones((b, cache.length), np.uint32)
    keep[:, :p] = batch.keep.reshape(b, p)
    dev.write(cache.keep, keep.reshape(-1))
    if mixed is not None:
        gen.prefill.mixed_plans = model.mixed.plans(mixed[0])
    dev.write(gen.prefill.ids, batch.ids)
    dev.write(gen.prefill.positions, batch.positions)
    dev.write(cache.past, np.zeros(1, np.uint32))
    dev.write(cache.offset, np.zeros(1, np.uint32))
    with dev.batch():
        gen.record(gen.prefill)
    step = None
    if new > 1:
        step = gen.step()
        if mixed is not None:
            step.mixed_plans = model.mixed.plans(mixed[1])
    made = _decode(model, gen, step, p, new, batch.positions.reshape(b, p)[:, -1] + 1, eos)
    return _finished(batch.ids.reshape(b, p), made, eos, pad)


class Generation:
    """What :func:`generate` runs for ``batch`` prompts of ``prompt`` tokens
    with a cache of ``length``: the KV cache (its ids room for every step
    the cache holds), the prefill's graph, the decode step's (made by the
    first call that decodes) and each graph's capture (made by its first
    record, replayed after). Kept on the model (:func:`prepared`), a later
    call of the shape builds no plan, makes no buffer or bind group and
    records nothing anew. Its buffers keep the last call's values: every one
    a call reads is written first (the ids, positions, mask, past and
    offset), but for the cache's keys and values past the prompt, which a
    query reads only where it cannot see them (a block's keys past its
    place, weighted by 0, as the zeros of a fresh cache were)."""

    def __init__(self, model, batch: int, prompt: int, length: int, mixed: bool = False):
        self.model, self.key = model, (batch, prompt, length, mixed)
        self.cache = KVCache(model, batch, length, length - prompt)
        self.prefill = Graph(model, batch, prompt, training=False, cache=self.cache,
                             mixed=mixed)
        self._step: Graph | None = None
        self.captures: dict = {}   # id(graph) -> its capture

    def step(self) -> Graph:
        """The decode step's graph (one token a sequence), made once."""
        if self._step is None:
            b, _, _, mixed = self.key
            self._step = Graph(self.model, b, 1, training=False, cache=self.cache, mixed=mixed)
        return self._step

    def record(self, graph: Graph) -> None:
        """``graph``'s forward: its capture replayed, or (the first time, or
        where it cannot be replayed: a mixed batch's plans take their row
        count as a uniform value) recorded, captured the first time."""
        dev, capture = self.model.device, self.captures.get(id(graph))
        if capture is not None and not capture.refused:
            dev.replay(capture)
        elif capture is not None:
            graph.record_forward()
        else:
            with dev.capture() as capture:
                graph.record_forward()
            self.captures[id(graph)] = capture

    def nbytes(self) -> int:
        """Bytes of the graphs' buffers and the cache's."""
        c = self.cache
        cached = sum(buf.nbytes for buf in [*c.k, *c.v, c.keep, c.past, c.positions, c.ids,
                                            c.offset])
        return cached + sum(g.nbytes() for g in (self.prefill, self._step) if g is not None)


def cache_length(prompt: int, new: int, max_positions: int) -> int:
    """The KV cache's length for ``prompt`` + ``new`` tokens: a multiple of
    CACHE_ROWS, or the model's max_position_embeddings where that is less."""
    return min(-(-(prompt + new) // CACHE_ROWS) * CACHE_ROWS, max(prompt + new, max_positions))


def prepared(model, batch: int, prompt: int, new: int, mixed: bool = False) -> Generation:
    """The model's :class:`Generation` for this shape: kept from an earlier
    call (the GENERATIONS most recent shapes are kept), or made (the least
    recent dropped first). A mixed batch's is made for the call and not
    kept: its graphs hold a step per adapter pool the model had then and
    take the call's routes."""
    length = cache_length(prompt, new, model.config.max_position_embeddings)
    key = (batch, prompt, length, mixed)
    if mixed:
        return Generation(model, batch, prompt, length, mixed=True)
    kept = model._generations
    for k, gen in enumerate(kept):
        if gen.key == key:
            kept.insert(0, kept.pop(k))
            return gen
    del kept[GENERATIONS - 1:]   # their buffers go before the new ones are made
    kept.insert(0, Generation(model, batch, prompt, length))
    return kept[0]


def _decode(model, gen: Generation, step, p: int, new: int, positions, eos) -> np.ndarray:
    """Decode steps (the one-token graph ``step``) until every sequence has
    given an eos id or ``new`` ids are made: the ids, [steps made, batch]."""
    dev, b, cache = model.device, len(positions), gen.cache
    dev.write(cache.past, np.array([p], np.uint32))
    dev.write(cache.positions, np.asarray(positions, np.uint32))
    made = 1
    while True:
        ids = dev.read(cache.ids)[:made * b].reshape(made, b).astype(np.int64)
        done = np.isin(ids, eos).any(axis=0).all() if len(eos) else False
        if done or made == new or step is None:
            return ids[:_end(ids, eos)] if done else ids
        count = min(STEPS_PER_SUBMIT, new - made)
        with dev.batch():
            for _ in range(count):
                gen.record(step)
        made += count


def _end(ids: np.ndarray, eos) -> int:
    """Steps up to the one where the last sequence gave its first eos id."""
    first = [int(np.argmax(np.isin(ids[:, j], eos))) for j in range(ids.shape[1])]
    return max(first) + 1


def _finished(prompt: np.ndarray, made: np.ndarray, eos, pad: int) -> np.ndarray:
    """The prompt and the new ids, each sequence's ids after its first eos
    replaced by the pad id, as transformers pads a finished sequence."""
    out = made.T.copy()
    for row in out:
        hit = np.flatnonzero(np.isin(row, eos))
        if hit.size:
            row[hit[0] + 1:] = pad
    return np.concatenate([prompt.astype(np.int64), out], axis=1)


def _count(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"CausalLM.generate: max_new_tokens must be a positive int, got "
                         f"{value!r}")
    return int(value)


def _ids(value, vocab: int, what: str) -> tuple[int, ...]:
    """One token id or several as a tuple, each checked against the vocabulary."""
    ids = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < vocab:
            raise ValueError(f"CausalLM.generate: {what} must be token ids (0..{vocab - 1}), "
                             f"got {value!r}")
    return tuple(int(i) for i in ids)


def _pad(pad_token_id, config, eos) -> int:
    """The id after a sequence's end: given, else the config's pad id, else
    its first eos id (as transformers falls back), else 0."""
    if pad_token_id is not None:
        return _ids(pad_token_id, config.vocab_size, "pad_token_id")[0]
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    return eos[0] if eos else 0
