"""The stack of builders whose kernel functions are running, and type
errors at the user's line.

A leaf module: expression nodes ask it which builder is active (to record
the block an expression was built in, or to emit the statement of
``buf[i] = v``) without importing the builder; every layer that types
expressions raises ``type_error(...)``, which names the user's ``file:line``.
The stack is per thread, so threads can build kernels at the same time.
"""
from __future__ import annotations

import threading

from .errors import ShaderScopeError, ShaderTypeError
from .location import caller_location


class _Stacks(threading.local):
    """Each thread's stack of the builders it is running, innermost last."""

    def __init__(self):
        self.stack: list = []


_local = _Stacks()


def push(builder) -> None:
    _local.stack.append(builder)


def pop() -> None:
    _local.stack.pop()


def active():
    """The innermost builder being run, or None outside a kernel function."""
    stack = _local.stack
    return stack[-1] if stack else None


def current():
    """The active builder; a store or atomic outside a kernel function raises."""
    stack = _local.stack
    if not stack:
        raise ShaderScopeError(f"{caller_location()}: a store, compound assignment or atomic "
                               f"was used outside a kernel function being compiled")
    return stack[-1]


def type_error(msg: str, where: str | None = None) -> ShaderTypeError:
    """A ShaderTypeError naming ``where`` (default: the user's line)."""
    return ShaderTypeError(f"{where or caller_location()}: {msg}")
