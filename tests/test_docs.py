"""The WGSL listings in docs/lora.md and docs/training.md are what the command
above each prints."""
import re
import shlex
from pathlib import Path

import pytest

from lora.apps.cli import main

DOCS = [Path(__file__).resolve().parent.parent / "docs" / name
        for name in ("lora.md", "training.md")]
LISTING = re.compile(r"`(python -m lora wgsl [^`]+)`\s*\n(?:\s*<details>[^\n]*\n)?"
                     r"\s*```wgsl\n(.*?)```", re.S)


def listings():
    found = []
    for doc in DOCS:
        these = LISTING.findall(doc.read_text())
        assert these, f"{doc.name} has no WGSL listings under a `python -m lora wgsl` command"
        found += these
    return found


@pytest.mark.parametrize("command, wgsl", listings(), ids=lambda v: v[:60] if "wgsl" in v else "")
def test_listing_matches_the_cli(command, wgsl, capsys):
    argv = shlex.split(command)[3:]  # drop "python -m lora"
    assert main(argv) == 0
    assert capsys.readouterr().out == wgsl
