"""Every Python block of README.md and docs/*.md runs as written, in reading
order: the blocks of one file share one namespace, as a reader's session
would, run in a fresh folder with the project root importable (``examples``)."""
import re
from pathlib import Path

import pytest

from shaderdsl.errors import BrowserError, FeatureError

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
FILES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
         if BLOCK.search(p.read_text())]


def test_the_files_with_blocks_are_found():
    assert {p.name for p in FILES} >= {"README.md", "dsl.md", "lora.md", "training.md",
                                        "interpreter.md", "adapter-files.md"}


@pytest.mark.parametrize("doc", FILES, ids=lambda p: p.name)
def test_every_python_block_runs(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace = {"__name__": "__doc_block__"}
    blocks = BLOCK.findall(doc.read_text())
    for k, block in enumerate(blocks):
        try:
            exec(compile(block, f"{doc.name}, Python block {k + 1} of {len(blocks)}", "exec"),
                 namespace)
        except FeatureError as e:  # an f16 block on llvmpipe: the adapter, not the doc
            pytest.skip(f"{doc.name}, Python block {k + 1} of {len(blocks)} needs what the "
                        f"adapter lacks: {e}")
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            pytest.skip(f"{doc.name}, Python block {k + 1} of {len(blocks)} needs torch, "
                        f"which is not in the test extras (its Linux wheels bring CUDA)")
        except Exception as e:
            if isinstance(e, BrowserError) and "no Chromium found" in str(e):
                pytest.skip(f"{doc.name}, Python block {k + 1} of {len(blocks)} needs Chromium, "
                            f"which this machine lacks (scripts/setup.sh installs it)")
            raise AssertionError(f"{doc.name}, Python block {k + 1} of {len(blocks)} raised "
                                 f"{type(e).__name__}: {e}\n{block}") from e
