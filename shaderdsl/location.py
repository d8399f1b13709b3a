"""Where the user's code is: the first stack frame outside this package.

Every node, statement and error carries a ``file:line`` so that a mistake is
reported at the user's line. Frames of this package and of ``contextlib``
(``with m.loop(...)`` runs through it) are skipped; which files those are is
decided once per file name, so a location costs a short walk up the stack;
an expression keeps the (file, line) pair and writes it out only when asked.
"""
from __future__ import annotations

import contextlib
import os
import sys

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
_library: set[str] = set()           # co_filename of frames of the library (skipped)
_user: set[str] = set()              # co_filename of frames of the user's code
_shown: dict[tuple, str] = {}        # (co_filename, cwd) -> the name shown to the user


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


def user_line() -> tuple[str, int] | None:
    """(file name, line) of the first frame outside this package: the user's
    code (None if there is none). Cheap: what every expression node keeps."""
    f = sys._getframe(1)
    while f is not None:
        filename = f.f_code.co_filename
        if filename not in _library and (filename in _user or not _classify(filename)):
            return filename, f.f_lineno
        f = f.f_back
    return None


def library_call() -> str:
    """``collectives.reduce``: the library function the user's code called that
    led here, for a node that library code emits; '' when the user called the
    builder itself (``m.barrier()``)."""
    f, inner = sys._getframe(1), None
    while f is not None:
        filename = f.f_code.co_filename
        if filename not in _library and (filename in _user or not _classify(filename)):
            break
        inner, f = f, f.f_back
    if f is None or inner is None:
        return ""
    module = os.path.relpath(os.path.abspath(inner.f_code.co_filename), _PKG_DIR)
    module = os.path.splitext(module)[0].replace(os.sep, ".")
    return "" if module == "builder" else f"{module}.{inner.f_code.co_name}"


def shown(at: tuple[str, int] | None) -> str:
    """'file:line' of a ``user_line()`` result, the file relative to the
    working directory."""
    return "<unknown>" if at is None else f"{_show(at[0])}:{at[1]}"


def caller_location() -> str:
    """'file:line' of the first frame outside this package: the user's code."""
    return shown(user_line())


def is_library_file(filename: str) -> bool:
    """True for a file of this package (or contextlib): not the user's code."""
    return filename in _library or (filename not in _user and _classify(filename))


def _classify(filename: str) -> bool:
    """Decide once whether ``filename`` is the library's; True if it is."""
    path = os.path.abspath(filename)
    library = path.startswith(_PKG_DIR + os.sep) or path == _CONTEXTLIB
    (_library if library else _user).add(filename)
    return library
