"""The page's pool of many adapters (lora_many.js, from lora/apps/web_assets/many.mjs)
in Node, without a GPU: the ids checked and sorted into tiles as
lora.core.many_plan does (same order, tiles and messages), float16 rounding as
numpy's, adapters placed first-fit at the offsets lora.AdapterPool gives, a
refused one writing nothing (a stand-in device lists every write), and the form
picked per batch as lora.core.many_plan.chosen_form picks it. The forward
itself runs in headless Chromium (tests/test_export.py) and in Node on Dawn
(tests/test_node_modules.py). Skips without ``node``."""
from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

import lora
from lora.apps.cli import main as lora_main
from lora.core import many_plan
from shaderdsl.interp import Device

NODE = shutil.which("node") or ""

pytestmark = pytest.mark.skipif(not NODE, reason="JavaScript tests need node (Node.js 20+) "
                                                     "on PATH")

# A stand-in GPUDevice: buffers are plain objects, every queue write is listed.
FAKE_DEVICE = """
globalThis.GPUBufferUsage = {STORAGE: 128, COPY_DST: 8, COPY_SRC: 4, UNIFORM: 64, MAP_READ: 1};
const writes = [];
const dev = {features: new Set(),
             limits: {maxComputeWorkgroupsPerDimension: 65535,
                      maxStorageBufferBindingSize: 1 << 20},
             createBuffer: d => ({...d, destroy() {}}),
             createCommandEncoder: () => ({finish: () => null, copyBufferToBuffer:
               (src, from, dst, at, n) => writes.push([`${src.label} -> ${dst.label}`, at, n])}),
             queue: {writeBuffer: (buf, at, data) => writes.push([buf.label, at, data]),
                     submit() {}}};
"""


def run_node(tmp_path, body: str, dtype="f32", max_rank=16):
    """``body`` (returns a JSON-able value) in Node with the exported module (42 -> 36,
    ``max_rank``) as ``m``."""
    if not (tmp_path / "lora_many.js").exists():
        assert lora_main(["export", "--many", str(tmp_path), "--in-dim", "42", "--out-dim", "36",
                          "--max-rank", str(max_rank), "--dtype", dtype]) == 0
    script = tmp_path / "run.mjs"
    script.write_text(f"import * as m from {json.dumps((tmp_path / 'lora_many.js').as_uri())};\n"
                      f"{FAKE_DEVICE}\nconst result = (() => {{ {body} }})();\n"
                      f"console.log(JSON.stringify(result));\n")
    done = subprocess.run([NODE, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def python_message(ids, slots, bound) -> str:
    with pytest.raises(ValueError) as e:
        many_plan.host_ids(np.array(ids), (len(ids),), slots, bound)
    return str(e.value)


def test_ids_sort_into_the_tiles_python_makes(tmp_path):
    rng = np.random.default_rng()
    cases = [(rng.integers(-1, slots, rows).astype(np.int32).tolist(), tile)
             for rows, slots, tile in [(1, 1, 8), (37, 4, 8), (200, 7, 4), (64, 3, 1), (9, 2, 16)]]
    cases.append(([-1, -1, -1], 8))
    got = run_node(tmp_path, f"""
      return {json.dumps(cases)}.map(([ids, tile]) => {{
        const {{order, tiles}} = m.segments(m.checkIds(ids, [...Array(7).keys()], 7), tile);
        return [Array.from(order), Array.from(tiles)]; }});""")
    for (ids, tile), (order, tiles) in zip(cases, got):
        want_order, want_tiles = many_plan.segments(np.array(ids, np.int32), tile)
        assert order == want_order.tolist() and tiles == want_tiles.ravel().tolist(), (ids, tile)


def test_bad_ids_are_refused_with_pythons_messages(tmp_path):
    cases = [([0, 5, 1, -2], [0, 1, 2], 4), ([0, 2, 1], [0, 1], 3),
             ([0, -1, 2, 2, 3], [0, 1, 3], 4)]
    got = run_node(tmp_path, f"""
      const out = {json.dumps(cases)}.map(([ids, slots, bound]) => {{
        try {{ m.checkIds(ids, slots, bound); return null; }} catch (e) {{ return e.message; }} }});
      try {{ m.checkIds([0, "support"], [0, 1], 2); }} catch (e) {{ out.push(e.message); }}
      try {{ m.checkIds([0, 1.5], [0, 1], 2); }}
      catch (e) {{ out.push(`${{e.name}}: ${{e.message}}`); }}
      return out;""")
    for (ids, slots, bound), message in zip(cases, got):
        assert message == python_message(ids, slots, bound)
    assert got[-2] == ('ids: got the name "support" at row 1; this pool routes rows by slot: '
                       'the number pool.add returned for that adapter, or -1 for none')
    assert got[-1] == ("TypeError: ids: expected integers (an adapter's index, or -1 for none), "
                       "got 1.5 at row 1")


def rule_cases() -> list:
    """(rows, used, rank) around each of chosen_form's boundaries, and far from them."""
    seg, rows, rank = many_plan.SEGMENT_ROWS, many_plan.FUSED_ROWS, many_plan.FUSED_RANK
    cases = []
    for used in (0, 1, 2, 3, 4, 32, 100):
        edge = seg * max(used, 1)
        for n in sorted({0, 1, edge - 1, edge, edge + 1, rows - 1, rows, rows + 1, 4096}):
            cases += [(n, used, r) for r in (0.0, 4.0, rank - 1e-9, float(rank), rank + 0.5,
                                             64.0)]
    return cases


def test_the_page_picks_the_form_chosen_form_picks(tmp_path):
    """chooseForm (config.rule, read off many_plan) names what chosen_form names on a
    table of (rows, used, rank) around each boundary; a pool's formFor counts the rows
    with an adapter, the adapters used and the mean of their rows' ranks as
    forward_many does (rows of -1 left out)."""
    cases = rule_cases()
    ranks = [4, 64, 40, 39, 8]
    batches = [[0] * 31 + [-1] * 40, [0] * 32 + [-1] * 5, [0, 1] * 31 + [1],
               [0, 1] * 32 + [-1], [1] * 1024, [1] * 1023 + [-1], [2] * 1024 + [-1] * 9,
               [3] * 1100, [2, 3] * 512, [2, 3] * 511 + [2, 2], [-1, -1], list(range(5)) * 40]
    rng = np.random.default_rng()
    batches += [rng.integers(-1, 5, n).tolist() for n in (8, 100, 700, 1500, 3000)]
    layers = [{"a": [0.0] * (r * 42), "b": [0.0] * (36 * r), "rank": r, "scale": 1.0}
              for r in ranks]
    got = run_node(tmp_path, f"""
      const pool = m.createPool(dev);
      for (const l of {json.dumps(layers)}) pool.add(l);
      return {{rule: {json.dumps(cases)}.map(([n, u, r]) => m.chooseForm(n, u, r)),
               batches: {json.dumps(batches)}.map(ids => pool.formFor(ids))}};""",
                   max_rank=64)
    assert got["rule"] == [many_plan.chosen_form(*case) for case in cases]
    assert len(set(got["rule"])) == 3
    for ids, form in zip(batches, got["batches"]):
        named = np.array(ids)[np.array(ids) >= 0]
        rank = float(np.mean(np.array(ranks)[named])) if named.size else 0.0
        assert form == many_plan.chosen_form(named.size, np.unique(named).size, rank), ids


def test_float16_rounds_as_numpy(tmp_path):
    rng = np.random.default_rng()
    values = np.concatenate([rng.standard_normal(3000) * 10.0 ** rng.integers(-9, 6, 3000),
                             np.float16(rng.standard_normal(500)).astype(np.float64) *
                             (1 + 2.0 ** -11),  # ties
                             [0.0, -0.0, 65504, 65519.99, 65520, 1e9, -1e9, 2.0 ** -25,
                              2.0 ** -24, 3 * 2.0 ** -26, 2.0 ** -14, np.inf, -np.inf]])
    values = values.astype(np.float32)
    got = run_node(tmp_path, f"return {json.dumps(values.tolist())}.map(m.halfBits);")
    with np.errstate(over="ignore"):
        want = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(np.array(got, np.uint16), want)


def test_adapters_go_where_the_python_pool_puts_them(tmp_path):
    """add, remove, add: the JS pool's table (A row, B element, rank, scale bits) is
    the Python pool's, growing as it does (a fifth slot, and A rows where no run
    fits: doubled, the others not moved); refused adds (other dims, rank over
    max_rank, a buffer over one binding) write nothing and change no slot."""
    in_dim, out_dim, ranks = 42, 36, [3, 16, 5, 8, 4, 12]
    rng = np.random.default_rng()
    layers = [lora.LoraLayer(rng.standard_normal((r, in_dim)).astype(np.float32),
                             rng.standard_normal((out_dim, r)).astype(np.float32), alpha=2.0 * r)
              for r in ranks]
    pool = lora.AdapterPool(Device(), in_dim, out_dim, max_rank=16, slots=5, rows=32)
    for layer in layers[:4]:
        pool.add(layer)
    pool.remove(1)
    pool.add(layers[4])
    pool.add(layers[5])  # into the rest of the room adapter 1 left
    pool.add(layers[3])  # a sixth slot and no run of 8 rows: table, A and B double
    pool.remove(0)
    pool.add(layers[3])  # into the room the doubling left
    js_layers = [{"a": layer.a.ravel().tolist(), "b": layer.b.ravel().tolist(),
                  "rank": layer.rank, "inDim": in_dim, "outDim": out_dim,
                  "alpha": 2.0 * layer.rank} for layer in layers]
    got = run_node(tmp_path, f"""
      const layers = {json.dumps(js_layers)};
      const pool = m.createPool(dev, {{slots: 5, rows: 32}});
      layers.slice(0, 4).forEach((l, k) => pool.add(l, `adapter ${{k}}`));
      pool.remove(1);
      pool.add(layers[4]);
      const slot = pool.add(layers[5]);
      const before = writes.length;
      pool.add(layers[3]);
      pool.remove(0);
      pool.add(layers[3]);
      const grown = writes.slice(before).filter(([what]) => what.includes("->"));
      const table = Array.from(pool.hostTable), slots = pool.slots, refused = [];
      let refusedWrites = -writes.length;
      const wide = {{...layers[0], inDim: 44, a: new Float32Array(3 * 44)}};
      const big = {{...layers[0], rank: 20, a: new Float32Array(20 * 42),
                    b: new Float32Array(20 * 36)}};
      dev.limits.maxStorageBufferBindingSize = 64 * 42 * 4;  // A holds 64 rows: no more growth
      for (const [layer, name] of [[wide, "wide"], [big, "big"]])
        try {{ pool.add(layer, name); }} catch (e) {{ refused.push(e.message); }}
      let unchanged = Array.from(pool.hostTable).every((v, k) => v === table[k]);
      refusedWrites += writes.length;
      for (let k = 0; refused.length < 3; k++) {{  // rank 16 until no run of A fits one
        const now = Array.from(pool.hostTable), at = writes.length;
        try {{ pool.add(layers[1], `rank 16 #${{k}}`); }} catch (e) {{
          refused.push(e.message);
          refusedWrites += writes.length - at;
          unchanged &&= Array.from(pool.hostTable).every((v, j) => v === now[j]);
        }}
      }}
      let badOption = null;
      try {{ m.createPool(dev, {{inDim: 40}}); }} catch (e) {{ badOption = e.message; }}
      return {{table, slot, refused, badOption, unchanged, refusedWrites, slots,
               grown}};""")
    assert got["table"] == pool.host_table.ravel().tolist() and got["slot"] == 4
    assert got["slots"] == [0, 1, 2, 3, 4, 5] == pool.slots
    assert got["grown"] == [["pool.A -> pool.A", 0, 32 * in_dim * 4],
                            ["pool.B -> pool.B", 0, 32 * out_dim * 4]]
    assert got["refusedWrites"] == 0 and got["unchanged"]
    wide, big, room = got["refused"]
    assert room.endswith(": no room for 16 more A rows: the buffer would grow to 21504 "
                         "bytes, over maxStorageBufferBindingSize = 10752; remove adapters or "
                         "create another pool")
    assert wide.startswith("wide: A [3, 44] and B [36, 3]")
    assert big.startswith("big: rank 20 is over the pool's max_rank 16")
    assert got["badOption"].startswith("createPool: inDim 40 is not this module's 42")


def test_f16_adapters_are_written_as_numpy_rounds_them(tmp_path):
    """An f16 pool needs shader-f16, and writes each adapter's A and B as float16
    bits (numpy's rounding) at the byte offsets of its rows and elements."""
    rng = np.random.default_rng()
    a = rng.standard_normal((5, 42)).astype(np.float32)
    b = rng.standard_normal((36, 5)).astype(np.float32)
    layer = {"a": a.ravel().tolist(), "b": b.ravel().tolist(), "rank": 5, "scale": 0.5}
    got = run_node(tmp_path, f"""
      let refused = null;
      try {{ m.createPool(dev); }} catch (e) {{ refused = e.message; }}
      dev.features.add("shader-f16");
      const pool = m.createPool(dev, {{slots: 2, rows: 16}});
      pool.add({json.dumps(layer)});
      pool.add({json.dumps(layer)});
      return {{refused, writes: writes.map(([label, at, data]) =>
        [label, at, data.constructor.name, Array.from(data)])}};""", dtype="f16")
    assert got["refused"].startswith("createPool: this module needs the WebGPU feature(s) "
                                     "shader-f16")
    got = got["writes"]
    bits = [a.astype(np.float16).view(np.uint16).ravel().tolist(),
            b.astype(np.float16).view(np.uint16).ravel().tolist()]
    assert [w[:3] for w in got] == [["pool.A", 0, "Uint16Array"], ["pool.B", 0, "Uint16Array"],
                                    ["pool.table", 0, "Uint32Array"],
                                    ["pool.A", 5 * 42 * 2, "Uint16Array"],
                                    ["pool.B", 36 * 5 * 2, "Uint16Array"],
                                    ["pool.table", 0, "Uint32Array"]]
    assert [got[k][3] for k in (0, 1, 3, 4)] == bits * 2
    assert got[5][3] == [0, 0, 5, int(np.float32(0.5).view(np.uint32)),
                         5, 180, 5, int(np.float32(0.5).view(np.uint32))]


def test_a_batch_whose_h_is_over_one_binding_is_refused(tmp_path):
    """The split forms' h (a row of config.rankStride f32 per row) over
    maxStorageBufferBindingSize: refused naming the form, nothing written; x and
    output fit."""
    rows = 5000  # x 840000 and output 720000 bytes fit 1 MiB, h 5000 x 64 x 4 does not
    got = run_node(tmp_path, f"""
      globalThis.GPUBuffer = class {{ constructor(d) {{ Object.assign(this, d); }} }};
      dev.createBuffer = d => Object.assign(new GPUBuffer(d), {{destroy() {{}}}});
      const pool = m.createPool(dev);
      pool.add({{a: new Float32Array(4 * 42), b: new Float32Array(36 * 4), rank: 4,
                 scale: 1}});
      const before = writes.length;
      const x = dev.createBuffer({{size: {rows} * 42 * 4}});
      const output = dev.createBuffer({{size: {rows} * 36 * 4}});
      let refused = null;
      try {{ pool.record({{x, output}}, new Int32Array({rows})); }}
      catch (e) {{ refused = e.message; }}
      return {{refused, writes: writes.length - before, form: pool.formFor([0])}};""",
                   max_rank=64)
    assert got["refused"] == ('pool.record: form "split segments t8 rb16" needs h, 1280000 '
                              'bytes (5000 row(s) of 64 f32), over maxStorageBufferBindingSize '
                              '= 1048576; record fewer rows at a time')
    assert got["writes"] == 0 and got["form"] == "split rows rr4 l64 rb16"
