"""Where the user's code is: the first stack frame outside this package.

Every node, statement and error carries a ``file:line`` so that a mistake is
reported at the user's line. Frames of this package and of ``contextlib``
(``with m.loop(...)`` runs through it) are skipped; which files those are is
decided once per file name, so a location costs a short walk up the stack.
"""
from __future__ import annotations

import contextlib
import os
import sys

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
_skip: dict[str, bool] = {}          # co_filename -> frame belongs to the library
_shown: dict[tuple, str] = {}        # (co_filename, cwd) -> the name shown to the user


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PKG_DIR + os.sep) or path == _CONTEXTLIB


def _show(filename: str) -> str:
    cwd = os.getcwd()
    key = (filename, cwd)
    name = _shown.get(key)
    if name is None:
        try:
            name = os.path.relpath(filename, cwd)
        except ValueError:  # another drive (Windows)
            name = filename
        _shown[key] = name
    return name


def caller_location() -> str:
    """'file:line' of the first frame outside this package: the user's code."""
    f = sys._getframe(1)
    while f is not None:
        filename = f.f_code.co_filename
        skip = _skip.get(filename)
        if skip is None:
            skip = _skip[filename] = _is_library(filename)
        if not skip:
            return f"{_show(filename)}:{f.f_lineno}"
        f = f.f_back
    return "<unknown>"


def is_library_file(filename: str) -> bool:
    """True for a file of this package (or contextlib): not the user's code."""
    skip = _skip.get(filename)
    if skip is None:
        skip = _skip[filename] = _is_library(filename)
    return skip
