"""Every Python block of README.md and docs/*.md runs as written, in reading
order, in a fresh folder with the project root importable (``examples``).

In the files of ``RUN_ALONE`` each block runs alone, in a namespace and folder of its
own, unless the paragraph just before it says it "continues the block above": then
it runs in the namespace and folder of the Python block above it (and so of every
block that one continued). In the other files the blocks of a file share one
namespace, as a reader's session would. Each chain of blocks that run together is
a test of its own (``training.md:4``: the chain from its fourth block), timed alone."""
import re
from pathlib import Path

import pytest

from shaderdsl.errors import BrowserError, FeatureError

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CONTINUES = re.compile(r"\bcontinues\s+the\s+block\s+above\b", re.I)
RUN_ALONE = {"lora.md", "adapter-files.md", "README.md", "architecture.md", "training.md",
             "dsl.md", "interpreter.md", "browser.md", "lm.md"}
FILES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
         if BLOCK.search(p.read_text())]


def blocks(text: str) -> list[tuple[str, bool]]:
    """Each Python block of ``text`` and whether the paragraph before it says it
    continues the block above."""
    out = []
    for match in BLOCK.finditer(text):
        paragraph = text[:match.start()].rstrip().rpartition("\n\n")[2]
        out.append((match.group(1), bool(CONTINUES.search(paragraph))))
    return out


def test_the_files_with_blocks_are_found():
    names = {p.name for p in FILES}
    assert names >= {"README.md", "dsl.md", "lora.md", "training.md", "interpreter.md",
                     "adapter-files.md"} and names >= RUN_ALONE


def test_continuing_blocks_are_found():
    """The rule's marker is seen where it is written, and only there."""
    text = ("Alone:\n\n```python\nx = 1\n```\n\nThis continues the block\nabove:\n\n"
            "```python\nx += 1\n```\n\nContinues the block above? No: a new paragraph.\n\n"
            "Alone again:\n\n```python\ny = 2\n```\n")
    assert [c for _, c in blocks(text)] == [False, True, False]
    assert [c for _, c in blocks((ROOT / "docs" / "lora.md").read_text())].count(True) >= 3


def run_block(doc: Path, k: int, count: int, block: str, namespace: dict) -> str | None:
    """Run one block; the reason it could not run here (then the caller skips), or None."""
    where = f"{doc.name}, Python block {k + 1} of {count}"
    try:
        exec(compile(block, where, "exec"), namespace)
    except FeatureError as e:  # an f16 block on llvmpipe: the device, not the doc
        return f"{where} needs what the device lacks: {e}"
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        return f"{where} needs torch (the torch extra: pip install -e '.[torch]')"
    except Exception as e:
        if isinstance(e, BrowserError) and "no Chromium found" in str(e):
            return (f"{where} needs Chromium, which this machine lacks"
                    " (scripts/setup.sh installs it)")
        raise AssertionError(f"{where} raised {type(e).__name__}: {e}\n{block}") from e
    return None


def chains(doc: Path) -> list[list[int]]:
    """The blocks of ``doc`` that run together, by index: in a file of RUN_ALONE a
    block and those that continue it, in another file all of its blocks."""
    found = blocks(doc.read_text())
    if doc.name not in RUN_ALONE:
        return [list(range(len(found)))]
    out: list[list[int]] = []
    for k, (_, continues) in enumerate(found):
        if continues and out:
            out[-1].append(k)
        else:
            out.append([k])
    return out


CHAINS = [(doc, chain) for doc in FILES for chain in chains(doc)]
# Chains that run in the slow tier (CI's --full): lm.md's fine-tune compiles a whole
# language model's kernels, twice (the API and the command): 19.5 s on lavapipe cold.
SLOW_CHAINS = {"lm.md:1"}


def _chain_param(doc: Path, chain: list[int]):
    name = f"{doc.name}:{chain[0] + 1}"
    marks = [pytest.mark.slow] if name in SLOW_CHAINS else []
    return pytest.param(doc, chain, id=name, marks=marks)


@pytest.mark.parametrize("doc, chain", [_chain_param(doc, chain) for doc, chain in CHAINS])
def test_every_python_block_runs(doc, chain, tmp_path, monkeypatch):
    """Each chain of blocks (``doc:N`` from block N) in a namespace and folder of its
    own. A block that cannot run here skips the test, saying why: the blocks that
    continue it (in a shared file: every later block) need what it made."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    found = blocks(doc.read_text())
    if doc.name in RUN_ALONE and found[chain[0]][1]:
        raise AssertionError(f"{doc.name}: the first block cannot continue a block above")
    namespace: dict = {"__name__": "__doc_block__"}
    for k in chain:
        reason = run_block(doc, k, len(found), found[k][0], namespace)
        if reason:
            pytest.skip(reason)
