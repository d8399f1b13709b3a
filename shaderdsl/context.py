"""The stack of builders whose kernel functions are running.

A leaf module: expression nodes ask it which builder is active (to record
the block an expression was built in, or to emit the statement of
``buf[i] = v``) without importing the builder.
"""
from __future__ import annotations

from .errors import ShaderScopeError
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
