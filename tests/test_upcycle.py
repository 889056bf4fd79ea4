"""`gspo upcycle` on tiny Llamas: copying the MLP into every expert is exactly the dense function (any router), Drop-
Upcycling makes experts differ in the dropped channels only, self-distillation lowers the KL to the dense model, and
the command writes a model that gspo loads and trains with replay."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama
from gspo.models.moe import find_routers
from gspo.commands.upcycle import distill, expert_report, upcycle


def _inputs(n=4, length=12, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, :3] = 0  # left padding in one row
    return ids, mask


def test_copies_compute_the_dense_function_whatever_the_router():
    dense = tiny_llama(vocab_size=512, seed=0)
    moe = upcycle(dense, experts=4, top_k=2, drop=0.0, seed=1, router_std=1.0)  # a router with strong opinions
    ids, mask = _inputs()
    with torch.no_grad():
        a = dense(input_ids=ids, attention_mask=mask).logits
        b = moe(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (a[real] - b[real]).abs().max().item() < 1e-5
    assert type(moe).__name__ == "MixtralForCausalLM" and len(find_routers(moe)) == 2


def test_drop_upcycling_redraws_whole_channels_per_expert():
    """drop 0.5 of 128 channels: in every expert exactly 64 rows of gate and of up and 64 columns of down differ from
    the dense MLP, the same 64 in all three, and experts drop different channels."""
    dense = tiny_llama(vocab_size=512, seed=0)
    moe = upcycle(dense, experts=4, top_k=2, drop=0.5, seed=1)
    mlp, experts = dense.model.layers[0].mlp, moe.model.layers[0].mlp.experts
    inter = mlp.gate_proj.weight.shape[0]
    sets = []
    for e in range(4):
        gate, up = experts.gate_up_proj[e].split(inter, 0)
        changed_gate = (gate != mlp.gate_proj.weight).any(1)
        changed_up = (up != mlp.up_proj.weight).any(1)
        changed_down = (experts.down_proj[e] != mlp.down_proj.weight).any(0)
        assert changed_gate.sum() == 64 and torch.equal(changed_gate, changed_up) and torch.equal(changed_gate, changed_down)
        sets.append(frozenset(changed_gate.nonzero().flatten().tolist()))
    assert len(set(sets)) == 4
    report = expert_report(moe, *_inputs())
    assert report["pairwise_distance"] > 0 and 0 < report["routing_entropy"] <= report["routing_entropy_uniform"]
    assert all(abs(sum(load) - 1) < 1e-6 for load in report["load_per_expert"])


@pytest.mark.slow
def test_self_distillation_lowers_the_kl_to_the_dense_model():
    torch.manual_seed(0)
    dense = tiny_llama(vocab_size=512, seed=0).requires_grad_(False)
    moe = upcycle(dense, experts=4, top_k=2, drop=0.5, seed=1)
    g = torch.Generator().manual_seed(2)

    prompts = [torch.randint(3, 512, (5,), generator=g).tolist() for _ in range(4)]
    ids = torch.randint(3, 512, (4, 6), generator=g)

    def batches():  # the same completions each step: the KL on them must fall
        while True:
            yield prompts, ids, torch.ones(4, 6, dtype=torch.bool)

    losses = distill(moe, dense, batches(), steps=30, lr=3e-3, pad_id=0, log_every=0)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_upcycle_command_writes_a_model_gspo_trains(tmp_path, capsys, tokenizer):
    from gspo.cli import main

    dense_dir = tmp_path / "dense"
    tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.02).save_pretrained(dense_dir)
    tokenizer.save_pretrained(dense_dir)
    out = tmp_path / "moe"
    code = main(["upcycle", f"model.name='{dense_dir}'", "model.device='cpu'", "rollout.max_new_tokens=6",
                 "rewards.workers=0", "--out", str(out), "--experts", "4", "--distill-steps", "3", "--distill-batch", "4",
                 "--eval-n", "4"])
    assert code == 0, capsys.readouterr().err[-2000:]
    report = json.loads((out / "upcycle.json").read_text())
    assert len(report["kl_curve"]) == 3 and report["moe_eval"]["n"] == 4 and report["dense_eval"]["n"] == 4
    code = main(["train", f"model.name='{out}'", "model.device='cpu'", "rollout.prompts_per_batch=2",
                 "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2", "train.minibatches=2",
                 "rewards.workers=0", "log.progress=false", "moe.routing_replay='old'",
                 "rewards.functions=[{path='trainer_rewards:dyadic_length'}]", "--run-dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err[-2000:]


@pytest.mark.parametrize("argv", [["--drop", "1.5"], ["--top-k", "0"], ["--distill-lr", "nan"], ["--experts", "1"],
                                  ["--experts", "0"], ["--experts", "2", "--top-k", "3"]])
def test_bad_upcycle_flags_end_in_one_line(argv, tmp_path, capsys):
    from gspo.cli import main

    assert main(["upcycle", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("gspo: error:") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def _tiny(kind: str):
    from transformers import (GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    torch.manual_seed(0)
    if kind == "qwen3":  # Llama-shaped, but with q/k norms Mixtral lacks
        return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16))
    if kind == "mixtral":  # already an MoE
        return MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4))
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2))


@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "gpt2"])
def test_a_non_llama_source_is_refused_in_one_line(kind):
    """Qwen3 was upcycled without its q/k norms into a model of another function (logits 0.23 off with drop 0, where
    the upcycled model must equal the dense one); a Mixtral and a GPT-2 ended in AttributeError tracebacks."""
    from gspo.errors import UserError

    with pytest.raises(UserError, match=f"model.name is a '{kind}' model: upcycle a Llama-family model"):
        upcycle(_tiny(kind), experts=4, top_k=2, drop=0.0)


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")
            if p.is_file()}


def _argv(dense_dir: Path, out: Path) -> list[str]:
    return ["upcycle", f"model.name='{dense_dir}'", "model.device='cpu'", "rollout.max_new_tokens=6",
            "rewards.workers=0", "--out", str(out), "--experts", "4", "--distill-steps", "1", "--distill-batch", "2",
            "--eval-n", "0"]


@pytest.fixture
def dense_dir(tmp_path, tokenizer):
    d = tmp_path / "dense"
    tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.02).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_upcycle_onto_an_existing_directory_is_refused_and_the_dense_model_kept(dense_dir, tmp_path, capsys):
    """--out pointed at the dense model's own directory used to overwrite it (exit 0: the source model was gone).
    Refused in one line, on the command line and in run_upcycle itself, before any work; the directory is untouched."""
    from gspo.cli import main
    from gspo.commands.upcycle import run_upcycle
    from gspo.config import build_config
    from gspo.errors import UserError

    before = _tree(dense_dir)
    assert main(_argv(dense_dir, dense_dir)) == 2
    err = capsys.readouterr().err.strip()
    assert "exists; name a new directory" in err and len(err.splitlines()) == 1, err
    cfg = build_config({}, [f"model.name='{dense_dir}'", "model.device='cpu'"], device="cpu")
    with pytest.raises(UserError, match="exists; name a new --out directory"):
        run_upcycle(cfg, str(dense_dir), experts=4, top_k=2, drop=0.5, steps=1, lr=1e-4, batch=2, eval_n=0)
    assert _tree(dense_dir) == before and sorted(p.name for p in tmp_path.iterdir()) == ["dense"]


KILL_AFTER_SAVE = """
import os, signal, sys
from transformers import MixtralForCausalLM
from gspo.cli import main

real = MixtralForCausalLM.save_pretrained


def save_then_die(self, *args, **kwargs):  # the MoE's weights are written; the tokenizer and report are not yet
    real(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)


MixtralForCausalLM.save_pretrained = save_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_an_upcycle_killed_midway_leaves_no_model_and_the_same_command_works(dense_dir, tmp_path):
    """SIGKILL right after the MoE's weights are saved: the old code wrote into --out directly and left a directory
    that loads as a model without its tokenizer or report (and a rerun overwrote it). Now OUT does not exist, OUT.tmp
    is marked unfinished, and the same command run again clears it and writes the whole model."""
    from gspo.cli import main
    from gspo.models import load_model

    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    out = tmp_path / "moe"
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_SAVE, *_argv(dense_dir, out)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()
    assert (tmp_path / "moe.tmp" / ".gspo-writing").is_file()
    assert main(_argv(dense_dir, out)) == 0
    assert not (tmp_path / "moe.tmp").exists()
    assert (out / "upcycle.json").is_file() and type(load_model(str(out))[0]).__name__ == "MixtralForCausalLM"
