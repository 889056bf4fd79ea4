"""gspo export: a checkpoint as a standard HF model directory (transformers loads it without gspo), LoRA adapters
as peft adapters or merged, one line for every bad input, and a directory that appears whole or not at all (killed at
any file operation, two exports at once, a full disk)."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from gspo.cli import main
from gspo.train import Trainer

from test_faults import _tmpfs
from test_moe import moe_dir  # noqa: F401  (a tiny Mixtral, module fixture)
from test_trainer import tiny_config, tiny_dir  # noqa: F401  (the module fixture)

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("export") / "run"
    trainer = Trainer(tiny_config(tiny_dir), run)
    trainer.train()
    return run, {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}


def test_a_run_exports_as_a_model_transformers_loads(trained, tmp_path):
    run, weights = trained
    assert main(["export", str(run), "--out", str(tmp_path / "bf16")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name].to(torch.bfloat16)), name
    tok = AutoTokenizer.from_pretrained(tmp_path / "bf16")
    assert tok.chat_template and "<|im_end|>" in tok.chat_template
    eos = GenerationConfig.from_pretrained(tmp_path / "bf16").eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    assert main(["export", str(run / "checkpoints" / "step-000002"), "--out", str(tmp_path / "fp32"),
                 "--dtype", "fp32"]) == 0
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert all(torch.equal(p, weights[n]) for n, p in exact.named_parameters())
    assert not (tmp_path / "fp32.tmp").exists()


@pytest.fixture(scope="module")
def lora_trained(tiny_dir, tmp_path_factory):  # noqa: F811
    pytest.importorskip("peft")
    run = tmp_path_factory.mktemp("export-lora") / "run"
    trainer = Trainer(tiny_config(tiny_dir, "lora.rank=4", "train.lr=1e-2"), run)
    trainer.train()
    with torch.no_grad():
        return run, trainer.actor.model(torch.tensor([[1, 5, 9, 13, 2, 7]])).logits


def test_a_lora_checkpoint_exports_as_its_adapter_or_merged(lora_trained, tiny_dir, tmp_path):  # noqa: F811
    peft = pytest.importorskip("peft")
    run, expected = lora_trained
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    assert main(["export", str(run), "--out", str(tmp_path / "adapter"), "--dtype", "fp32"]) == 0
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), tmp_path / "adapter")
    assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--dtype", "fp32", "--merge-lora"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_a_damaged_checkpoint_is_not_exported(trained, tmp_path, capsys, caplog):
    """A checkpoint whose files are not what its manifest recorded (one byte of the weights changed on disk) is refused
    in one line when named; from the run directory the newest checkpoint that is intact is exported, with a warning
    naming the one skipped; with none intact, one line (it used to export the damaged weights)."""
    import shutil

    from gspo.checkpoint import complete_checkpoints

    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    newest = complete_checkpoints(run / "checkpoints")[-1]
    weights = next(p for p in sorted(newest.rglob("*.safetensors")))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["export", str(newest), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("gspo: error:") == 1 and "damaged" in err and not (tmp_path / "a").exists()
    shutil.copytree(trained[0] / "checkpoints" / newest.name, run / "checkpoints" / "step-000001")  # an intact one
    assert main(["export", str(run), "--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "config.json").is_file()
    assert "skipping checkpoint" in caplog.text and newest.name in caplog.text
    shutil.rmtree(run / "checkpoints" / "step-000001")
    assert main(["export", str(run), "--out", str(tmp_path / "c")]) == 2
    assert "no earlier complete checkpoint" in capsys.readouterr().err


def test_bad_export_inputs_are_one_line(trained, moe_dir, tmp_path, capsys):  # noqa: F811
    run, _ = trained
    (tmp_path / "taken").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.tmp").mkdir()  # a directory of the user's that the export's temporary name would take
    (tmp_path / "w.tmp" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("")
    torn = tmp_path / "torn" / "checkpoints" / "step-000002"  # complete by its marker, its weights cut short
    shutil.copytree(run / "checkpoints" / "step-000002", torn)
    os.truncate(torn / "model.safetensors", 1000)
    old = tmp_path / "old" / "checkpoints" / "step-000002"  # the same, written before checkpoints had a manifest
    shutil.copytree(torn, old)
    (old / "manifest.json").unlink()
    mixtral = tmp_path / "mixtral"  # a checkpoint of a family the GGUF writer has no names for
    shutil.copytree(moe_dir, mixtral)
    (mixtral / "COMPLETE").write_text("ok\n")
    cases = [
        (["export", str(run), "--out", str(tmp_path / "taken")], "exists; name a new directory"),
        (["export", str(run), "--out", str(tmp_path / "file")], "exists; name a new directory"),
        (["export", str(run), "--out", str(tmp_path / "file" / "o")], "which is a file"),
        (["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "is not a directory"),
        (["export", str(tmp_path / "empty"), "--out", str(tmp_path / "y")], "neither a complete checkpoint"),
        (["export", str(run), "--out", str(tmp_path / "y"), "--dtype", "int8"], "invalid choice"),
        (["export", str(run), "--out", str(tmp_path / "w")], "w.tmp' exists and was not made by gspo"),
        (["export", str(run), "--out", str(tmp_path / "y"), "--merge-lora"], "nothing to merge; drop --merge-lora"),
        (["export", str(tmp_path / "torn"), "--out", str(tmp_path / "y")], "is damaged: model.safetensors has 1000"),
        (["export", str(tmp_path / "old"), "--out", str(tmp_path / "y")], "Could not load the model from"),
        (["export", str(mixtral), "--out", str(tmp_path / "y"), "--gguf"], "GGUF export writes Llama-family models"),
    ]
    for argv, match in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert match in err and len(err.splitlines()) == 1 and err.startswith("gspo"), err
    assert not (tmp_path / "y").exists() and not (tmp_path / "y.tmp").exists()
    assert (tmp_path / "w.tmp" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing weights", "missing config", "garbage config"])
def test_a_damaged_adapter_is_one_line_at_export_merge_and_eval(lora_trained, tiny_dir, tmp_path, capsys, damage):  # noqa: F811
    """A LoRA checkpoint whose adapter file is cut short, overwritten or gone: export (as the adapter or merged) and
    eval name the file in one line and write nothing (the adapter export copied a torn file and exited 0; merge and
    eval ended in safetensors' SafetensorError, huggingface_hub's HFValidationError or a JSONDecodeError)."""
    run = tmp_path / "run"
    shutil.copytree(lora_trained[0], run)
    ckpt = run / "checkpoints" / "step-000002"
    weights, config = ckpt / "adapter_model.safetensors", ckpt / "adapter_config.json"
    if damage == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "garbage":
        weights.write_bytes(os.urandom(4096))
    elif damage == "missing weights":
        weights.unlink()
    elif damage == "missing config":
        config.unlink()
    else:
        config.write_text('{"base_model_name_or_path": ')
    name = (config if "config" in damage else weights).name
    for argv in (["export", str(run), "--out", str(tmp_path / "adapter")],
                 ["export", str(run), "--out", str(tmp_path / "merged"), "--merge-lora"],
                 ["eval", f"model.name='{tiny_dir}'", "model.device='cpu'", "rewards.workers=0", "--model", str(ckpt),
                  "--n", "2", "--samples", "0"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert f"is damaged: {name}" in err and len(err.splitlines()) == 1 and err.startswith("gspo: error:"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


KILL_IN_EXPORT = """
import os, signal, sys
import torch
from gspo.cli import main

torch.set_num_threads(1)  # this process forks one child per kill point
run, out = sys.argv[1], sys.argv[2]
assert main(["export", run, "--out", out + "/warm", "--dtype", "fp32"]) == 0  # the children fork with all imported
seen = [0]


def counted(real, kill_at, first_only=False):
    def call(*args, **kwargs):
        if not (first_only and call.done):  # the fsyncs after the first are all alike: one kill point for them
            seen[0] += 1
            call.done = True
            if seen[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    call.done = False
    return call


for kill_at in range(1, 100):
    pid = os.fork()
    if pid == 0:  # from here on the first fsync (every file written, none on disk yet), every rename and every unlink
        # may be the last
        os.fsync = counted(os.fsync, kill_at, first_only=True)
        os.rename, os.unlink = counted(os.rename, kill_at), counted(os.unlink, kill_at)
        os._exit(main(["export", run, "--out", f"{out}/kill-{kill_at}", "--dtype", "fp32"]))
    status = os.waitpid(pid, 0)[1]
    if os.WIFEXITED(status):
        assert os.WEXITSTATUS(status) == 0
        print(kill_at)
        break
    assert os.WTERMSIG(status) == signal.SIGKILL
"""


def test_an_export_killed_at_its_file_operations_leaves_no_model_and_runs_again(trained, tmp_path):
    """An export SIGKILLed at its first fsync (every file written, none synced), its rename and the unlink after it in
    turn: OUT is absent (OUT.tmp is left, marked unfinished) or whole; the same command run again clears the leftover and writes the model (the old code
    left OUT.tmp behind and refused every later run with it: `'OUT.tmp' exists`)."""
    run, weights = trained
    done = subprocess.run([sys.executable, "-c", KILL_IN_EXPORT, str(run), str(tmp_path)], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    operations = int(done.stdout.split()[-1]) - 1
    for kill_at in range(1, operations + 1):
        out = tmp_path / f"kill-{kill_at}"
        tmp = out.with_name(out.name + ".tmp")
        assert not tmp.exists() or (tmp / ".gspo-writing").is_file(), kill_at  # marked unfinished
        if not out.exists():
            assert main(["export", str(run), "--out", str(out), "--dtype", "fp32"]) == 0, kill_at
        assert not tmp.exists(), kill_at
        model = AutoModelForCausalLM.from_pretrained(out)
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()), kill_at
    assert operations >= 3, "an export takes an fsync, a rename and an unlink"


PAUSED = """
import os, signal, sys
from gspo.cli import main

where, paused = os.environ["GSPO_TEST_PAUSE"], [False]


def pausing(real, name):
    def call(path, *args, **kwargs):
        if name == where and not paused[0] and (name != "mkdir" or str(path).endswith(".tmp")):
            paused[0] = True
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(path, *args, **kwargs)
    return call


os.mkdir, os.fsync = pausing(os.mkdir, "mkdir"), pausing(os.fsync, "fsync")
sys.exit(main(sys.argv[1:]))
"""


def test_two_exports_to_one_directory_at_once(trained, tmp_path):
    """Two real processes export to one --out. The second is stopped after it found OUT absent, right before it makes
    OUT.tmp; the first then writes OUT.tmp up to its first fsync and is stopped there; the second goes on. It ends in
    one line saying another process writes OUT.tmp, and leaves that alone; the first then finishes a whole model (the
    old code's second process deleted the first's OUT.tmp on its way out, and the first crashed)."""
    run, weights = trained
    argv = [sys.executable, "-c", PAUSED, "export", str(run), "--out", str(tmp_path / "out"), "--dtype", "fp32"]

    def stopped_at(where: str) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env={**ENV, "GSPO_TEST_PAUSE": where}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), proc.stderr.read()[-2000:]
        return proc

    second = stopped_at("mkdir")
    first = stopped_at("fsync")
    written = sorted(p.name for p in (tmp_path / "out.tmp").iterdir())
    os.kill(second.pid, signal.SIGCONT)
    _, err = second.communicate(timeout=300)
    assert second.returncode == 2 and "being written by another gspo process" in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("gspo: error:")
    assert sorted(p.name for p in (tmp_path / "out.tmp").iterdir()) == written
    os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert not (tmp_path / "out.tmp").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs: smaller than the tiny model's weights."""
    yield from _tmpfs(tmp_path / "disk", "1m")


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(trained, tiny_disk, capsys):
    """safetensors reports the full disk as its own SafetensorError (not an OSError): it used to end in a traceback."""
    run, _ = trained
    assert main(["export", str(run), "--out", str(tiny_disk / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "No space left on device" in err and len(err.splitlines()) == 1 and err.startswith("gspo: error:"), err
    assert list(tiny_disk.iterdir()) == []


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.15)])
def test_gguf_export_reads_back_through_transformers(trained, tmp_path, dtype, atol):
    """--gguf writes model.gguf beside the HF files; transformers' GGUF reader (which undoes llama.cpp's Q/K row order)
    gives back the same logits, and its tokenizer encodes as the original does."""
    run, weights = trained
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--dtype", dtype, "--gguf"]) == 0
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 300, 4000]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, plain(ids).logits, rtol=0, atol=atol)
    if dtype != "fp32":
        return  # the tokenizer is the same in both files; reading it back costs ~10 s (a 49k-entry GGUF vocabulary)
    text = "What is 7 + 5? Answer: 12 ... café"
    tok = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    assert tok(text)["input_ids"] == AutoTokenizer.from_pretrained(out)(text)["input_ids"]


def test_gguf_of_an_unmerged_adapter_is_refused(lora_trained, tmp_path):
    from gspo.errors import UserError
    from gspo.commands.export import export

    with pytest.raises(UserError, match="add --merge-lora"):
        export(lora_trained[0], tmp_path / "out", gguf=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
