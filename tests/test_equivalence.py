"""The refactor guard: fixed-seed CPU runs of a tiny model give the metrics recorded from an earlier version of the code.

Each run below was recorded into ``tests/fixtures/equivalence/<name>.jsonl`` (its metrics.jsonl, then its samples.jsonl
lines) by ``python tests/test_equivalence.py --record`` (``--record NAME ...``: only those runs). A refactor must
reproduce every key of every line: integers, strings (sampled texts) and token counts exactly, floats to 1e-5 relative
or 1e-6 absolute, and the sequences' log-ratio sums (``ratio/seq_product_log_*``) to 1e-5 absolute (``time/*``,
``throughput/*``, ``dist/compute_*`` and the asynchronous runs' waits ``async/*_wait_s`` excepted: they measure the
machine). Not tighter: another CPU (AMD's AVX2
kernels instead of Intel's AVX-512, another transformers release) sums float32 in another order, which moved those
sums by up to 7e-6, other keys by up to 5e-6 relative, and near-zero on-policy spreads (~1e-7) by more than their
size, with every sampled token the same. A refactor that deals rows, denominators or old log-probs differently moves
these keys by far more. Re-record only for a change that is
meant to move the numbers, and say which in the commit message.

The runs cover the update's branches: recomputed and engine old log-probs, a reference model (beta > 0), micro-batches,
packed sequences, both engines, dynamic sampling with refill and padding, overlong filtering and punishment,
checkpoints, and the ways the policy is held: replicated over two real torchrun processes on gloo (DDP, each process
sampling its own share) and LoRA adapters. The seven recorded before the feed / collect / workers redesign (issue 50,
at 3bad152) cover how batches reach the update and what came after the first five: η = 1 in the engine thread, η = 2
in turn with the update (checkpoints saving its queue), 1 trainer + 1 decode process over gloo (real torchrun
processes), an environment with a tool in worker processes (several turns a row, on a model whose turns end), PPO's
critic, ``rollout.exact`` under Triton's interpreter, and a mismatch correction (TIS) against 4-bit engine weights.
Rewards are multiples of 1/128 so that group statistics are exact at any float width.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "equivalence"

COMMON = ["rollout.prompts_per_batch=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "train.lr=1e-3",
          "rewards.workers=0", "log.progress=false", "log.trace_every=1", "model.device='cpu'", "seed=3"]
RUNS = {
    "gspo_ref_kl": ["algorithm='gspo'", "train.steps=8", "train.minibatches=4", "loss.beta=0.05",
                    "log.checkpoint_every=1", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "grpo_engine_logprobs_packed": ["algorithm='grpo'", "loss.eps_low=0.2", "loss.eps_high=0.2", "train.steps=6",
                                    "train.minibatches=2", "train.micro_batch_size=2", "train.old_logprobs='rollout'",
                                    "train.packing='on'", "rollout.engine='graph'",
                                    "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "dapo_dynamic_sampling": ["algorithm='dapo'", "train.steps=4", "train.minibatches=2", "dapo.max_resample_rounds=1",
                              "dapo.overlong_cache=4", "loss.mask_truncated=false",
                              "rewards.functions=[{path='trainer_rewards:even_a_dyadic'}]"],
    "gspo_ddp_two_processes": ["algorithm='gspo'", "train.steps=4", "train.minibatches=2", "dist.strategy='ddp'",
                               "log.checkpoint_every=1", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "gspo_lora": ["algorithm='gspo'", "train.steps=4", "train.minibatches=2", "lora.rank=4", "lora.alpha=8",
                  "train.lr=1e-2", "log.checkpoint_every=1",
                  "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    # recorded at 3bad152, before the feed / collect / workers redesign (issue 50)
    "gspo_async_thread_eta1": ["algorithm='gspo'", "train.steps=8", "train.minibatches=2", "rollout.max_staleness=1",
                               "rollout.overlap='thread'", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "grpo_async_in_turn_eta2": ["algorithm='grpo'", "loss.eps_low=0.2", "loss.eps_high=0.2", "train.steps=10",
                                "train.minibatches=2", "rollout.max_staleness=2", "rollout.overlap='off'",
                                "log.checkpoint_every=1", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "gspo_decode_process": ["algorithm='gspo'", "train.steps=6", "train.minibatches=2", "rollout.max_staleness=1",
                            "rollout.decode_processes=1", "log.checkpoint_every=1",
                            "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "gspo_env_tools": ["algorithm='gspo'", "train.steps=4", "train.minibatches=2", "env.path='env_fixtures:Echo'",
                       "env.tools=['gspo.envs.builtin:calculator']", "env.workers=1", "env.max_turn_tokens=3",
                       "rollout.max_new_tokens=24", "rollout.engine='hf'", "rewards.functions=[]"],
    "ppo_critic": ["algorithm='ppo'", "train.steps=4", "train.minibatches=2", "ppo.critic_lr=1e-2",
                   "log.checkpoint_every=1", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    # 16 rows: places 6-15 of a 16-row block too, where the interpreter's dot once summed in another order (236d7c1);
    # re-recorded then, one rollout batch (the interpreter is slow), engine_diff_max 0.0 on every line
    "gspo_exact_interpreter": ["algorithm='gspo'", "train.steps=2", "train.minibatches=2", "rollout.exact=true",
                               "train.old_logprobs='rollout'", "rollout.max_new_tokens=4",
                               "model.precision='bf16-autocast'",
                               "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
    "grpo_tis_correction": ["algorithm='grpo'", "train.steps=4", "train.minibatches=2", "rollout.engine='hf'",
                            "loss.mismatch_correction='tis'", "loss.mismatch_bounds=[0.0, 1.05]",
                            "rollout.engine_weight_bits=4", "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"],
}
PROCESSES = {"gspo_ddp_two_processes": 2, "gspo_decode_process": 2}  # runs launched as `gspo train --nproc N` (torchrun), the rest in-process
NEEDS = {"gspo_lora": "peft"}
ENDS_TURNS = {"gspo_env_tools"}  # on the tiny model whose turns end (:func:`build_turn_model`): several turns a row
# seconds: they measure the machine
SKIP_PREFIXES = ("time/", "throughput/", "dist/compute_", "async/actor_wait_s", "async/engine_wait_s")
ZEROS = ("logprob/engine_diff_",)  # the engine-trainer gap, compared exactly in the runs of EXACT (rollout.exact)
EXACT = {"gspo_exact_interpreter"}
SUMS = ("ratio/seq_product_log_",)  # float32 sums of a sequence's token log-ratios: rounding adds up over its tokens


def build_tiny_model(folder: Path) -> Path:
    """The tiny random Llama of the runs (seed 0, init std 0.02) with the real SmolLM2 tokenizer."""
    from conftest import ASSETS, tiny_llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS)
    tiny_llama(vocab_size=len(tok), seed=0, init_std=0.02).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_turn_model(folder: Path) -> Path:
    """The tiny model with its own LM head, whose end-of-turn token gets about a third of every position's
    probability (hidden dimension 0 carries a constant the head reads for that token alone): random turns that end
    within a few tokens, so an environment's trajectories have several turns."""
    import torch
    from conftest import ASSETS, tiny_llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS)
    model = tiny_llama(vocab_size=len(tok), seed=0, init_std=0.02)
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(64, len(tok), bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        model.model.embed_tokens.weight[:, 0] += 1.0  # after the final norm: ~7.6 at every position
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>"), 0] = 10.0 / 7.58  # a logit of ~+10
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_lines(name: str, model_dir: Path, run_dir: Path) -> list[dict]:
    """Train run ``name`` through the command line; its metrics lines, then its samples lines (tagged)."""
    import os
    import subprocess

    args = ["train", "--run-dir", str(run_dir), f"model.name='{model_dir}'", *COMMON, *RUNS[name]]
    if name in PROCESSES:  # `gspo train --nproc N` starts torchrun: real processes, which import the test rewards too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
               "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "gspo.cli", *args, "--nproc", str(PROCESSES[name]),
                               "dist.timeout_s=120"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        from gspo.cli import main

        assert main(args) == 0
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [{"sample": True, **json.loads(ln)} for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    return metrics + samples


def _same(a, b, key: str, exact: bool = False) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        if exact and key.startswith(ZEROS):  # an exact engine stays exact: no tolerance for its 0.0
            return b == 0.0
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5 if key.startswith(SUMS) else 1e-6)
    return a == b


def differences(expected: list[dict], got: list[dict], exact: bool = False) -> list[str]:
    """Every key that moved, as 'line i key: expected -> got' (``exact``: a run of EXACT)."""
    out = [f"{len(expected)} lines expected, {len(got)} written"] if len(expected) != len(got) else []
    for i, (e, g) in enumerate(zip(expected, got)):
        keys = {k for k in (*e, *g) if not k.startswith(SKIP_PREFIXES)}
        for k in sorted(keys):
            if k not in e or k not in g:
                out.append(f"line {i} key {k}: {'missing now' if k not in g else 'new'}")
            elif not _same(e[k], g[k], k, exact):
                out.append(f"line {i} key {k}: {e[k]!r} -> {g[k]!r}")
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-equivalence"))


@pytest.fixture(scope="module")
def turn_model_dir(tmp_path_factory):
    return build_turn_model(tmp_path_factory.mktemp("tiny-turns"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_fixed_seed_run_reproduces_the_recorded_metrics(name, request, tmp_path):
    """The run writes the recorded metrics and samples: every key of every line (floats to the module's tolerances)."""
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    model = request.getfixturevalue("turn_model_dir" if name in ENDS_TURNS else "model_dir")
    expected = [json.loads(ln) for ln in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]
    moved = differences(expected, run_lines(name, model, tmp_path / "run"), exact=name in EXACT)
    assert not moved, "\n".join(moved[:40])


if __name__ == "__main__" and sys.argv[1:2] == ["--record"]:
    import tempfile

    sys.path.insert(0, str(HERE))
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        turns = build_turn_model(Path(tmp) / "turns")
        for run in sys.argv[2:] or RUNS:  # `--record NAME ...`: only those runs
            lines = run_lines(run, turns if run in ENDS_TURNS else model, Path(tmp) / run)
            (FIXTURES / f"{run}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
            print(f"recorded {run}: {len(lines)} lines")
