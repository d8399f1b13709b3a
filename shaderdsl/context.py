"""The stack of builders whose kernel functions are running, and type
errors at the user's line.

A leaf module: expression nodes ask it which builder is active (to record
the block an expression was built in, or to emit the statement of
``buf[i] = v``) without importing the builder; every layer that types
expressions raises ``type_error(...)``, which names the user's ``file:line``.
"""
from __future__ import annotations

from .errors import ShaderScopeError, ShaderTypeError
from .location import caller_location

_stack: list = []


def push(builder) -> None:
    _stack.append(builder)


def pop() -> None:
    _stack.pop()


def active():
    """The innermost builder being run, or None outside a kernel function."""
    return _stack[-1] if _stack else None


def current():
    """The active builder; a store or atomic outside a kernel function raises."""
    if not _stack:
        raise ShaderScopeError(f"{caller_location()}: a store, compound assignment or atomic "
                               f"was used outside a kernel function being compiled")
    return _stack[-1]


def type_error(msg: str, where: str | None = None) -> ShaderTypeError:
    """A ShaderTypeError naming ``where`` (default: the user's line)."""
    return ShaderTypeError(f"{where or caller_location()}: {msg}")
