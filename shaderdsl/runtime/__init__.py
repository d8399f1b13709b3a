"""Runtime: run generated kernels on wgpu-py.

The runtime only consumes ``Kernel`` objects (WGSL text plus binding table);
it never builds AST. One module per job: ``wgpu_build`` (wgpu-native or Dawn),
``adapters`` (listing and choice), ``device`` (Device), ``buffers`` (Buffer),
``pipelines`` (caches, compile errors), ``batch`` (encoders, timestamps),
``ring`` (per-dispatch uniform values).
The checks it makes before anything reaches the GPU are ``shaderdsl.checks``.
"""
# First: with SHADERDSL_WGPU=dawn it installs Dawn as ``wgpu`` before anything imports wgpu.
from .wgpu_build import COMPILER, WGPU_BUILD

# isort: split
from .adapters import adapters_report, list_adapters
from .batch import Batch
from .buffers import Buffer
from .device import Device, get_device

__all__ = ["COMPILER", "WGPU_BUILD", "Batch", "Buffer", "Device", "adapters_report", "get_device",
           "list_adapters"]
