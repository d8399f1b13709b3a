"""Several Python threads on one device: forwards and training steps give
exactly what they give in one thread, a batch is never joined by another
thread's work, and the device works afterwards (docs/errors.md, "Threads").
Small shapes and a bounded number of calls, so lavapipe runs it in seconds."""
from __future__ import annotations

import threading

import numpy as np

import lora
import shaderdsl as sd
from lora import AdamW, LayerTrainer
from shaderdsl import builtins as B
from shaderdsl import f32

THREADS = 4
JOIN_S = 120  # a thread still running after this is a hang: the test fails instead of waiting


def run_threads(work, count: int) -> list:
    """``work(i)`` in ``count`` threads at once; their results, in order. An
    exception in a thread is raised here."""
    results: list = [None] * count
    errors: list = []
    start = threading.Barrier(count)

    def run(i):
        try:
            start.wait()
            results[i] = work(i)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), f"a thread did not finish in {JOIN_S} s"
    if errors:
        raise errors[0]
    return results


def problems(seed: int, count: int):
    """``count`` small forwards (x, a, b) of one LoRA shape, token counts 1 to 16
    (baked and run-time plans)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((4, 24)).astype(np.float32)
    b = rng.standard_normal((20, 4)).astype(np.float32)
    return [(rng.standard_normal((t, 24)).astype(np.float32), a, b)
            for t in rng.choice([1, 3, 8, 16], count)]


def test_forwards_from_threads_equal_one_thread(device):
    """4 threads x 24 lora.forward calls of one shape (the crash of issue 30: an
    abort in wgpuQueueSubmit, or a device left broken), each bit for bit what
    the same call gives alone; the device works afterwards."""
    work = [problems(seed, 24) for seed in range(THREADS)]
    alone = [[lora.forward(x, a, b, device=device) for x, a, b in w] for w in work]
    got = run_threads(lambda i: [lora.forward(x, a, b, device=device) for x, a, b in work[i]],
                      THREADS)
    for i in range(THREADS):
        for k, (g, want) in enumerate(zip(got[i], alone[i])):
            assert np.array_equal(g, want), f"thread {i}, call {k}: differs from one thread"
    x, a, b = work[0][0]
    assert np.array_equal(lora.forward(x, a, b, device=device), alone[0][0])


def test_one_weight_shared_by_threads(device):
    """One Weight's cached plan called from 4 threads, each with its own x and
    output (the plan's scratch buffers are shared: a plan records whole)."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((4, 24)), rng.standard_normal((20, 4))
    weight = lora.Weight.from_numpy(device, a, b)
    xs = [[rng.standard_normal((t, 24)).astype(np.float32) for t in (2, 5, 16, 9) * 4]
          for _ in range(THREADS)]

    def forwards(i):
        out = []
        for x in xs[i]:
            x_buf, out_buf = device.buffer(x), device.empty((len(x), 20), np.float32)
            lora.auto_plan(device, weight, 0.5, len(x))(x_buf, out_buf)
            out.append(device.read(out_buf))
            device.release(x_buf)
            device.release(out_buf)
        return out
    alone = [forwards(i) for i in range(THREADS)]
    got = run_threads(forwards, THREADS)
    for i in range(THREADS):
        assert all(np.array_equal(g, w) for g, w in zip(got[i], alone[i])), f"thread {i}"


def train(device, seed: int, steps: int = 20):
    """(A, B, losses) after ``steps`` AdamW steps of a trainer of its own weight."""
    rng = np.random.default_rng(seed)
    tokens, in_dim, out_dim, rank = 8, 16, 12, 4
    a, b = rng.standard_normal((rank, in_dim)), rng.standard_normal((out_dim, rank))
    weight = lora.Weight.from_numpy(device, a, b)
    trainer = LayerTrainer(device, weight, 0.5, tokens, AdamW(lr=1e-2))
    x, base, target = (device.buffer(rng.standard_normal(s).astype(np.float32))
                       for s in [(tokens, in_dim), (tokens, out_dim), (tokens, out_dim)])
    out = device.empty((tokens, out_dim), np.float32)
    losses = []
    for _ in range(steps):
        trainer.record(x, out, target, base_buf=base)
        losses.append(trainer.loss())
    return (*weight.numpy(), losses)


def test_trainers_in_threads_train_as_alone(device):
    """Two LayerTrainers, each on its own weight, in two threads: the same
    adapter and losses, bit for bit, as each trained alone (issue 30: one
    thread's GPUValidationError, the other's adapter off by 1.6e-3)."""
    alone = [train(device, seed) for seed in (1, 2)]
    for _ in range(2):
        got = run_threads(lambda i: train(device, i + 1), 2)
        for i in range(2):
            a, b, losses = got[i]
            assert np.array_equal(a, alone[i][0]) and np.array_equal(b, alone[i][1]), \
                f"trainer {i}: its adapter differs from training alone"
            assert losses == alone[i][2], f"trainer {i}: its losses differ from training alone"


def add_value(m):
    """buf[i] += v"""
    buf = m.declare_output_buffer("buf", f32)
    v = m.declare_uniform("v", f32)
    i = m.let(m.global_id().x, "i")
    with m.if_(i < B.array_length(buf)):
        buf[i] = buf[i] + v


def test_a_batch_is_not_joined_by_another_thread(device):
    """While one thread's batch is open, another thread's calls wait for its
    submit (they would otherwise land in its encoder) and are not in a batch."""
    kernel = sd.compile(add_value, 64)
    mine, theirs = device.zeros(64, np.float32), device.zeros(64, np.float32)
    opened, done = threading.Event(), threading.Event()
    seen = {}

    def other():
        opened.wait(JOIN_S)
        seen["in_batch"] = device.in_batch
        device.dispatch(kernel, {"buf": theirs, "v": 5.0}, 1)
        seen["theirs"] = device.read(theirs)
        done.set()
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    with device.batch():
        device.dispatch(kernel, {"buf": mine, "v": 1.0}, 1)
        opened.set()
        assert not done.wait(0.3), "another thread's read went through during an open batch"
        device.dispatch(kernel, {"buf": mine, "v": 2.0}, 1)
        assert device.in_batch
    thread.join(JOIN_S)
    assert done.is_set() and seen["in_batch"] is False
    assert np.array_equal(seen["theirs"], np.full(64, 5, np.float32))
    assert np.array_equal(device.read(mine), np.full(64, 3, np.float32))


def test_interpreter_device_from_threads():
    """The interpreter device takes the same lock: dispatches from two threads
    on their own buffers give what one thread gives."""
    from shaderdsl.interp import Device

    dev = Device()
    kernel = sd.compile(add_value, 8)

    def adds(i):
        buf = dev.zeros(8, np.float32)
        for v in range(1, 6):
            dev.dispatch(kernel, {"buf": buf, "v": float(v * (i + 1))}, 1)
        return dev.read(buf)
    got = run_threads(adds, 2)
    for i in range(2):
        assert np.array_equal(got[i], np.full(8, 15 * (i + 1), np.float32))


def test_get_device_from_threads_gives_one_device(device):
    """Threads asking for the default device at once share one."""
    from shaderdsl.runtime import get_device

    got = run_threads(lambda i: get_device(), THREADS)
    assert all(d is got[0] for d in got)
