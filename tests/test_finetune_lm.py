"""``python -m lora finetune-lm`` (lora.apps.finetune_lm) on a tiny random Llama
(tests/lm_cases.py: hidden 64, 2 layers, 4 heads, 2 kv heads; vocab 320) written by
transformers' save_pretrained, with a byte-level BPE tokenizer of 320 ids trained by
the ``tokenizers`` package on real text that ships on the machine: the GNU GPL 3 of
Debian's common-licenses (35 kB), else the LICENSE.txt of Python's own prefix; no
download. The command runs once per module (12 steps of 4 x 32 tokens, no samples) and
the tests read what it printed and wrote; the trained adapter is checked against
transformers + peft in float64. The samples' test runs it again, 2 steps with samples
(the compiled kernels of training are the module run's)."""
import contextlib
import io
import json
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from lm_cases import LIBRARIES, float64_logits, tiny_model

from lora.apps import cli, finetune_lm

pytestmark = pytest.mark.skipif(
    not all(map(find_spec, (*LIBRARIES, "tokenizers"))),
    reason="the tiny model is written by transformers, its adapter read by peft and its "
           "tokenizer trained by tokenizers (the torch extra)")

TEXTS = (Path("/usr/share/common-licenses/GPL-3"),
         Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" /
         "LICENSE.txt")
VOCAB = 320          # the tokenizer's ids and the model's: >= 256, so bytes fit too
ARGS = ["--seq", "32", "--batch", "4", "--lr", "1e-2", "--quick", "--steps", "12",
        "--max-new-tokens", "0"]  # the module's run samples nothing: 8 s cold, 13 s with samples
SAMPLE = ["--max-new-tokens", "8"]
F32_TOL = 1e-4       # the bound for f32 logits against float64 (measured: below 1e-6)


@pytest.fixture(scope="module")
def text_file() -> Path:
    for path in TEXTS:
        if path.is_file():
            return path
    pytest.skip(f"no text to train on: neither {TEXTS[0]} nor {TEXTS[1]} is on this machine")


def train_tokenizer(text: str):
    """A byte-level BPE tokenizer of VOCAB ids trained on ``text`` (round-trips any text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tokenizer


def write_model(folder: Path, vocab: int = VOCAB) -> Path:
    tiny_model("llama", vocab_size=vocab).save_pretrained(folder)
    return folder


def run_command(argv) -> tuple[object, str, str]:
    """python -m lora finetune-lm ``argv`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(["finetune-lm", *map(str, argv)])
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, text_file):
    """A model folder with the tiny tokenizer's tokenizer.json."""
    folder = write_model(tmp_path_factory.mktemp("finetune") / "model")
    train_tokenizer(text_file.read_text()).save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def tokenized(folder, text_file):
    """The command's run on ``folder``: (out folder, stdout, the trained CausalLM,
    the summary, the text's ids as the tokenizer gives them)."""
    from tokenizers import Tokenizer

    out, stdout = folder.parent / "out", io.StringIO()
    with contextlib.redirect_stdout(stdout):
        lm, summary = finetune_lm.run(list(map(str, ["--model", folder, "--text", text_file,
                                                     "--out", out, *ARGS])))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(text_file.read_text(), add_special_tokens=False).ids
    return out, stdout.getvalue(), lm, summary, np.array(ids)


def held_out(ids: np.ndarray, fraction: float = 0.1) -> np.ndarray:
    """The ids the command holds out (its default --held-out), written again here."""
    return ids[len(ids) - int(round(len(ids) * fraction)):]


def peft_model(folder: Path, adapter: Path):
    """transformers' model of ``folder`` with peft's reading of ``adapter``."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    return PeftModel.from_pretrained(base, adapter).eval()


def test_the_held_out_loss_is_transformers_shifted_cross_entropy():
    """shifted_cross_entropy of a float64 model's logits, over the tokens it
    counts, is torch's cross-entropy of position t against id t + 1 in float64,
    and the model's outputs.loss (labels = the ids), which transformers
    computes in float32."""
    import torch

    ids = np.random.default_rng(3).integers(3, 128, size=(3, 10))
    with torch.no_grad():
        out = tiny_model("llama").double()(input_ids=torch.tensor(ids),
                                           labels=torch.tensor(ids))
        want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 128),
                                                 torch.tensor(ids[:, 1:]).reshape(-1)).item()
    total, count = finetune_lm.shifted_cross_entropy(out.logits.numpy(), ids)
    assert count == 3 * 9 and abs(total / count - want) < 1e-12 * want
    assert abs(total / count - out.loss.item()) < 1e-6 * want


def test_held_out_batches_keep_one_shape():
    """A last batch short of --batch is filled with copies whose losses are
    left out: every logits call sees `batch` rows, and the mean is over the
    sequences given, each once."""
    class Logits:
        shapes: list = []

        def logits(self, ids):
            self.shapes.append(ids.shape)
            return np.sin(ids[..., None] * np.arange(1.0, 9.0))   # any function of the ids

    rows = np.random.default_rng(4).integers(0, 8, size=(5, 6))
    model = Logits()
    got = finetune_lm.held_out_loss(model, rows, batch=2)
    total, count = finetune_lm.shifted_cross_entropy(model.logits(rows), rows)
    assert model.shapes[:3] == [(2, 6)] * 3 and got == pytest.approx(total / count, rel=1e-12)


def test_batches_pass_over_every_sequence_in_fresh_orders():
    from lora.apps.lm_text import batches, pack

    drawn = np.concatenate(list(batches(7, 3, 7, seed=1)))   # 21 rows: 3 passes over 7
    assert all(sorted(drawn[k:k + 7]) == list(range(7)) for k in (0, 7, 14))
    assert not np.array_equal(drawn[:7], drawn[7:14])
    assert [len(b) for b in batches(2, 5, 3, seed=0)] == [5, 5, 5]   # fewer sequences than rows
    packed = pack(np.arange(100), seq=8, held_out=0.2)
    assert packed.train.shape == (10, 8) and packed.held_out.shape == (2, 8)
    assert packed.held_out[0, 0] == 80 and packed.train_tokens == 80


@pytest.fixture
def small_vocab(tmp_path) -> Path:
    """A model folder of 128 ids and no tokenizer.json: too few ids for bytes."""
    return write_model(tmp_path / "small", vocab=128)


@pytest.fixture
def no_weights(tmp_path, folder) -> Path:
    """A folder with the config and tokenizer but no weights."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(folder / name, bare / name)
    return bare


@pytest.fixture
def other_tokenizer(tmp_path, folder) -> Path:
    """A model folder of 300 ids with the 320-id tokenizer: not its own."""
    other = write_model(tmp_path / "other", vocab=300)
    shutil.copy(folder / "tokenizer.json", other / "tokenizer.json")
    return other


@pytest.mark.parametrize("model, argv, message", [
    ("small_vocab", [], "has no tokenizer.json, so the text would be read as bytes (ids 0-255), "
                        "but the model's vocab_size is 128, fewer than 256 ids; put the model's "
                        "tokenizer.json in the folder"),
    ("folder", ["--text", "/nonexistent/notes.txt"], "--text /nonexistent/notes.txt: no such file"),
    ("no_weights", [], "no model.safetensors or model.safetensors.index.json"),
    ("other_tokenizer", [], "but the model's vocab_size is 300: it is not this model's "
                            "tokenizer"),
    ("folder", ["--seq", "1"], "--seq must be >= 2, got 1"),
    ("folder", ["--seq", "4096"], "--seq 4096 is past the model's max_position_embeddings 256"),
    ("folder", ["--held-out", "1"], "--held-out must be a fraction in (0, 1), got 1"),
    ("folder", ["--lora-dropout", "1"], "--lora-dropout must be in [0, 1) (a probability), got 1"),
    ("folder", ["--steps", "5", "--epochs", "1"], "argument --epochs: not allowed with argument "
                                                  "--steps"),
    ("folder", ["--steps", "10", "--warmup", "10"], "schedule 'cosine' needs total > warmup, got "
                                                    "total=10, warmup=10"),
    ("folder", ["--target-modules", "q_prj"], "target_modules ['q_prj'] matches no module"),
    ("folder", ["--target-modules", "lm_head"], "LoRA on lm_head is not supported"),
    ("folder", ["--prompt", ""], "--prompt '' gives no tokens"),
    ("folder", ["--seed", "-1"], "--seed must be in [0, 2^32), got -1"),
    ("folder", ["--max-new-tokens", "250"], "the prompt's 16 tokens and --max-new-tokens 250 pass "
                                            "the model's max_position_embeddings 256"),
])
def test_bad_input_is_refused_by_name(model, argv, message, request, text_file, tmp_path):
    """Each refusal exits with status 2 and argparse's message on stderr naming
    what is wrong, before anything is written (and, but for lm_head, which the
    model refuses as it is made, before the GPU starts)."""
    folder = request.getfixturevalue(model)
    base = ["--model", folder, "--text", text_file, "--out", tmp_path / "out", "--seq", "32"]
    status, stdout, err = run_command([*base, *argv])
    assert status == 2 and message in err, err
    assert "error:" in err and "Traceback" not in err
    assert ("starting the GPU" in stdout) == ("lm_head" in argv)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content, message", [
    (b"\xffGPL", "not UTF-8 text (invalid start byte at byte 0); {folder}/tokenizer.json "
                 "tokenizes UTF-8 text"),
    (b"a short text", "held out; --seq 32 needs at least 32 in each: give a longer text, a "
                      "smaller --seq or another --held-out"),
])
def test_texts_that_cannot_be_trained_on_are_refused(folder, content, message, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(content)
    status, stdout, err = run_command(["--model", folder, "--text", text, "--seq", "32",
                                       "--out", tmp_path / "out"])
    assert status == 2 and message.format(folder=folder) in err, err
    assert "starting the GPU" not in stdout and not (tmp_path / "out").exists()


# The tests of the module's run come after the cheap ones, which set up the folder
# (tokenizer, model) and, with the next, the device and the evaluation's kernels: the
# run, the setup of the first test that reads it, stays under the 10 s budget cold.
def test_the_held_out_loss_on_the_gpu_is_transformers_float64_loss(folder, device):
    """held_out_loss of a fresh lora.CausalLM of the folder (B = 0: the base model)
    over 5 sequences of 32 in batches of 4, the last filled, is transformers'
    float64 loss of them within 1e-5. (It also compiles the kernels of the module
    run's evaluation, which then stays under the 10 s budget cold.)"""
    import torch
    import transformers

    import lora

    ids = np.random.default_rng(5).integers(0, VOCAB, size=(5, 32))
    lm = lora.CausalLM.from_pretrained(folder, target_modules=["q_proj", "v_proj"], rank=8,
                                       alpha=16, device=device)
    got = finetune_lm.held_out_loss(lm, ids, 4)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).double().eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids), labels=torch.tensor(ids)).loss.item()
    assert abs(got - want) < 1e-5 * want


def test_the_loss_falls_and_the_files_are_written(folder, tokenized):
    """12 steps lower the held-out loss and the batches' loss; the adapter, the
    PNG and the summary are where the command says, the adapter naming the folder."""
    out, stdout, _, summary, ids = tokenized
    assert summary["held_out_loss_after"] < summary["held_out_loss_before"] - 0.02
    assert np.mean(summary["loss"][-5:]) < summary["loss"][0] - 0.02
    assert len(summary["loss"]) == summary["steps"] == 12
    assert min(summary["memory"][part] for part in ("weights", "adapters", "training step")) > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder.resolve())
    assert (config["task_type"], config["r"], config["lora_alpha"]) == ("CAUSAL_LM", 8, 16)
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    train_rows = (len(ids) - len(held_out(ids))) // 32
    for said in (f": {len(ids)} tokens;", f"make {train_rows} sequences of 32",
                 "12 steps of 4 x 32 tokens", f"wrote the adapter {out / 'adapter'}",
                 f"{out / 'loss.png'} and {out / 'summary.json'}", "step 12/12  loss",
                 "GPU memory: weights "):
        assert said in stdout, said


def test_the_adapter_loads_in_peft_to_the_trained_models_logits(folder, tokenized):
    """The saved adapter, read by PeftModel.from_pretrained into transformers'
    model of the folder, gives the trained CausalLM's logits on held-out text
    (float64 on the CPU against f32 on the GPU)."""
    out, _, lm, _, ids = tokenized
    pm = peft_model(folder, out / "adapter")
    rows = held_out(ids)[:64].reshape(2, 32)
    want, got = float64_logits(pm, rows), lm.logits(rows)
    assert np.abs(got - want).max() < F32_TOL * np.abs(want).max()
    assert all(np.abs(b).max() > 0 for _, b in lm.adapters().values())  # trained: B left 0


def test_samples_before_and_after_are_printed(folder, tokenized, text_file, tmp_path):
    """The prompt is the held-out text's first 16 tokens; the samples printed
    before and after training are its greedy continuations, the one after
    training the same as transformers + peft's greedy generate decodes."""
    import torch
    from tokenizers import Tokenizer

    ids, out = tokenized[-1], tmp_path / "out"
    status, stdout, err = run_command(["--model", folder, "--text", text_file, "--out", out,
                                       "--no-plot", *ARGS, "--steps", "2", *SAMPLE])
    assert status == 0, err
    summary = json.loads((out / "summary.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = held_out(ids)[:16]
    assert summary["prompt"] == tok.decode(prompt.tolist())
    for when in ("prompt", "before", "after"):
        key = "prompt" if when == "prompt" else f"sample_{when}"
        assert isinstance(summary[key], str) and summary[key]
        assert f"  {when}: {summary[key]!r}" in stdout
    pm = peft_model(folder, out / "adapter").double()
    with torch.no_grad():
        new = pm.generate(input_ids=torch.tensor(prompt[None]), max_new_tokens=8,
                          do_sample=False)[0, len(prompt):]
    assert summary["sample_after"] == tok.decode(new.tolist())


def test_a_folder_without_tokenizer_json_reads_bytes(folder, text_file, tmp_path):
    """Without tokenizer.json the text is its bytes (ids 0-255, the model has 320):
    one token a byte, the prompt the held-out bytes, samples decoded as UTF-8."""
    plain = tmp_path / "model"
    shutil.copytree(folder, plain, ignore=shutil.ignore_patterns("tokenizer.json"))
    out = tmp_path / "out"
    status, stdout, err = run_command(["--model", plain, "--text", text_file, "--out", out,
                                       "--no-plot", *ARGS, "--steps", "5", *SAMPLE])
    assert status == 0, err
    raw = text_file.read_bytes()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokenizer"] == "bytes" and summary["tokens"] == len(raw)
    assert f"tokenized as bytes (the folder has no tokenizer.json): {len(raw)} tokens;" in stdout
    start = len(raw) - int(round(len(raw) * 0.1))
    assert summary["prompt"] == raw[start:start + 16].decode("utf-8", errors="replace")
    assert f"  after: {summary['sample_after']!r}" in stdout
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert not (out / "loss.png").exists()


@pytest.mark.slow  # 20 steps over every Linear, in f16, with dropout (40: 52 s in CI's pass)
def test_a_longer_f16_run_with_dropout_on_every_linear(device, folder, text_file, tmp_path):
    """--dtype f16 --lora-dropout 0.1 --target-modules all-linear, 20 steps: the
    held-out loss falls, and the adapter read by peft gives the trained model's
    logits within f16's tolerance (tests/test_lm.py: 5e-3 of the largest logit,
    each stored f16 activation rounded by up to 2^-11 of itself)."""
    if not device.has_feature("shader-f16"):
        pytest.skip(f"{device.name} lacks shader-f16")
    out, stdout = tmp_path / "out", io.StringIO()
    with contextlib.redirect_stdout(stdout):
        lm, summary = finetune_lm.run(list(map(str, [
            "--model", folder, "--text", text_file, "--out", out, "--seq", "32", "--batch", "4",
            "--lr", "1e-2", "--steps", "20", "--dtype", "f16", "--lora-dropout", "0.1",
            "--target-modules", "all-linear", "--eval-batches", "2", "--max-new-tokens", "8"])))
    assert (summary["dtype"], summary["lora_dropout"], len(summary["target_modules"])) == \
        ("f16", 0.1, 14)
    assert summary["held_out_loss_after"] < summary["held_out_loss_before"] - 0.05
    assert "on 14 modules (down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)" in \
        stdout.getvalue()
    rows = np.arange(64).reshape(2, 32) % 300 + 3
    want = float64_logits(peft_model(folder, out / "adapter"), rows)
    assert np.abs(lm.logits(rows) - want).max() < 5e-3 * np.abs(want).max()
