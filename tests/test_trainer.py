"""End to end on a tiny random model: the loop trains, logs every documented key, checkpoints and resumes."""
import json

import pytest
import torch

from gspo.cli import main
from gspo.config import PRESETS, build_config
from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.train import Trainer

from conftest import tiny_llama

DOCUMENTED_KEYS = [
    "step", "rollout_batch", "minibatch", "loss", "reward/mean", "reward/std", "reward/text_length/mean",
    "reward/text_length/std", "reward/last_number/mean", "reward/failures", "reward/failed_frac", "accuracy", "zero_variance_frac",
    "completion/len_mean", "completion/len_max", "completion/truncated_frac",
    "clip/token_low", "clip/token_high", "clip/token_total", "clip/seq_low", "clip/seq_high", "clip/seq_total",
    "ratio/token_mean", "ratio/token_std", "ratio/token_min", "ratio/token_max",
    "ratio/seq_mean", "ratio/seq_std", "ratio/seq_min", "ratio/seq_max", "ratio/seq_product_log_min",
    "ratio/seq_product_log_max", "kl/old_new", "entropy", "grad_norm", "lr", "nonfinite_steps",
    "logprob/engine_diff_mean", "logprob/engine_diff_max", "logprob/engine_seq_diff_mean", "logprob/engine_seq_diff_max",
    "dynamic/dropped_groups", "dynamic/padded_groups", "dynamic/rounds", "data/skipped_prompts", "data/position",
    "throughput/rollout_tok_s", "throughput/train_tok_s",
    "time/rollout", "time/reward", "time/logprobs", "time/update", "time/elapsed",
    "bylen/0-63/seqs", "bylen/0-63/clip_token", "bylen/0-63/ratio_token_std", "bylen/0-63/ratio_seq_std",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a local HF directory."""
    d = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.02).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def tiny_config(tiny_dir, *extra):
    return build_config({}, [f"model.name='{tiny_dir}'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
                             "rollout.max_new_tokens=6", "train.steps=2", "train.minibatches=2", "train.lr=1e-3",
                             "rewards.workers=0", "log.progress=false",
                             "rewards.functions=[{path='trainer_rewards:text_length'}, {path='gspo.rewards.builtin:last_number', weight=0.0}]", "log.checkpoint_every=1", *extra], device="cpu")


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_two_steps_change_parameters_and_log_every_key(tiny_dir, tmp_path):
    """Two optimizer steps change the weights, and every metrics line carries every documented key."""
    trainer = Trainer(tiny_config(tiny_dir), tmp_path / "run")
    before = _params(trainer.actor.model)
    trainer.train()
    after = _params(trainer.actor.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = [k for k in DOCUMENTED_KEYS if k not in r]
        assert not missing, missing
    assert rows[0]["minibatch"] == 0 and rows[1]["minibatch"] == 1
    # The first minibatch is on-policy: recomputed old log-probs equal the update's own, so every ratio is 1.
    assert rows[0]["ratio/token_min"] == rows[0]["ratio/token_max"] == 1.0 and rows[0]["clip/token_total"] == 0.0
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert samples and {"prompt", "completion", "reward", "advantage", "finish_reason"} <= set(samples[0])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["algorithm"] == "gspo"


def test_a_batch_whose_every_completion_was_cut_off_is_said_once(tiny_dir, tmp_path, caplog):
    """The tiny model never ends a 6-token completion: the first batch warns, in one line naming
    rollout.max_new_tokens, that nothing past the limit was scored; the second batch does not say it again; a batch
    with one completion that ended says nothing."""
    import logging

    from gspo.train import Trainer

    trainer = Trainer(tiny_config(tiny_dir), tmp_path / "run")
    try:
        with caplog.at_level(logging.WARNING, logger="gspo"):
            for _ in range(2):
                trainer.collector.collect()
        said = [r.getMessage() for r in caplog.records if "without ending" in r.getMessage()]
        assert len(said) == 1 and "rollout.max_new_tokens = 6" in said[0] and "\n" not in said[0]
        caplog.clear()
        trainer.collector._warned_cut = False  # as a new run's collector
        with caplog.at_level(logging.WARNING, logger="gspo"):
            trainer.collector.warn_if_all_cut(torch.tensor([True, False, True]))
        assert not [r for r in caplog.records if "without ending" in r.getMessage()]
    finally:
        trainer.collector.close()
        trainer.release()


def test_log_final_checkpoint_false_skips_only_the_checkpoint_at_the_end(tiny_dir, tmp_path):
    """log.final_checkpoint = false: a run of 2 rollout batches with a checkpoint every batch keeps the periodic one
    after batch 1 and writes none at its end; the default writes both."""
    from gspo.train import Trainer

    for final, want in ((False, ["step-000002"]), (True, ["step-000002", "step-000004"])):
        run = tmp_path / f"final-{final}"
        Trainer(tiny_config(tiny_dir, "train.steps=4", f"log.final_checkpoint={str(final).lower()}"), run).train()
        assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == want


def test_run_writes_ratio_histograms_and_token_traces(tiny_dir, tmp_path):
    """Every optimizer step writes token and sequence log-ratio counts (one per token / per sequence trained); the last
    minibatch of a traced batch writes per-token traces whose mean is the sequence log-ratio."""
    Trainer(tiny_config(tiny_dir, "log.trace_every=1", "log.trace_samples=2"), tmp_path / "run").train()
    hists = read_jsonl(tmp_path / "run" / "histograms.jsonl")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [h["step"] for h in hists] == [m["step"] for m in metrics] == [1, 2]
    assert len(hists[0]["token"]) == len(hists[0]["seq"]) == len(hists[0]["edges"]) + 1
    assert sum(hists[0]["token"]) == sum(hists[0]["token"][12:13])  # on-policy: every log-ratio is 0
    assert sum(hists[1]["seq"]) == 4  # 8 completions, 2 minibatches
    traces = read_jsonl(tmp_path / "run" / "traces.jsonl")
    assert len(traces) == 2 and {t["minibatch"] for t in traces} == {1}
    for t in traces:
        assert len(t["tokens"]) == len(t["token_log_ratio"]) > 0
        assert t["seq_log_ratio"] == pytest.approx(sum(t["token_log_ratio"]) / len(t["token_log_ratio"]), abs=1e-6)


def test_profile_batch_writes_the_stages_and_a_trace_of_that_batch_only(tiny_dir, tmp_path):
    """log.profile_batch = 2 profiles the second rollout batch: its stage table names the loop's stages with their
    call counts (2 optimizer steps of 1 minibatch each), and the trace is gzipped Chrome-trace JSON."""
    import gzip

    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=3", "train.minibatches=1", "log.profile_batch=2"), run).train()
    table = (run / "profile" / "rank0.txt").read_text()
    assert table.startswith("rollout batch 2, process 0 (cpu)")
    stages = {line.split()[0]: int(line.split()[1]) for line in table.splitlines() if line.startswith("gspo/")}
    assert stages["gspo/collect"] == stages["gspo/update"] == stages["gspo/step"] == stages["gspo/apply"] == 1
    assert {"gspo/rollout", "gspo/reward", "gspo/old_logprobs", "gspo/forward_backward", "gspo/reduce_metrics"} <= set(stages)
    trace = json.loads(gzip.open(run / "profile" / "rank0.trace.json.gz").read())
    assert any(e.get("name") == "gspo/collect" for e in trace["traceEvents"])
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["rank0.trace.json.gz", "rank0.txt"]


def test_resume_continues_the_step_count(tiny_dir, tmp_path):
    """A run resumed from its checkpoint continues from step 2 to step 4 with the same parameters it saved."""
    run = tmp_path / "run"
    first = Trainer(tiny_config(tiny_dir), run)
    first.train()
    saved = _params(first.actor.model)
    resumed = Trainer(tiny_config(tiny_dir, "train.steps=4"), run, resume=True)
    assert resumed.state.step == 2
    assert all(torch.equal(saved[k], v) for k, v in _params(resumed.actor.model).items())
    resumed.train()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


def test_existing_run_dir_without_resume_is_refused(tiny_dir, tmp_path):
    """Starting a run in a directory that holds a trained run (metrics lines or a checkpoint) without --resume fails
    instead of overwriting it."""
    from gspo.errors import UserError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    with pytest.raises(UserError, match="--resume"):
        Trainer(tiny_config(tiny_dir), tmp_path / "run")


@pytest.mark.parametrize("algorithm", sorted(set(PRESETS) - {"gspo"}))  # gspo: every other test
def test_every_preset_trains(tiny_dir, tmp_path, algorithm):
    """Every algorithm preset runs a rollout batch end to end with finite losses."""
    trainer = Trainer(tiny_config(tiny_dir, f"algorithm='{algorithm}'", "dapo.max_resample_rounds=1", "dapo.overlong_cache=4"), tmp_path / "run")
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(r["loss"] is not None for r in rows)


def test_rollout_logprobs_and_reference_kl(tiny_dir, tmp_path):
    """old_logprobs='rollout' and beta > 0 (a frozen reference model) both train and log the KL to the reference."""
    trainer = Trainer(tiny_config(tiny_dir, "train.old_logprobs='rollout'", "loss.beta=0.1"), tmp_path / "run")
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all("kl/ref" in r for r in rows)


def test_recomputed_old_logprobs_are_the_pre_update_policys(tiny_dir, tmp_path):
    """In fp32 the engine's log-probs are the pre-update policy's to ~1e-5, so recomputing the old log-probs (minibatch 0
    from its own forward, the later ones from the frozen pass) must give the same losses and ratios as reusing them."""
    runs = {}
    for mode in ("recompute", "rollout"):
        Trainer(tiny_config(tiny_dir, f"train.old_logprobs='{mode}'", "train.steps=4", "train.minibatches=4",
                            "rollout.group_size=8"), tmp_path / mode).train()
        runs[mode] = read_jsonl(tmp_path / mode / "metrics.jsonl")
    for a, b in zip(runs["recompute"], runs["rollout"]):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)
        assert a["ratio/seq_max"] == pytest.approx(b["ratio/seq_max"], abs=1e-4)
    assert runs["recompute"][-1]["ratio/token_max"] > 1.0  # the later minibatches are off-policy


def test_cli_train_and_user_errors(tiny_dir, tmp_path, capsys):
    """`gspo train` runs from a TOML file, and a bad override ends in one line naming the key, exit code 2."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nname = "{tiny_dir}"\n[rollout]\nprompts_per_batch = 2\ngroup_size = 2\nmax_new_tokens = 4\n'
                   '[train]\nsteps = 2\nminibatches = 2\n[rewards]\nworkers = 0\n[log]\nprogress = false\n')
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r"), "model.device='cpu'"]) == 0
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "r2"), "loss.eps_hihg=1"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'eps_high'" in err and "Traceback" not in err
    assert main(["summary", str(tmp_path / "r")]) == 0


def test_failed_rewards_are_counted_and_get_zero_advantage(tiny_dir, tmp_path):
    """Completions whose reward raises are NaN, counted in reward/failures, and get advantage 0."""
    trainer = Trainer(tiny_config(tiny_dir, "rewards.functions=[{path='trainer_rewards:flaky'}]", "rewards.workers=1"), tmp_path / "run")
    try:
        batch = trainer.collector.collect()
    finally:
        trainer.rewards.close()
    failed = ~torch.isfinite(batch.rewards)
    expected = torch.tensor([len(t) % 3 == 0 for t in batch.rollout.texts])
    assert torch.equal(failed, expected)
    assert batch.metrics["reward/failures"] == float(expected.sum())
    assert (batch.advantages[failed] == 0).all() and torch.isfinite(batch.advantages).all()


def test_dynamic_sampling_drops_zero_variance_groups_and_refills(tiny_dir, tmp_path):
    """With dynamic sampling, groups whose rewards are all equal are dropped, counted, and replaced by new prompts."""
    trainer = Trainer(tiny_config(tiny_dir, "algorithm='dapo'", "rewards.functions=[{path='trainer_rewards:even_a_constant'}]",
                                  "rollout.prompts_per_batch=4", "dapo.max_resample_rounds=20", "dapo.overlong_cache=4",
                                  "loss.mask_truncated=false"), tmp_path / "run")
    try:
        batch = trainer.collector.collect()
    finally:
        trainer.rewards.close()
    G = 4
    assert len(batch.examples) == 4 * G
    assert all(ex.meta["a"] % 2 == 1 for ex in batch.examples)  # only groups with reward variance were kept
    assert batch.metrics["dynamic/dropped_groups"] >= 1 and batch.metrics["dynamic/rounds"] >= 2
    assert batch.metrics["dynamic/padded_groups"] == 0
    assert batch.metrics["zero_variance_frac"] > 0


def test_eval_reports_greedy_accuracy_and_pass_at_1(tiny_dir):
    """`evaluate` scores greedy and sampled completions and reports both as fractions."""
    from gspo.commands.evaluate import evaluate

    cfg = tiny_config(tiny_dir)
    out = evaluate(cfg, n=6, samples=2, batch_size=4)
    assert out["n"] == 6 and 0.0 <= out["greedy_accuracy"] <= 1.0 and 0.0 <= out["pass@1"] <= 1.0


def test_gradient_checkpointing_gives_the_same_update(tiny_dir, tmp_path):
    """Gradient checkpointing recomputes activations but changes neither the loss nor the trained weights."""
    runs = []
    for i, gc in enumerate(("false", "true")):
        trainer = Trainer(tiny_config(tiny_dir, f"model.gradient_checkpointing={gc}"), tmp_path / f"run{i}")
        trainer.train()
        runs.append((read_jsonl(tmp_path / f"run{i}" / "metrics.jsonl"), _params(trainer.actor.model)))
    assert [r["loss"] for r in runs[0][0]] == pytest.approx([r["loss"] for r in runs[1][0]], abs=1e-6)
    for k, v in runs[0][1].items():
        torch.testing.assert_close(v, runs[1][1][k], atol=1e-6, rtol=1e-5)


def test_packed_update_gives_the_padded_update(tiny_dir, tmp_path):
    """train.packing = 'on' (sequences concatenated without padding) trains to the same losses and weights as the padded
    layout, and its on-policy ratio is exactly 1."""
    runs = []
    for i, packing in enumerate(("off", "on")):
        trainer = Trainer(tiny_config(tiny_dir, f"train.packing='{packing}'"), tmp_path / f"run{i}")
        assert trainer.actor.packed == (packing == "on")
        trainer.train()
        runs.append((read_jsonl(tmp_path / f"run{i}" / "metrics.jsonl"), _params(trainer.actor.model)))
    assert runs[1][0][0]["ratio/token_min"] == runs[1][0][0]["ratio/token_max"] == 1.0
    assert [r["loss"] for r in runs[0][0]] == pytest.approx([r["loss"] for r in runs[1][0]], abs=1e-6)
    for k, v in runs[0][1].items():  # Adam divides float32 gradient noise by ~|g|: 1e-5 is 0.5% of one step at lr 1e-3
        torch.testing.assert_close(v, runs[1][1][k], atol=1e-5, rtol=1e-5)


def test_packing_on_with_gradient_checkpointing_is_refused(tiny_dir, tmp_path):
    """Checkpointed layers recompute in the backward, after the packed attention is unset: refused with the fix."""
    with pytest.raises(UserError, match="train.packing = 'off'"):
        Trainer(tiny_config(tiny_dir, "train.packing='on'", "model.gradient_checkpointing=true"), tmp_path / "run")


def test_dropout_is_disabled_so_the_on_policy_ratio_is_one(tmp_path, tokenizer):
    """A model configured with dropout trains with it off: the first minibatch's ratios are exactly 1."""
    d = tmp_path / "dropout"
    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    model.config.attention_dropout = 0.5
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    trainer = Trainer(tiny_config(d), tmp_path / "run")
    assert trainer.actor.model.config.attention_dropout == 0.0
    trainer.train()
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["ratio/token_min"] == first["ratio/token_max"] == 1.0


def test_resume_after_a_crash_replays_without_duplicate_lines(tiny_dir, tmp_path):
    """Lines written after the last checkpoint by a run that died are dropped on resume, not duplicated."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=4", "log.checkpoint_every=1"), run).train()
    # Simulate a crash after step 2's checkpoint: keep only that checkpoint, leave the later lines in place.
    import shutil

    for ckpt in (run / "checkpoints").iterdir():
        if ckpt.name != "step-000002":
            shutil.rmtree(ckpt)
    Trainer(tiny_config(tiny_dir, "train.steps=4"), run, resume=True).train()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    batches = [r["rollout_batch"] for r in read_jsonl(run / "samples.jsonl")]
    assert batches == sorted(batches) and len(batches) == 2 * 2  # 2 rollout batches x 2 prompts


def test_graph_engine_trains_on_cpu(tiny_dir, tmp_path):
    """rollout.engine = 'graph' (eager on a CPU) drives a training run like the simple engine."""
    trainer = Trainer(tiny_config(tiny_dir, "rollout.engine='graph'"), tmp_path / "run")
    assert type(trainer.engine).__name__ == "GraphEngine"
    trainer.train()
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2


def test_non_finite_steps_are_skipped_then_stop_the_run(tiny_dir, tmp_path, monkeypatch):
    """A loss that turns NaN is not applied: the weights stay as they were, the step is counted, and the run stops
    with a message once train.max_nonfinite_steps happen in a row."""
    import gspo.train.actor
    from gspo.errors import UserError

    real = gspo.train.actor.policy_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(gspo.train.actor, "policy_loss", nan_loss)
    trainer = Trainer(tiny_config(tiny_dir, "train.steps=8", "train.max_nonfinite_steps=2"), tmp_path / "run")
    before = _params(trainer.actor.model)
    with pytest.raises(UserError, match="non-finite"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in _params(trainer.actor.model).items())
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["nonfinite_steps"] for r in rows] == [1.0]  # the second in a row stops the run before its line


def _losses(run):
    return [(r["step"], r["loss"], r["reward/mean"], r["grad_norm"]) for r in read_jsonl(run / "metrics.jsonl")]


@pytest.mark.slow
def test_resume_is_bit_identical_to_a_straight_run(tiny_dir, tmp_path):
    """6 steps straight and 3 steps + resume + 3 steps give bit-identical losses, rewards, gradient norms and weights."""
    a = Trainer(tiny_config(tiny_dir, "train.steps=6", "train.minibatches=1"), tmp_path / "a")
    a.train()
    Trainer(tiny_config(tiny_dir, "train.steps=3", "train.minibatches=1"), tmp_path / "b").train()
    b = Trainer(tiny_config(tiny_dir, "train.steps=6", "train.minibatches=1"), tmp_path / "b", resume=True)
    assert b.state.step == 3
    b.train()
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    for (name, x), y in zip(a.actor.model.named_parameters(), b.actor.model.parameters()):
        assert torch.equal(x, y), name


def test_corrupt_latest_checkpoint_falls_back_to_the_previous(tiny_dir, tmp_path, caplog):
    """A complete-looking newest checkpoint whose weights cannot be read: resume says so and uses the previous one."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=4"), run).train()
    newest = sorted((run / "checkpoints").iterdir())[-1]
    assert newest.name == "step-000004"
    for f in newest.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with caplog.at_level("WARNING", logger="gspo"):
        t = Trainer(tiny_config(tiny_dir, "train.steps=6"), run, resume=True)
    assert t.state.step == 2 and "cannot be read" in caplog.text
    t.train()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_sigterm_finishes_the_batch_checkpoints_and_exits_143(tiny_dir, tmp_path, capsys):
    """SIGTERM during a rollout: the batch's minibatch steps finish, a checkpoint is written, `gspo train` exits with
    143 and says how to continue; --resume then completes the run."""
    import trainer_rewards

    trainer_rewards._SENT.clear()
    run = tmp_path / "run"
    args = ["train", "--run-dir", str(run), f"model.name='{tiny_dir}'", "rollout.prompts_per_batch=2",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=6", "train.minibatches=2",
            "rewards.workers=0", "log.progress=false", "log.checkpoint_every=0",
            "rewards.functions=[{path='trainer_rewards:sigterm_once'}]"]
    assert main(args) == 143
    assert "stopped by SIGTERM after 2 optimizer steps" in capsys.readouterr().err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]
    assert main([*args, "--resume"]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_failed_checkpoint_write_keeps_the_previous_and_says_so(tiny_dir, tmp_path, monkeypatch):
    """A checkpoint write that fails (disk full) ends in one error naming the directory and the intact checkpoint."""
    import errno

    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=2"), run).train()
    t = Trainer(tiny_config(tiny_dir, "train.steps=4"), run, resume=True)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError, match="No space left on device.*step-000002, is intact"):
        t.train()
    monkeypatch.undo()
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step-000002" in names and "step-000004" not in names
    assert Trainer(tiny_config(tiny_dir, "train.steps=4"), run, resume=True).state.step == 2


KILL_DURING_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from gspo.config import build_config
from gspo.train import Trainer
from test_trainer import tiny_config
t = Trainer(tiny_config({tiny!r}, "train.steps=4"), {run!r}, resume=True)
real = torch.save
def save_then_die(obj, path, *a, **k):
    real(obj, path, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-checkpoint: after the state file, before fsync, rename and marker
torch.save = save_then_die
t.train()
"""


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_then_resume(tiny_dir, tmp_path):
    """kill -9 in the middle of writing a checkpoint leaves a .tmp directory that is never taken for a checkpoint;
    the previous one stays complete and --resume continues from it."""
    import subprocess
    import sys
    from pathlib import Path

    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=2"), run).train()
    code = KILL_DURING_SAVE.format(tests=str(Path(__file__).parent), tiny=str(tiny_dir), run=str(run))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step-000004.tmp" in names and "step-000004" not in names
    t = Trainer(tiny_config(tiny_dir, "train.steps=4"), run, resume=True)
    assert t.state.step == 2
    t.train()
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step-000004"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("detector", ["sentinel.entropy_min=100.0", "sentinel.seq_ratio_log_max=1e-9",
                                      "sentinel.reward_drop=0.5", "sentinel.truncated_max=0.01"])
def test_collapse_sentinel_detectors_stop_the_run(tiny_dir, tmp_path, detector):
    """Each detector trips (entropy, ratio and truncation thresholds set beyond a healthy run -- a tiny random model
    runs every completion to max_new_tokens; the reward falls from 1 to 0 after the first batch) and stops the run with one error naming the detector, the threshold and the last checkpoint,
    without writing a checkpoint of the collapsed state."""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    extra = ["sentinel.window=1", "rewards.functions=[{path='trainer_rewards:declining'}]"] if "reward_drop" in detector else []
    t = Trainer(tiny_config(tiny_dir, "train.steps=6", "sentinel.action='stop'", detector, *extra), tmp_path / "run")
    key = detector.split("=")[0].replace(".", r"\.")
    with pytest.raises(UserError, match=key + ".*(last checkpoint is step-|no checkpoint was written yet)"):
        t.train()
    assert t.state.step < 6 and t.collapse
    written = [p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")] if (tmp_path / "run" / "checkpoints").exists() else []
    assert f"step-{t.state.step:06d}" not in written  # the collapsed state is not checkpointed
    assert json.loads((tmp_path / "run" / "stopped.json").read_text())["step"] == t.state.step  # for gspo compare
    again = Trainer(tiny_config(tiny_dir, "train.steps=6", "sentinel.action='stop'", detector, *extra), tmp_path / "run",
                    resume=True)
    again.release()
    assert not (tmp_path / "run" / "stopped.json").exists()  # resumed: it goes on, no longer a stopped run


def test_collapse_sentinel_warns_and_goes_on(tiny_dir, tmp_path, caplog):
    t = Trainer(tiny_config(tiny_dir, "train.steps=4", "sentinel.entropy_min=100.0"), tmp_path / "run")
    with caplog.at_level("WARNING", logger="gspo"):
        t.train()
    assert t.state.step == 4 and "collapse sentinel at step 2: entropy" in caplog.text


def test_sentinel_rollback_reloads_an_earlier_checkpoint_with_a_lower_lr(tiny_dir, tmp_path, caplog):
    """action='rollback': the reward collapses in batch 2; the run reloads the checkpoint written before batch 1 (the
    one right before batch 2 would replay the same rollouts), halves the learning rate, logs it, replays without
    duplicate metrics lines, and stops in one line when no older checkpoint is left."""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    t = Trainer(tiny_config(tiny_dir, "train.steps=12", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                            "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:declining_later'}]"),
                tmp_path / "run")
    with caplog.at_level("WARNING", logger="gspo"), pytest.raises(UserError, match="no checkpoint older"):
        t.train()
    assert caplog.text.count("rolling back to step-000002") == 1
    assert t.actor.lr_scale == 0.5 and t.state.rollbacks == 1
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # batch 1 replayed in place of its first run
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 5e-4, 5e-4]


def test_truncation_detector_by_hand():
    """Off at 0; trips when the batch's truncated fraction exceeds the threshold, not when it equals it; lines without
    the key (no completion measured) do not trip it."""
    from types import SimpleNamespace

    from gspo.train.sentinel import collapse_findings

    sc = SimpleNamespace(entropy_min=0.0, reward_drop=0.0, window=5, seq_ratio_log_max=0.0, truncated_max=0.5)
    line = {"completion/truncated_frac": 0.625}
    assert collapse_findings(sc, [line, line], {}) == [
        "62.5% of the batch's completions were cut at rollout.max_new_tokens > sentinel.truncated_max = 0.5"]
    assert collapse_findings(sc, [{"completion/truncated_frac": 0.5}], {}) == []
    assert collapse_findings(sc, [{}], {}) == []
    assert collapse_findings(SimpleNamespace(**{**vars(sc), "truncated_max": 0.0}), [line], {}) == []


def test_reward_drop_peak_and_rollback_limit_by_hand():
    """Hand-worked: window 2 over batch rewards 0.2 0.8 1.0 0.9 0.5 0.3 (batch 3 has none): the window means end at
    batches 1..6 as 0.5 0.9 0.95 0.7 0.4; the newest, 0.4, is 0.55 below the best earlier one (0.95, ending at batch 4),
    so a drop of 0.5 trips. A rollback may resume at batch 4 at the latest (the weights that sampled batch 4, the
    peak's last batch); without a drop, at the batch before the trigger's (6 - 1)."""
    from types import SimpleNamespace

    from gspo.train.sentinel import best_window_end, reward_drop, rollback_limit

    sc = SimpleNamespace(reward_drop=0.5, window=2)
    rewards = {0: 0.2, 1: 0.8, 2: 1.0, 3: None, 4: 0.9, 5: 0.5, 6: 0.3}
    assert reward_drop(sc, rewards) == ("mean reward of the last 2 batches 0.400 is 0.550 below its best 0.950 "
                                        "(sentinel.reward_drop = 0.5)")
    assert best_window_end(sc, rewards, before_newest=True) == 4 and best_window_end(sc, rewards) == 4
    assert rollback_limit(6, 4) == 4 and rollback_limit(6, None) == 5 and rollback_limit(6, 5) == 5
    assert reward_drop(SimpleNamespace(reward_drop=0.6, window=2), rewards) is None  # 0.55 is not more than 0.6
    assert best_window_end(SimpleNamespace(reward_drop=0.0, window=2), rewards) is None  # detector off
    assert reward_drop(sc, {0: 1.0, 1: 1.0, 2: 0.0}) is None  # 2 x window batches needed
    # equal best windows: the latest is the peak
    assert best_window_end(SimpleNamespace(reward_drop=0.5, window=1), {0: 1.0, 1: 1.0, 2: 0.0}, True) == 1
    nan = float("nan")  # a batch whose every reward call failed: skipped like one without a reward
    assert reward_drop(sc, {0: 1.0, 1: 1.0, 2: nan, 3: 0.0}) is None
    assert best_window_end(sc, {0: nan, 1: 0.2, 2: 0.8, 3: 0.5}) == 3  # windows 0.5 (ending at 2) and 0.65 (at 3)


@pytest.mark.slow
def test_a_rollback_after_a_gradual_drop_goes_back_to_the_peak(tiny_dir, tmp_path, caplog):
    """The reward peaks in batches 0-1 and declines over three batches before the sentinel trips (batch 4). The
    rollback goes to the checkpoint holding the policy that sampled the peak's last batch, 1 (step 2), not to the
    newest one before the trigger (step 6, inside the decline, from which the window's mean trips the sentinel again
    at once); pruning kept it though log.keep_checkpoints = 1. (This reward counts calls, so the replay scores 0 and
    the run then stops: no checkpoint is older.)"""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    run = tmp_path / "run"
    t = Trainer(tiny_config(tiny_dir, "train.steps=20", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                            "sentinel.window=1", "log.checkpoint_every=1", "log.keep_checkpoints=1",
                            "rewards.functions=[{path='trainer_rewards:peaks_then_declines'}]"), run)
    with caplog.at_level("WARNING", logger="gspo"), pytest.raises(UserError, match="no checkpoint older"):
        t.train()
    assert "collapse sentinel at step 10:" in caplog.text
    assert caplog.text.count("rolling back to step-000002") == 1 and t.state.rollbacks == 1
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-")] == ["step-000002"], names
    assert any(n.startswith("rolled-back-step-000008") for n in names), names
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # the abandoned timeline's lines are gone


def test_resume_with_a_lower_lr_uses_it(tiny_dir, tmp_path):
    """The config's train.lr wins over the checkpoint's on --resume (and is what the metrics log)."""
    Trainer(tiny_config(tiny_dir, "train.steps=2"), tmp_path / "run").train()
    t = Trainer(tiny_config(tiny_dir, "train.steps=4", "train.lr=1e-4"), tmp_path / "run", resume=True)
    assert t.actor.holding.optimizer.param_groups[0]["lr"] == 1e-4
    t.train()
    assert [r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1e-3, 1e-3, 1e-4, 1e-4]


def test_long_prompt_fails_by_flag(tiny_dir, tmp_path):
    t = Trainer(tiny_config(tiny_dir, "data.max_prompt_tokens=3", "data.long_prompts='fail'"), tmp_path / "run")
    with pytest.raises(UserError, match="exceeds data.max_prompt_tokens = 3; raise it, or set data.long_prompts"):
        t.train()


def test_out_of_memory_names_the_knob(tiny_dir, tmp_path, monkeypatch):
    t = Trainer(tiny_config(tiny_dir), tmp_path / "run")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(t, "update", oom)
    with pytest.raises(UserError, match="out of memory in the update at step 0; lower train.micro_batch_size") as e:
        t.train()
    assert "model.gpu_memory" not in str(e.value)
    monkeypatch.setattr("gspo.train.guards.gpu_memory_cap", lambda: 0.15)  # a run capped at a share of its GPU
    t = Trainer(tiny_config(tiny_dir), tmp_path / "run2")
    monkeypatch.setattr(t, "update", oom)
    with pytest.raises(UserError, match=r"or give the run more than model.gpu_memory = 0.15 of the GPU \(gspo compare "
                                        r"--jobs sets it when runs share a GPU: run fewer at once; "
                                        r"rollout.decode_gpu = 'shared' splits a GPU among its processes: set "
                                        r"model.gpu_memory yourself\); no checkpoint"):
        t.train()


def test_sentinel_reward_history_survives_a_restart(tiny_dir, tmp_path):
    """A resumed run's reward-drop detector knows the rewards before the checkpoint (read back from metrics.jsonl), so
    it trips on the same collapse as a run that never stopped."""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    extra = ["sentinel.action='stop'", "sentinel.reward_drop=0.5", "sentinel.window=1",
             "rewards.functions=[{path='trainer_rewards:declining'}]"]
    Trainer(tiny_config(tiny_dir, "train.steps=2", *extra), tmp_path / "run").train()  # batch 0: reward 1
    t = Trainer(tiny_config(tiny_dir, "train.steps=6", *extra), tmp_path / "run", resume=True)
    assert t.rewards_seen == {0: 1.0}
    with pytest.raises(UserError, match="reward_drop"):
        t.train()  # batch 1: reward 0, a drop of 1 from the best before the restart


def test_engine_weight_bits_samples_from_rounded_weights_and_leaves_the_trainers(tiny_dir, tmp_path):
    """rollout.engine_weight_bits = 4: the engine (hf, which then keeps its own copy) samples from 4-bit-rounded
    weights, so its log-probs differ from the trainer's recomputation (logprob/engine_diff_*), while the trainer's
    weights stay unrounded; with it off, the hf engine samples from the trainer's model and the gap is 0."""
    gaps = {}
    for bits in (0, 4):
        trainer = Trainer(tiny_config(tiny_dir, "rollout.engine='hf'", f"rollout.engine_weight_bits={bits}",
                                      "train.steps=2"), tmp_path / f"run{bits}")
        trainer.train()
        gaps[bits] = read_jsonl(tmp_path / f"run{bits}" / "metrics.jsonl")[0]["logprob/engine_diff_mean"]
        w = trainer.actor.model.model.layers[0].mlp.up_proj.weight  # (out, in): 4 bits give at most 15 values a row
        assert len(torch.unique(w[0])) > 15
    assert gaps[0] < 1e-5 and gaps[4] > 100 * max(gaps[0], 1e-6)


def test_two_moves_aside_in_one_second_keep_both(tmp_path):
    """A rollback renames the abandoned checkpoints to rolled-back-<name>-<second>: two rollbacks past a checkpoint of
    one name within a second (a fast replay) used to collide on that name (OSError: Directory not empty, the run
    lost); the second move takes the next free name, and the first one's files stay."""
    from gspo.checkpoint import aside

    for k in range(3):
        d = tmp_path / "step-000004"
        d.mkdir()
        (d / "f").write_text(str(k))
        d.rename(aside(d, "rolled-back-step-000004-7"))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["rolled-back-step-000004-7", "rolled-back-step-000004-7-2", "rolled-back-step-000004-7-3"]
    assert [(tmp_path / n / "f").read_text() for n in names] == ["0", "1", "2"]
