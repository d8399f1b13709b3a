"""Runtime: run generated kernels on wgpu-py.

The runtime only consumes ``Kernel`` objects (WGSL text plus binding table);
it never builds AST. One module per job: ``device`` (adapter choice, Device),
``buffers`` (Buffer, host checks), ``checks`` (dispatch validation),
``pipelines`` (caches, compile errors), ``batch`` (encoders, timestamps).
"""
from .build_choice import COMPILER, WGPU_BUILD  # first: it may install Dawn as wgpu
from .batch import Batch
from .buffers import Buffer
from .device import Device, adapters_report, get_device, list_adapters

__all__ = ["COMPILER", "WGPU_BUILD", "Batch", "Buffer", "Device", "adapters_report", "get_device", "list_adapters"]
