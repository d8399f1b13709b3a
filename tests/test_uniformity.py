"""WGSL's uniformity rules at build (shaderdsl.uniformity), cross-checked with Tint.

The corpus: hand-written kernels for each rule (what varies, what a return,
break or continue does, vars assigned under a condition or in a later loop
iteration, functions with barriers and with parameters that decide them,
the workgroup collectives) and random programs of nested ifs and loops with
barriers, subgroup operations, jumps and assignments, each built with the
check turned off. Tint (Dawn's Null backend, in a subprocess) compiles each
kernel's WGSL; the DSL must refuse exactly the kernels Tint refuses, and Tint
must refuse some and take some (so the agreement means something).
"""
# pyright: reportInvalidTypeForm=false
# (@sd.function annotates parameters and results with WGSL types, f32 and the like: DSL
# values, which pyright checks as Python type expressions and refuses)
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import shaderdsl as sd
from shaderdsl import builtins as B
from shaderdsl import collectives, compiler, f32, u32, uniformity
from shaderdsl.errors import UniformityError

HERE = Path(__file__).resolve().parent
RANDOM_PROGRAMS = 1000


# ------------------------------------------------------------------ the hand-written corpus

def _buffers(m):
    return (m.declare_input_buffer("ro", u32), m.declare_output_buffer("rw", u32),
            m.declare_uniform("un", u32), m.shared(u32, 64, "wg"))


def _source(m, name):
    ro, rw, un, wg = m.bindings[:3] + [m.workgroup_vars[0]]
    return {"lid": lambda: m.local_index(), "wid": lambda: m.workgroup_id().x,
            "sgs": lambda: m.subgroup_size(), "sgid": lambda: m.subgroup_invocation_id(),
            "ro": lambda: ro[0], "ro_lid": lambda: ro[m.local_index()], "rw": lambda: rw[0],
            "un": lambda: un, "wg": lambda: wg[0]}[name]()


def barrier_if(source):
    def k(m):
        _buffers(m)
        with m.if_(_source(m, source) < 3):
            m.barrier()
    k.__name__ = f"barrier_if_{source}"
    return k


def return_then_barrier(m):
    _buffers(m)
    with m.if_(m.local_index() < 3):
        m.return_()
    m.barrier()


def uniform_return_then_barrier(m):
    _buffers(m)
    with m.if_(m.workgroup_id().x < 3):
        m.return_()
    m.barrier()


def break_then_barrier_after(m):
    _buffers(m)
    with m.loop(4) as i:
        with m.if_(m.local_index() < i):
            m.break_()
    m.barrier()


def jump_then_barrier_inside(kind):
    def k(m):
        _buffers(m)
        with m.loop(4) as i:
            with m.if_(m.local_index() < i):
                (m.break_ if kind == "break" else m.continue_)()
            m.barrier()
    k.__name__ = f"{kind}_then_barrier_inside"
    return k


def var_assigned_under_varying_if(m):
    _, rw, _, _ = _buffers(m)
    x = m.var(u32, 0, "x")
    with m.if_(m.local_index() < 3):
        m.assign(x, 1)
    with m.if_(x == 0):
        m.barrier()


def var_assigned_after_use(m):
    _, rw, _, _ = _buffers(m)
    x = m.var(u32, 0, "x")
    with m.if_(x == 0):
        m.barrier()
    m.assign(x, m.local_index())
    rw[0] = x


def var_carried_by_the_loop(m):
    _, rw, _, _ = _buffers(m)
    x = m.var(u32, 0, "x")
    with m.loop(4):
        with m.if_(x == 0):
            m.barrier()
        m.assign(x, m.local_index())
    rw[0] = x


def loop_bound_varies(m):
    _buffers(m)
    with m.loop(m.local_index() % 4):
        m.barrier()


def subgroup_op_under_varying_if(m):
    _, rw, _, _ = _buffers(m)
    with m.if_(m.local_index() < 3):
        rw[0] = B.subgroup_add(u32(1))


def subgroup_result_decides(first):
    def k(m):
        _buffers(m)
        s = m.let(B.subgroup_broadcast_first(m.local_index()) if first
                  else B.subgroup_add(u32(1)), "s")
        with m.if_(s < 3):
            m.barrier()
    k.__name__ = f"subgroup_result_decides_{'first' if first else 'add'}"
    return k


def select_decides(m):
    _buffers(m)
    s = m.let(B.select(u32(0), u32(1), m.local_index() < 2), "s")
    with m.if_(s == 0):
        m.barrier()


def storage_barrier_under_varying_if(m):
    _buffers(m)
    with m.if_(m.local_index() < 3):
        m.storage_barrier()


def store_under_varying_if_then_barrier(m):
    _, rw, _, _ = _buffers(m)
    with m.if_(m.local_index() < 3):
        rw[0] = 1
    m.barrier()


def else_if_under_varying_first(m):
    _buffers(m)
    with m.if_(m.local_index() < 3):
        pass
    with m.elif_(m.workgroup_id().x < 2):
        m.barrier()


@sd.function
def _synced(m, v: u32) -> u32:
    m.barrier()
    return v + 1


@sd.function
def _synced_if(m, v: u32) -> u32:
    with m.if_(v < 3):
        m.barrier()
    return v


@sd.function
def _index(m, v: u32) -> u32:
    return v + m.local_index()


@sd.function
def _added(m, v: u32) -> u32:
    return B.subgroup_add(v)


def function_call(where, argument, fn=None):
    """``fn``: the function called (default: one with a barrier)."""
    def k(m):
        _, rw, _, _ = _buffers(m)
        arg = _source(m, argument)
        if where == "if":
            with m.if_(m.local_index() < 3):
                rw[0] = (fn or _synced)(m, arg)
        elif where == "param":
            rw[0] = (fn or _synced_if)(m, arg)
        else:  # a varying result
            r = m.let(_index(m, arg), "r")
            with m.if_(r < 3):
                m.barrier()
    k.__name__ = f"call_{where}_{argument}" + (f"_{fn.__name__}" if fn else "")
    return k


def reduce_under(source):
    def k(m):
        _, rw, _, _ = _buffers(m)
        with m.if_(_source(m, source) < 3):
            total, = collectives.reduce(m, [f32(1.0)], "sum")
            rw[0] = u32(total)
    k.__name__ = f"reduce_under_{source}"
    return k


def shuffle_argument(op, source):
    """A shuffle's delta or mask must be uniform (subgroupShuffle's lane need not)."""
    def k(m):
        _, rw, _, _ = _buffers(m)
        rw[m.local_index()] = u32(getattr(B, op)(f32(1.0), _source(m, source) % 4))
    k.__name__ = f"{op}_by_{source}"
    return k


@sd.function
def _shuffle_by(m, v: u32) -> f32:
    return B.subgroup_shuffle_xor(f32(1.0), v)


def shuffle_in_function(source):
    """A function passing its parameter on as a mask: the argument must be uniform."""
    def k(m):
        _, rw, _, _ = _buffers(m)
        rw[0] = u32(_shuffle_by(m, _source(m, source) % 4))
    k.__name__ = f"shuffle_in_function_{source}"
    return k


CORPUS = ([barrier_if(s) for s in ("lid", "wid", "sgs", "sgid", "ro", "ro_lid", "rw", "un", "wg")]
          + [return_then_barrier, uniform_return_then_barrier, break_then_barrier_after,
             jump_then_barrier_inside("break"), jump_then_barrier_inside("continue"),
             var_assigned_under_varying_if, var_assigned_after_use, var_carried_by_the_loop,
             loop_bound_varies, subgroup_op_under_varying_if, subgroup_result_decides(True),
             subgroup_result_decides(False), select_decides, storage_barrier_under_varying_if,
             store_under_varying_if_then_barrier, else_if_under_varying_first]
          + [function_call(w, a) for w in ("if", "param", "result") for a in ("lid", "wid")]
          + [reduce_under("lid"), reduce_under("wid")]
          + [shuffle_argument(op, a) for op in ("subgroup_shuffle", "subgroup_shuffle_xor",
                                                "subgroup_shuffle_up", "subgroup_shuffle_down")
             for a in ("lid", "wid", "rw")]
          + [shuffle_in_function(a) for a in ("lid", "un")]
          + [function_call(w, a, _added) for w in ("if", "param") for a in ("lid", "wid")])


# ------------------------------------------------------------------ random programs

def random_program(seed: int):
    """Nested ifs and loops (depth <= 3) whose conditions and bounds come from
    uniform and varying sources and two vars, with barriers, subgroup adds,
    assignments, and a break, continue or return closing some if bodies."""
    rng = random.Random(seed)
    sources = ("lid", "wid", "sgs", "ro", "ro_lid", "rw", "un", "wg", "v0", "v1", "k")

    def k(m):
        _, rw, _, _ = _buffers(m)
        vs = [m.var(u32, 0, f"v{i}") for i in range(2)]

        def value(loops):
            name = rng.choice(sources)
            if name in ("v0", "v1"):
                return vs[int(name[1])] + 0
            if name == "k":
                return loops[-1] + 0 if loops else u32(1)
            return _source(m, name)

        def block(depth, loops):
            for _ in range(rng.randint(1, 3)):
                kind = rng.choice(("barrier", "subgroup", "assign", "if", "loop")
                                  if depth < 3 else ("barrier", "subgroup", "assign"))
                if kind == "barrier":
                    m.barrier()
                elif kind == "subgroup":
                    rw[1] = B.subgroup_add(u32(1))
                elif kind == "assign":
                    m.assign(vs[rng.randrange(2)], value(loops))
                elif kind == "if":
                    with m.if_(value(loops) < rng.randint(1, 4)):
                        block(depth + 1, loops)
                        jump = rng.choice(("", "", "return") + (("break", "continue")
                                                                if loops else ()))
                        if jump:
                            {"return": m.return_, "break": m.break_,
                             "continue": m.continue_}[jump]()
                else:
                    with m.loop(value(loops) % 3) as i:
                        block(depth + 1, loops + [i])

        block(0, [])
        rw[0] = vs[0] + vs[1]
    k.__name__ = f"random_{seed}"
    return k


# ------------------------------------------------------------------ the check

def _unchecked(fn, monkeypatch):
    """The kernel with the analysis off: its WGSL for Tint, its tree for the DSL."""
    with monkeypatch.context() as mp:
        mp.setattr(uniformity, "check", lambda module: None)
        return compiler._build(fn, (64, 1, 1), fn.__name__, {})


def _tint(texts: list[str], tmp_path) -> list[str]:
    if importlib.util.find_spec("wgpudawn") is None:
        pytest.skip("wgpudawn not installed: no Tint to compare with")
    src, dst = tmp_path / "wgsl.json", tmp_path / "verdicts.json"
    src.write_text(json.dumps(texts))
    env = dict(os.environ, SHADERDSL_WGPU="dawn", WGPU_BACKEND_TYPE="Null")
    for name in ("SHADERDSL_BACKEND", "SHADERDSL_ADAPTER"):  # would filter out the Null adapter
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(HERE / "tint_compile.py"), str(src), str(dst)],
                          cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(dst.read_text())


def test_the_dsl_refuses_exactly_what_tint_refuses(monkeypatch, tmp_path):
    kernels = CORPUS + [random_program(seed) for seed in range(RANDOM_PROGRAMS)]
    built = [_unchecked(fn, monkeypatch) for fn in kernels]
    verdicts = _tint([k.wgsl_for("tint") for k in built], tmp_path)
    disagree, refused = [], 0
    for fn, kernel, tint in zip(kernels, built, verdicts):
        assert tint == "ok" or "uniform control flow" in tint or "to be uniform" in tint, \
            (fn.__name__, tint)
        assert kernel.ir is not None, fn.__name__
        dsl = uniformity.find(kernel.ir)
        refused += tint != "ok"
        if bool(dsl) != (tint != "ok"):
            disagree.append((fn.__name__, tint, dsl[:1]))
    assert not disagree, disagree
    assert 0.2 * len(kernels) < refused < 0.8 * len(kernels)
    print(f"uniformity corpus: {len(kernels)} kernels ({len(CORPUS)} written, "
          f"{RANDOM_PROGRAMS} random), Tint refused {refused}; the DSL agrees on all")


# ------------------------------------------------------------------ messages

def test_the_message_names_the_barrier_and_the_condition():
    with pytest.raises(UniformityError) as info:
        sd.compile(barrier_if("lid"), 64)
    msg = str(info.value)
    lines = [n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
             if "with m.if_(_source(m, source) < 3):" in text or text.strip() == "m.barrier()"]
    assert f"workgroupBarrier() at tests/test_uniformity.py:{lines[1]}" in msg
    assert f"the if at tests/test_uniformity.py:{lines[0]}, whose condition reads local_index" \
        in msg
    assert "Tint (Dawn, every browser) refuses" in msg


def test_a_return_and_a_function_are_named():
    with pytest.raises(UniformityError, match=r"workgroupBarrier\(\) at \S+ runs in non-uniform "
                                              r"control flow: the return at \S+, which only "
                                              r"some invocations take, comes before it \(rather "
                                              r"than leaving early, guard the work with m.if_\)"):
        sd.compile(return_then_barrier, 64)
    with pytest.raises(UniformityError, match=r"synced\(\) at \S+ \(it reaches "
                                              r"workgroupBarrier\(\) at \S+\) runs in "
                                              r"non-uniform control flow"):
        sd.compile(function_call("if", "wid"), 64)
    with pytest.raises(UniformityError, match=r"argument 1 of synced_if\(\) at \S+ reads "
                                              r"local_index, which varies between invocations, "
                                              r"and it decides whether workgroupBarrier\(\)"):
        sd.compile(function_call("param", "lid"), 64)


def test_a_varying_shuffle_mask_is_named():
    with pytest.raises(UniformityError, match=r"argument 2 of subgroup_shuffle_xor\(\) at \S+"
                                              r"test_uniformity.py:\d+ reads local_index, which "
                                              r"varies between invocations; WGSL requires it "
                                              r"uniform"):
        sd.compile(shuffle_argument("subgroup_shuffle_xor", "lid"), 64)
    sd.compile(shuffle_argument("subgroup_shuffle", "lid"), 64)  # any lane may be read


def reduce_under_an_if(m):
    x = m.declare_input_buffer("x", f32)
    y = m.declare_output_buffer("y", f32)
    i = m.global_id().x
    with m.if_(i < B.array_length(x)):
        y[i] = collectives.reduce(m, x[i])   # THE CALL


def test_a_barrier_a_collective_emits_names_the_collective():
    """The user called collectives.reduce, not workgroupBarrier(): the message
    says whose barrier it is, at the user's line."""
    line = next(n for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text.endswith("# THE CALL"))
    with pytest.raises(UniformityError, match=rf"workgroupBarrier\(\) of collectives.reduce\(\) "
                                              rf"at tests/test_uniformity.py:{line} runs in "
                                              rf"non-uniform control flow"):
        sd.compile(reduce_under_an_if, 64)
    def plain(m):
        m.declare_output_buffer("y", f32)
        m.barrier()
    ir = sd.compile(plain, 64).ir
    assert ir is not None and ir.body.stmts[-1].via == ""   # the user's own m.barrier()
