"""The bench's WebGPU peers: ONNX Runtime's WebGPU execution provider (PyPI
``onnxruntime-webgpu``) running the same products on the same GPU in the same
run, where it is installed; neither it nor ``onnx`` (which builds its graphs)
is a dependency of the package.

Each product is a small ONNX graph whose inputs are made in the graph: an f16
GEMM M x N x K in bench_gemm's two layouts (``plain``: MatMul of x [M, K] and
W [K, N]; ``linear``: a Linear layer's y = x W^T, W [N, K], as Gemm with
transB, the form an exported Linear takes), and the LoRA forward
``out = base + s (x A^T) B^T`` (two Gemms, the second adding base). Outputs
are f16: ONNX's products return their inputs' type.

How it is run (facts from ORT 1.27, gathered in the project's performance
notes): provider options are session config entries
``ep.webgpuexecutionprovider.<key>`` (graph capture on for the timed session);
``session.disable_cpu_ep_fallback`` keeps a node from running on the CPU
unnoticed; inputs are put on the device by running an Identity graph whose
output is bound to "webgpu" (``OrtValue.ortvalue_from_numpy(..., "webgpu")``
fails in this package), and one session stays open throughout, because the
sessions share ORT's WebGPU device only while one of them lives. A run
returns before the GPU finishes: a timed batch of runs ends with a one-row
read-back, and the time is the batch's wall time over its runs (median of 5
batches, each at least 20 ms). Results are checked against float64 numpy on
a set of rows: the largest error over the largest value.

tinygrad (device ``WEBGPU``) has no row: ``TINYGRAD_WHY`` says why.
"""
from __future__ import annotations

import importlib
import time

import numpy as np

from ..core.tuning import median_of_batches

ORT_INSTALL = "pip install onnxruntime-webgpu onnx"
TINYGRAD_WHY = ("tinygrad WEBGPU: no row (its WGSL uses no matrix units, and the Dawn it "
                "loads never offers shader-f16 on NVIDIA, so its f16 products cannot run "
                "there as shipped)")
# errors over this are WRONG. ORT's f16 products sum in f16 (rounded at each step): on
# lavapipe their error grows with K, 1.8e-3 at K = 32, 1.3e-2 at 4096, 2.2e-2 at 4864
# (MatMul, 64 x 2048); a wrong result (a tile missed, a factor transposed) errs by
# order 1. Ours sums in f32 and rounds once: bench_gemm's bar is 2^-10.
ORT_TOLERANCE = 0.05
OPSET = 17
CHECK_ROWS = 64


def ort_webgpu():
    """The onnxruntime module when it has the WebGpuExecutionProvider and onnx
    imports, else a line saying why not and how to install it."""
    try:
        importlib.import_module("onnx")
        ort = importlib.import_module("onnxruntime")
    except ImportError as e:
        return f"ORT WebGPU: not installed ({e.name} missing): {ORT_INSTALL}"
    if "WebGpuExecutionProvider" not in ort.get_available_providers():
        return (f"ORT WebGPU: onnxruntime {ort.__version__} has no WebGpuExecutionProvider: "
                f"{ORT_INSTALL} (its wheel also imports as onnxruntime: install it in place "
                f"of that one, or into a folder put first on PYTHONPATH)")
    return ort


# ------------------------------------------------------------------ graphs

def _onnx(name: str = "helper"):
    """onnx's module ``name``, imported by name: the package (and the type
    checker) need not have onnx."""
    return importlib.import_module(f"onnx.{name}")


def _model(nodes, inputs, outputs, initializers=()) -> bytes:
    """An ONNX model of ``nodes``; ``inputs`` and ``outputs``: (name, shape) of
    f16 tensors (a None dimension: any size)."""
    helper = _onnx()
    f16 = importlib.import_module("onnx").TensorProto.FLOAT16

    def values(named):
        return [helper.make_tensor_value_info(n, f16, [d if d else f"d{i}" for i, d in
                                                         enumerate(shape)])
                for n, shape in named]
    graph = helper.make_graph(nodes, "peer", values(inputs), values(outputs),
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 9  # what ORT 1.27 reads
    return model.SerializeToString()


def gemm_model(M: int, N: int, K: int, layout: str) -> bytes:
    """y [M, N] f16 = x [M, K] @ W: ``plain`` W [K, N] (MatMul), ``linear`` W
    [N, K] transposed (Gemm, transB)."""
    helper = _onnx()
    if layout == "plain":
        node, w = helper.make_node("MatMul", ["x", "w"], ["y"]), [K, N]
    else:
        node, w = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1), [N, K]
    return _model([node], [("x", [M, K]), ("w", w)], [("y", [M, N])])


def lora_model(tokens: int, rank: int, in_dim: int, out_dim: int, scale: float) -> bytes:
    """out [T, out] f16 = base + scale (x A^T) B^T: x [T, in], A [rank, in],
    B [out, rank], base [T, out]."""
    helper = _onnx()
    nodes = [helper.make_node("Gemm", ["x", "a"], ["h"], transB=1),
             helper.make_node("Gemm", ["h", "b", "base"], ["out"], transB=1, alpha=float(scale))]
    return _model(nodes, [("x", [tokens, in_dim]), ("a", [rank, in_dim]),
                          ("b", [out_dim, rank]), ("base", [tokens, out_dim])],
                  [("out", [tokens, out_dim])])


def rows_model(rows) -> bytes:
    """out = y[rows] (any 2-D f16 y): the rows read back to check, or one row
    to end a timed batch."""
    helper = _onnx()
    index = _onnx("numpy_helper").from_array(np.asarray(rows, np.int64), "rows")
    return _model([helper.make_node("Gather", ["y", "rows"], ["out"], axis=0)],
                  [("y", [None, None])], [("out", [len(rows), None])], [index])


# ------------------------------------------------------------------ running

class OrtWebGpu:
    """ORT's WebGPU execution provider, its device kept open by an Identity
    session (the one that puts arrays on the device)."""

    def __init__(self, ort):
        self.ort = ort
        self.upload = self.session(_model([_onnx().make_node("Identity", ["x"], ["y"])],
                                          [("x", [None, None])], [("y", [None, None])]))

    def session(self, model: bytes, capture: bool = False):
        options = self.ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if capture:
            options.add_session_config_entry("ep.webgpuexecutionprovider.enableGraphCapture", "1")
        return self.ort.InferenceSession(model, options, providers=["WebGpuExecutionProvider"])

    def on_device(self, array: np.ndarray):
        """An OrtValue on the WebGPU device holding ``array`` (2-D f16)."""
        binding = self.upload.io_binding()
        binding.bind_cpu_input("x", np.ascontiguousarray(array, np.float16))
        binding.bind_output("y", "webgpu")
        self.upload.run_with_iobinding(binding)
        return binding.get_outputs()[0]

    def reader(self, value, rows):
        """A function that reads ``value``'s ``rows`` back (a float64 array)."""
        session = self.session(rows_model(rows))
        binding = session.io_binding()
        binding.bind_ortvalue_input("y", value)
        binding.bind_output("out", "cpu")

        def read() -> np.ndarray:
            session.run_with_iobinding(binding)
            return binding.copy_outputs_to_cpu()[0].astype(np.float64)
        return read

    def run(self, model: bytes, inputs: dict, out_shape: tuple, want_rows, want):
        """Run ``model`` (output ``out_shape``) on ``inputs`` (name: array), put
        on the device first; check ``want_rows`` of the result against ``want``
        (float64), then time it: a dict of us, rel_err and right."""
        values = {name: self.on_device(a) for name, a in inputs.items()}
        out = self.on_device(np.zeros(out_shape, np.float16))  # the output, bound in place
        session = self.session(model, capture=True)
        binding = session.io_binding()
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(session.get_outputs()[0].name, out)
        session.run_with_iobinding(binding)
        err = float(np.abs(self.reader(out, want_rows)() - want).max() / np.abs(want).max())
        us = batch_us(lambda: session.run_with_iobinding(binding), self.reader(out, [0]))
        return {"us": us, "rel_err": err, "right": bool(err < ORT_TOLERANCE)}


def batch_us(run, read, repeats: int = 5) -> float:
    """Median wall microseconds of one ``run()`` over batches of runs each ended
    by ``read()`` (which waits for the GPU): tuning.median_of_batches."""
    def batch(count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            run()
        read()
        return (time.perf_counter() - t0) * 1e9
    return median_of_batches(batch, 4, repeats)


def start():
    """An OrtWebGpu, or a line saying why there is none (not installed, or
    its device did not open)."""
    ort = ort_webgpu()
    if isinstance(ort, str):
        return ort
    try:
        return OrtWebGpu(ort)
    except Exception as e:  # ORT raises RuntimeError and its own pybind errors
        cause = str(e.__cause__ or e).strip()  # past the wrapper's CPU retry, which fails too
        line = cause.splitlines()[-1] if cause else type(e).__name__
        line = line[line.find("Failed"):] if "Failed" in line else line  # less its source line
        return f"ORT WebGPU {ort.__version__}: no device: {line}"


def check_rows(M: int) -> np.ndarray:
    """The rows of an M-row result that are checked (CHECK_ROWS spread over M)."""
    return np.unique(np.linspace(0, M - 1, CHECK_ROWS).astype(np.int64))


def gemm(peer: OrtWebGpu, a: np.ndarray, b: np.ndarray, layout: str) -> dict:
    """ORT's f16 product a [M, K] @ b [K, N] in ``layout`` (``linear``: b stored
    transposed), checked on check_rows(M), then timed; us, tflops, rel_err, right."""
    (M, K), N = a.shape, b.shape[1]
    rows = check_rows(M)
    want = a[rows].astype(np.float64) @ b.astype(np.float64)
    w = np.ascontiguousarray(b.T) if layout == "linear" else b
    row = peer.run(gemm_model(M, N, K, layout), {"x": a, "w": w}, (M, N), rows, want)
    return {**row, "tflops": 2 * M * N * K / row["us"] / 1e6}


def lora_forward(peer: OrtWebGpu, x, a, b, base, scale: float) -> dict:
    """ORT's f16 LoRA forward base + scale (x A^T) B^T, checked on
    check_rows(tokens), then timed; us, rel_err, right."""
    (tokens, in_dim), (rank, out_dim) = x.shape, (a.shape[0], b.shape[0])
    rows = check_rows(tokens)
    f64 = [v.astype(np.float64) for v in (x[rows], a, b, base[rows])]
    want = f64[3] + scale * (f64[0] @ f64[1].T) @ f64[2].T
    return peer.run(lora_model(tokens, rank, in_dim, out_dim, scale),
                    {"x": x, "a": a, "b": b, "base": base}, (tokens, out_dim), rows, want)
