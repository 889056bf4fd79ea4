"""Asynchronous rollouts (rollout.max_staleness): the fixed lag held under any timing, the threaded collect equal bit
for bit to the one in turn with the update, checkpoints that save the batches collected ahead, and refusals."""
import random
import sys
import shutil
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from gspo.config import build_config
from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.train import Trainer
from gspo.feed.ahead import Ahead

from test_trainer import tiny_config, tiny_dir  # noqa: F401  (the module's tiny model fixture)

# ------------------------------------------------------------------------------------------ the lag alone


def test_the_lag_by_hand():
    """Lag(eta=2, v0=3, total=10): batches 3-5 are sampled by version 3 (the timeline's first three), then g(j) = j - 2;
    a version is needed while a batch it samples is still to collect; a collector holding version v goes up to
    batch v + 2, never past the end nor back before the next batch."""
    from gspo.feed.lag import Lag

    lag = Lag(eta=2, v0=3, total=10)
    assert [lag.version_of(j) for j in range(3, 10)] == [3, 3, 3, 4, 5, 6, 7]
    assert lag.needed(3, first=3) and not lag.needed(3, first=6)  # batches 3, 4, 5
    assert lag.needed(4, first=5) and not lag.needed(4, first=7)  # batch 6
    assert lag.needed(7, first=9) and not lag.needed(8, first=9)  # batch 10 would be version 8's: past the end
    assert (lag.runs_until(3, 3), lag.runs_until(8, 9), lag.runs_until(3, 7)) == (6, 10, 7)


def test_the_lags_bounded_search_equals_a_search_of_the_whole_timeline():
    """needed(v, first) looks only at batches up to v + eta; it equals the search over every batch left, and
    runs_until(v, first) is one past the last batch v samples or any older version does, on random lags."""
    import random

    from gspo.feed.lag import Lag

    rng = random.Random(0)
    for _ in range(2000):
        eta, v0 = rng.randint(0, 4), rng.randint(0, 5)
        lag = Lag(eta, v0, v0 + rng.randint(0, 12))
        v, first = rng.randint(v0, lag.total + 3), rng.randint(v0, lag.total + 1)  # (no version before v0)
        assert lag.needed(v, first) == any(lag.version_of(j) == v for j in range(first, lag.total))
        held = [j for j in range(first, lag.total) if lag.version_of(j) <= v]
        assert lag.runs_until(v, first) == (held[-1] + 1 if held else first)


# ------------------------------------------------------------------------------------------ the pipeline alone


@dataclass
class FakeRollout:
    versions: torch.Tensor | None = None  # (1, T): the version of each step's token, under in-flight updates

    @property
    def sampled(self) -> torch.Tensor:
        return torch.ones_like(self.versions, dtype=torch.bool)


@dataclass
class FakeBatch:
    sampled_by: float  # the engine's weight when it collected the batch
    metrics: dict = field(default_factory=dict)
    rollout: FakeRollout = field(default_factory=FakeRollout)


class FakeEngine:
    """Copies the weight it is given (as an engine copies into its own buffers), and sleeps a random while."""

    def __init__(self, rng: random.Random):
        self.weight, self.rng = None, rng

    def sync_weights(self, weights):
        (name, tensor), = list(weights)
        time.sleep(self.rng.random() * 1e-3)
        self.weight = float(tensor)

    def collect(self):
        time.sleep(self.rng.random() * 2e-3)
        return FakeBatch(self.weight)


class InFlightEngine(FakeEngine):
    """Samples 6 steps a batch, polling for newer weights between them as the graph engine does (``swaps``)."""

    swaps = None

    def collect(self):
        versions = []
        for step in range(6):
            if step:
                self.swaps.poll()
            assert self.weight == self.swaps.version  # the engine holds the version it says
            versions.append(self.swaps.version)
            time.sleep(self.rng.random() * 1e-3)
        return FakeBatch(float(versions[0]), rollout=FakeRollout(torch.tensor([versions])))


def drive(eta: int, threaded: bool, total: int, seed: int, resume_at: int | None = None, in_flight: str = "off",
          group=None):
    """A trainer's side of the pipeline with random update times: the policy's one weight is its version, changed in
    place after each batch; with ``resume_at``, a checkpoint there (pause, save) and a restart from it. ``group``: the
    engine threads' process group under torchrun (outside a distributed job any object: the agreement to stop is then
    this process's own answer)."""
    rng = random.Random(seed)
    engine = (InFlightEngine if in_flight != "off" else FakeEngine)(random.Random(seed + 1))
    weight = torch.zeros(())
    pipe = Ahead(eta, threaded, engine.collect, engine, lambda: [("w", weight)], torch.device("cpu"),
                    group=group, in_flight=in_flight)
    pipe.reset(0, total)
    seen = []
    for j in range(total):
        batch = pipe.take(j)
        seen.append((batch.sampled_by, batch.metrics["async/staleness_max"], batch.metrics["async/ahead"]))
        if in_flight != "off":
            seen[-1] += (batch.rollout.versions, batch.metrics)
        time.sleep(rng.random() * 2e-3)  # the update, which changes the weights in place
        weight.fill_(j + 1)
        pipe.publish(j + 1)
        if resume_at == j + 1:
            pipe.pause()
            saved = pipe.state_dict()["async_queue"]
            # the batches sampled ahead by the versions before (and the next one, if the engine had started it; under
            # torchrun always, whatever the timing, for every process saves the same)
            if group is None:
                assert len(saved) in (min(eta, total - j - 1), min(eta + 1, total - j - 1))
            else:
                assert len(saved) == min(eta + 1, total - j - 1)
            if in_flight == "off":
                assert [q.version for q in saved] == [max(k - eta, 0) for k in range(j + 1, j + 1 + len(saved))]
            pipe.load_state_dict({"async_queue": saved})
            pipe.reset(j + 1, total)
    pipe.close()
    return seen


@pytest.mark.parametrize("eta", [1, 2, 3])
def test_every_batch_is_sampled_by_the_version_eta_batches_back_whatever_the_timing(eta):
    """Batch j is sampled by version max(j - eta, 0), never more than eta batches wait, under random engine and update
    times (20 schedules), in a thread and in turn, through a checkpoint and restart in the middle."""
    total = 9
    want = [(float(max(j - eta, 0)), float(min(j, eta))) for j in range(total)]
    for seed in range(20):
        for threaded in (True, False):
            seen = drive(eta, threaded, total, seed, resume_at=4 if seed % 2 else None)
            assert [(s, st) for s, st, _ in seen] == want, (seed, threaded)
            assert max(a for _, _, a in seen) <= eta


@pytest.mark.parametrize("eta", [1, 2])
def test_under_torchrun_a_checkpoint_saves_the_same_batches_whatever_the_timing(eta):
    """Under torchrun a checkpoint must not depend on whether this process's engine had started the batch the
    checkpoint's own policy samples (the engines gather with each other in a collect: one held back while another
    collects would hang both): it always lets that batch be collected, η + 1 saved, under random engine and update
    times (20 schedules), with the same versions and results as without a group."""
    want = [(float(max(j - eta, 0)), float(min(j, eta))) for j in range(9)]
    for seed in range(20):
        for in_flight in ("off", "keep"):
            seen = drive(eta, True, 9, seed, resume_at=4, in_flight=in_flight, group=object())
            if in_flight == "off":
                assert [(s, st) for s, st, _ in seen] == want, seed


def test_engine_threads_agree_to_stop_unless_their_run_failed(monkeypatch):
    """Under torchrun the engine threads agree before each batch whether any is stopping (one that stopped alone
    would leave the others in a gather); a failing run's (close with a timeout) stops without asking, for its peers
    may never come to agree. The agreement is watched here in one process, where it is this process's own answer."""
    from gspo.parallel import comm

    for timeout, asked in ((None, True), (5.0, False)):
        calls = []
        monkeypatch.setattr(comm, "any_rank", lambda flag: calls.append(flag) or flag)
        engine = FakeEngine(random.Random(0))
        pipe = Ahead(1, True, engine.collect, engine, lambda: [("w", torch.zeros(()))], torch.device("cpu"),
                        group=object())
        pipe.reset(0, 5)
        pipe.take(0)
        with pipe.cond:  # batch 1 (version 0) collected; batch 2 waits for version 1, which never comes
            pipe.cond.wait_for(lambda: pipe.engine_waits == 1, timeout=30)
        pipe.close(timeout)
        assert pipe.thread is None and calls[:2] == [False, False] and (True in calls) == asked, calls


def test_a_checkpoint_before_the_first_update_lets_the_first_batches_be_collected():
    """A checkpoint at the start (a run stopped before its first batch writes one) waits for the batches the first
    policy samples; it used to wait for them while holding the engine back, for ever."""
    for eta, group in ((1, None), (2, None), (2, object())):
        engine = FakeEngine(random.Random(0))
        pipe = Ahead(eta, True, engine.collect, engine, lambda: [("w", torch.zeros(()))], torch.device("cpu"),
                        group=group)
        pipe.reset(0, 5)
        pipe.pause()
        saved = pipe.state_dict()["async_queue"]
        # η batches, or η + 1 when the engine had claimed the next one before the pause (module docstring); under
        # torchrun always η + 1
        assert [q.version for q in saved] in ([0] * (eta + (group is not None)), [0] * (eta + 1))
        pipe.close()
        assert pipe.thread is None


@pytest.mark.parametrize("eta", [1, 2])
def test_in_flight_updates_keep_every_token_within_the_lag(eta):
    """rollout.in_flight: the engine polls for newer weights between steps and loads the newest the actor published
    (20 schedules of random engine and update times, a checkpoint and restart in half of them). Every token of batch j
    is sampled by a version in [j - eta, j] (the staleness bound, per token), the metrics give the tokens' mean and
    largest staleness and the batch's swaps, and the engine always holds the version it reports. Across the schedules,
    batches were updated in flight."""
    total, swapped = 9, 0
    for seed in range(20):
        seen = drive(eta, True, total, seed, resume_at=4 if seed % 2 else None, in_flight="keep")
        for j, (start, top, ahead, versions, metrics) in enumerate(seen):
            assert max(j - eta, 0) <= start == int(versions[0, 0]) and ahead <= eta
            assert versions.min() >= max(j - eta, 0) and versions.max() <= j
            assert top == j - versions.min() and metrics["async/staleness_mean"] == pytest.approx(
                float((j - versions).double().mean()))
            assert metrics["async/swaps"] == len(set(versions[0].tolist())) - 1
            swapped += int(metrics["async/swaps"])
    assert swapped > 0


def test_an_error_in_the_rollout_thread_reaches_the_update_as_it_was_raised():
    """A collect that fails (a reward function broken on every completion, say) fails take() in the trainer's thread
    with the same error; the thread is stopped cleanly."""
    calls = []

    def collect():
        calls.append(1)
        if len(calls) == 3:
            raise UserError("The reward function 'f' failed on all 8 completions of a rollout batch")
        return FakeBatch(0.0)

    engine = FakeEngine(random.Random(0))
    pipe = Ahead(1, True, collect, engine, lambda: [("w", torch.zeros(()))], torch.device("cpu"))
    pipe.reset(0, 5)
    pipe.take(0)
    pipe.publish(1)
    pipe.take(1)
    pipe.publish(2)
    with pytest.raises(UserError, match="failed on all 8 completions"):
        pipe.take(2)
    pipe.close()
    assert threading.active_count() >= 1 and pipe.thread is None


# ------------------------------------------------------------------------------------------ whole runs


def _lines(run):
    """Every metric except the machine's timings and how far ahead the collect happened to be."""
    skip = ("time/", "throughput/", "dist/compute_", "async/actor_wait_s", "async/engine_wait_s", "async/ahead")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in read_jsonl(run / "metrics.jsonl")]


def _raw_samples(run):
    return read_jsonl(run / "samples.jsonl")


def _samples(run):
    return [(r["rollout_batch"], r.get("completion")) for r in read_jsonl(run / "samples.jsonl")]


@pytest.mark.parametrize("extra", [["rollout.max_staleness=1", "lora.rank=4", "lora.alpha=8", "train.lr=1e-2"],
                                   ["rollout.max_staleness=2", "rollout.engine='graph'", "algorithm='dapo'",
                                    "dapo.max_resample_rounds=1", "dapo.overlong_cache=4"]])
@pytest.mark.slow
def test_the_threaded_collect_equals_the_one_in_turn_bit_for_bit(tiny_dir, tmp_path, extra):  # noqa: F811
    """A run whose rollouts are collected in a background thread writes exactly the metrics and samples of the same
    run collected in turn with the update (rollout.overlap = 'off'), with staleness 0, then 1.. eta: the lag is fixed,
    not a matter of timing. (LoRA adapters, merged into the engine's copy, in the first case; DAPO's dynamic sampling
    and the graph engine in the second.)"""
    if any(e.startswith("lora.") for e in extra):
        pytest.importorskip("peft")
    eta = int(extra[0].split("=")[1])
    runs = {}
    for overlap in ("thread", "off"):
        run = tmp_path / overlap
        Trainer(tiny_config(tiny_dir, "train.steps=10", f"rollout.overlap='{overlap}'", *extra), run).train()
        runs[overlap] = (_lines(run), _samples(run))
    assert runs["thread"] == runs["off"]
    lines = runs["thread"][0]
    assert [r["async/staleness_max"] for r in lines[::2]] == [min(j, eta) for j in range(5)]


def test_a_synchronous_run_is_not_changed_by_the_pipeline_code(tiny_dir, tmp_path):  # noqa: F811
    """max_staleness = 0 is the synchronous loop (its metrics carry no async/ keys); with 1 the first batch, sampled
    by the same initial policy and random stream, is the same, and the next ones are sampled by older policies."""
    sync, lag = tmp_path / "sync", tmp_path / "lag"
    Trainer(tiny_config(tiny_dir, "train.steps=6"), sync).train()
    Trainer(tiny_config(tiny_dir, "train.steps=6", "rollout.max_staleness=1"), lag).train()
    a, b = _lines(sync), _lines(lag)
    assert not any(k.startswith("async/") for k in a[0])
    assert _samples(sync)[:2] == _samples(lag)[:2] and _samples(sync)[2:] != _samples(lag)[2:]
    # the same tokens; the engine's own copy of the weights (here: the HF engine's replica, sampling in another
    # thread) sums its log-probs in another order, by ~1e-8
    first = {k: v for k, v in b[0].items() if not k.startswith("async/")}
    assert first.keys() == a[0].keys()
    assert all(v == pytest.approx(a[0][k], rel=1e-5, abs=1e-6) for k, v in first.items()), first


def test_a_stopped_run_collects_nothing_after_its_final_checkpoint(tiny_dir, tmp_path):  # noqa: F811
    """SIGTERM in the middle of an η = 2 run: the final checkpoint holds the engine and then stops it, so no batch is
    collected after it (one used to start once the checkpoint let the engine go, while the reward workers closed under
    it, its error lost): every batch collected was trained or saved, and the run resumes to the uninterrupted one."""
    import os
    import signal

    args = ("train.steps=16", "rollout.max_staleness=2")
    t = Trainer(tiny_config(tiny_dir, *args), tmp_path / "run")
    collected, collect = [], t.feed.collect
    t.feed.collect = lambda: collected.append(t.feed.next) or collect()
    once, close = t.rollout_batch_once, t.collector.close

    def batch(runlog):
        once(runlog)
        if t.state.rollout_batch == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    def slow_close():  # time enough for an engine let go to start the next batch
        time.sleep(0.5)
        close()

    t.rollout_batch_once, t.collector.close = batch, slow_close
    t.train()
    v = t.state.rollout_batch  # the batch the signal came in, or the next one
    assert t.stop_signal == "SIGTERM" and 3 <= v < 8 and t.feed.error is None
    payload = torch.load(tmp_path / "run" / "checkpoints" / f"step-{t.state.step:06d}" / "trainer_state.pt",
                         weights_only=False)
    assert sorted(collected) == list(range(v + len(payload["async_queue"])))
    Trainer(tiny_config(tiny_dir, *args), tmp_path / "run", resume=True).train()
    Trainer(tiny_config(tiny_dir, *args), tmp_path / "whole").train()
    assert _lines(tmp_path / "run") == _lines(tmp_path / "whole")


def test_a_run_killed_mid_pipeline_resumes_to_the_uninterrupted_run(tiny_dir, tmp_path):  # noqa: F811
    """A checkpoint saves the batch collected ahead; a run that loses everything after step 4 resumes from it and ends
    with the uninterrupted run's metrics, samples and weights, bit for bit (nothing lost, nothing sampled twice)."""
    args = ("train.steps=10", "rollout.max_staleness=1", "log.keep_checkpoints=10")
    a = Trainer(tiny_config(tiny_dir, *args), tmp_path / "a")
    a.train()
    run = tmp_path / "b"
    Trainer(tiny_config(tiny_dir, *args), run).train()
    payload = torch.load(run / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert [q.version for q in payload["async_queue"]] == [1]  # batch 2, sampled by the policy after batch 0
    for ckpt in (run / "checkpoints").iterdir():  # what a kill after step 4's checkpoint leaves
        if ckpt.name != "step-000004":
            shutil.rmtree(ckpt)
    b = Trainer(tiny_config(tiny_dir, *args), run, resume=True)
    b.train()
    assert _lines(tmp_path / "a") == _lines(run)
    assert _samples(tmp_path / "a") == _samples(run)
    for (name, x), y in zip(a.actor.model.named_parameters(), b.actor.model.parameters()):
        assert torch.equal(x, y), name


def test_the_sentinel_rolls_back_an_asynchronous_run(tiny_dir, tmp_path, caplog):  # noqa: F811
    """The reward collapses in batch 4, sampled by the policy after batch 2 under max_staleness = 1: the rollback goes
    to the checkpoint that resumes at batch 2 (whose policy sampled none of the collapsed batches; a synchronous run
    would take the one at batch 3), with the batch it had collected ahead, at the lower learning rate."""
    import trainer_rewards

    trainer_rewards._CALLS.clear()
    t = Trainer(tiny_config(tiny_dir, "train.steps=20", "sentinel.action='rollback'", "sentinel.reward_drop=0.5",
                            "sentinel.window=1", "rollout.max_staleness=1",
                            "rewards.functions=[{path='trainer_rewards:declining_after_four'}]"), tmp_path / "run")
    with caplog.at_level("WARNING", logger="gspo"), pytest.raises(UserError):
        t.train()
    assert "rolling back to step-000004" in caplog.text
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout_batch"] for r in rows][:6] == [0, 0, 1, 1, 2, 2]
    assert rows[4]["lr"] == 5e-4 and rows[4]["reward/mean"] == 1.0  # batch 2 from the checkpoint's queue, replayed


def test_the_decoupled_correction_sees_the_stale_samples(tiny_dir, tmp_path):  # noqa: F811
    """In fp32 on a CPU the engine computes the trainer's numbers, so the correction's weight pi_prox / pi_behave is
    exactly 1 in a synchronous run; under staleness 1 the samples of batch 1 on come from an older policy and it
    moves away from 1."""
    run = tmp_path / "run"
    Trainer(tiny_config(tiny_dir, "train.steps=6", "rollout.max_staleness=1", "loss.mismatch_correction='tis'",
                        "train.lr=1e-2"), run).train()
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows[0]["mismatch/weight_max"] == pytest.approx(1.0, abs=1e-6)
    assert max(abs(r["mismatch/weight_max"] - 1.0) for r in rows[2:]) > 1e-4


@pytest.mark.slow
def test_a_run_with_in_flight_updates_keeps_the_bound_and_resumes(tiny_dir, tmp_path):  # noqa: F811
    """rollout.in_flight = 'recompute' with the graph engine under max_staleness = 2: every batch's tokens are at most
    2 versions old (its logged mean and largest staleness), every sample records its tokens' versions, and a run that
    loses everything after step 4's checkpoint resumes and finishes (timing decides which version samples what, so
    not bit for bit)."""
    args = ("train.steps=6", "rollout.max_staleness=2", "rollout.in_flight='recompute'", "rollout.engine='graph'",
            "log.keep_checkpoints=10", "train.lr=1e-2", "rollout.max_new_tokens=48", "train.minibatches=1")
    run = tmp_path / "run"
    t = Trainer(tiny_config(tiny_dir, *args), run)
    t.train()
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["minibatch"] == 0]
    assert len(rows) == 6 and all(0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2 for r in rows)
    assert [r["async/staleness_max"] for r in rows[:2]] == [0, 1]  # the first batches: no older version exists
    for sample in _raw_samples(run):  # the tokens' versions, in runs: they cover the completion, within the bound
        runs = sample["versions"]
        assert sum(n for _, n in runs) == sample["length"]
        assert all(sample["rollout_batch"] - 2 <= v <= sample["rollout_batch"] for v, _ in runs)
    for ckpt in (run / "checkpoints").iterdir():
        if ckpt.name != "step-000004":
            shutil.rmtree(ckpt)
    Trainer(tiny_config(tiny_dir, *args), run, resume=True).train()
    resumed = [r for r in read_jsonl(run / "metrics.jsonl") if r["minibatch"] == 0]
    assert [r["rollout_batch"] for r in resumed] == [0, 1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 2 for r in resumed)


def test_bad_settings_are_refused_in_one_line(tiny_dir):  # noqa: F811
    with pytest.raises(UserError, match="rollout.max_staleness = -1 must be"):
        tiny_config(tiny_dir, "rollout.max_staleness=-1")
    with pytest.raises(UserError, match="rollout.overlap"):
        tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.overlap='process'")
    with pytest.raises(UserError, match="set rollout.overlap = 'off'"):
        build_config({}, ["rollout.max_staleness=1", "rollout.engine='vllm'"], device="cpu")
    with pytest.raises(UserError, match="rollout.decode_processes = -1 must be"):
        tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_processes=-1")
    with pytest.raises(UserError, match="rollout.decode_processes = 1 with rollout.max_staleness = 0"):
        tiny_config(tiny_dir, "rollout.decode_processes=1")
    with pytest.raises(UserError, match="routing_replay = 'rollout' .R3. is not built"):
        tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_processes=1", "moe.routing_replay='rollout'")
    for extra, why in [([], "rollout.max_staleness = 0 samples"), (["rollout.max_staleness=1", "rollout.overlap='off'"],
                                                                   "rollout.overlap = 'off'"),
                       (["rollout.max_staleness=1", "rollout.decode_processes=1"], "decode processes"),
                       (["rollout.max_staleness=1", "env.tools=['gspo.envs.builtin:calculator']"], "multi-turn"),
                       (["rollout.max_staleness=1", "moe.routing_replay='rollout'"], "R3")]:
        with pytest.raises(UserError, match=f"rollout.in_flight = 'keep' is not built for this run: {why}"):
            tiny_config(tiny_dir, "rollout.in_flight='keep'", *extra)
    with pytest.raises(UserError, match="rollout.in_flight = 'on' is not one of off, keep, recompute"):
        tiny_config(tiny_dir, "rollout.in_flight='on'")
    with pytest.raises(UserError, match="the HFEngine does not; set rollout.engine = 'graph'"):
        Trainer(tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.in_flight='keep'", "rollout.engine='hf'"),
                tiny_dir.parent / "refused").train()
    from gspo.parallel.roles import check

    with pytest.raises(UserError, match="needs more processes than that.*gspo train --nproc 3"):
        check(tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_processes=2"), 2)
    with pytest.raises(UserError, match="rollout.decode_gpu = 'mine' is not one of own, shared"):
        tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_processes=1", "rollout.decode_gpu='mine'")
    with pytest.raises(UserError, match="this run has none; set rollout.decode_processes = 1"):
        tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_gpu='shared'")


def test_shared_gpus_place_each_decode_process_on_a_trainers_gpu(tiny_dir, monkeypatch):  # noqa: F811
    """rollout.decode_gpu = 'shared': trainer t on GPU t, decode process i on trainer i mod T's, each process capped at
    its share of the GPU; one machine only; on GPUs one trainer, without expandable segments."""
    from gspo.parallel.roles import placement

    cfg = tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_processes=3", "rollout.decode_gpu='shared'")
    places = []
    for rank in range(5):  # 2 trainers + 3 decode processes
        monkeypatch.setenv("WORLD_SIZE", "5")
        monkeypatch.setenv("RANK", str(rank))
        places.append(placement(cfg))
    assert places == [(0, 1 / 3), (1, 1 / 2), (0, 1 / 3), (1, 1 / 2), (0, 1 / 3)]
    own = tiny_config(tiny_dir, "rollout.max_staleness=1", "rollout.decode_processes=3")
    assert placement(own) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(UserError, match="needs the whole job on one machine .* this job spans 5; set"):
        placement(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg.model.device = "cuda"  # on GPUs: one trainer only, and no expandable segments
    with pytest.raises(UserError, match="built for one trainer on one GPU, and this job has 2 .*launch --nproc 4 for 1 "
                                        "trainer \\+ 3 decode processes"):
        placement(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert placement(cfg) == (0, 1 / 4)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(UserError, match="unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF"):
        placement(cfg)


def test_shared_weights_wait_for_a_slot_to_be_read_and_a_torn_slot_fails():
    """SharedWeights: version v goes into slot v mod (eta + 1), stamped; a slot whose version the decode processes
    have not loaded is reserved only after read_through says so (or not at all once the run failed); a decode process
    reads a slot through its handles, and a slot written while it copies (or holding another version) fails in one
    line."""
    from types import SimpleNamespace

    from gspo.collect.decoder import Decoder
    from gspo.feed.transport import SharedWeights, map_shared, pack

    def version(v):
        return pack([("w", torch.full((2, 3), float(v))), ("b", torch.full((4,), v, dtype=torch.bfloat16))])

    shared = SharedWeights(eta=1, device=torch.device("cpu"), decoders=1)
    try:
        meta, _ = version(0)
        mapped, sent = {}, {}  # each slot's view, and the handles written with it the first time
        for v in range(2):
            slot = shared.reserve(v, failed=lambda: False)
            sent[slot] = shared.write(v, slot, version(v)[1])
            assert slot == v and len(sent[slot]) == 1
            mapped[slot] = map_shared(sent[slot][0])
            assert mapped[slot][-1].item() == v and torch.equal(mapped[slot][0], version(v)[1][0])
        shared.read_through(0)  # version 0 loaded: slot 0 may take version 2
        assert shared.reserve(2, failed=lambda: False) == 0
        assert shared.write(2, 0, version(2)[1]) is None  # (mapped already)
        assert mapped[0][-1].item() == 2 and mapped[0][0][0].item() == 2.0  # the decode process sees it
        stop, got = threading.Event(), []
        writer = threading.Thread(target=lambda: got.append(shared.reserve(3, failed=stop.is_set)))
        writer.start()  # slot 1 holds version 1 until read_through says it was loaded
        writer.join(0.5)
        assert writer.is_alive()
        shared.read_through(1)
        writer.join(10)
        assert got == [1]
        shared.write(3, 1, version(3)[1])
        giving_up = threading.Thread(target=lambda: got.append(shared.reserve(4, failed=stop.is_set)))
        giving_up.start()  # slot 0 again, version 2 not loaded: waits until the run fails
        giving_up.join(0.5)
        assert giving_up.is_alive()
        stop.set()
        giving_up.join(10)
        assert got == [1, None] and mapped[0][-1].item() == 2  # gave up, reserved nothing

        loaded = []
        decoder = Decoder.__new__(Decoder)
        decoder.slots, decoder.roles = {}, SimpleNamespace(index=0)
        decoder.runtime = SimpleNamespace(device=torch.device("cpu"))
        decoder.engine = SimpleNamespace(sync_weights=lambda w: loaded.append({k: t.clone() for k, t in w}))
        decoder._load_shared(3, meta, 1, sent[1])
        assert loaded[-1]["w"][0, 0].item() == 3.0 and loaded[-1]["b"].dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="slot 1 held version 3 then 3 while this decode process loaded "
                                               "version 5: trainer 0 wrote it too soon"):
            decoder._load_shared(5, meta, 1, None)

        def overwritten(weights):  # trainer 0 writes version 5 into the slot while the decode process copies it
            shared.write(5, 1, version(5)[1])
            loaded.append(dict(weights))

        decoder.engine = SimpleNamespace(sync_weights=overwritten)
        with pytest.raises(RuntimeError, match="slot 1 held version 3 then 5 while this decode process loaded "
                                               "version 3: trainer 0 wrote it too soon"):
            decoder._load_shared(3, meta, 1, None)
    finally:
        shared.close()
    assert not shared.dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp"])  # (FSDP2 trainers beside a collect: the decode-process tests)
def test_two_processes_collect_in_the_background_as_in_turn(tiny_dir, tmp_path, strategy):  # noqa: F811
    """Under torchrun (2 processes on gloo), each process's engine thread samples its share of every batch and gathers
    the batch through a group of its own while the update's collectives run on the default group: the run equals the
    same job collected in turn with the update, bit for bit, and (DDP) a kill after step 4's checkpoint resumes to it:
    a DDP resume restores AdamW's moments, which it once lost (FSDP2's resume is test_dist's)."""
    from test_dist import _overrides, _torchrun, _train

    args = ["rollout.max_staleness=1", "train.steps=8", f"dist.strategy='{strategy}'", "log.keep_checkpoints=10"]
    runs = {}
    for overlap in ("thread", "off"):
        run = tmp_path / overlap
        done = _train(tmp_path, _torchrun(2), _overrides(tiny_dir, *args, f"rollout.overlap='{overlap}'"),
                      "--run-dir", str(run))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[overlap] = (_lines(run), _samples(run))
    assert runs["thread"] == runs["off"]
    assert [r["async/staleness_max"] for r in runs["thread"][0][::2]] == [0, 1, 1, 1]
    if strategy != "ddp":
        return
    run = tmp_path / "thread"
    for ckpt in (run / "checkpoints").iterdir():
        if ckpt.name != "step-000004":
            shutil.rmtree(ckpt)
    done = _train(tmp_path, _torchrun(2), _overrides(tiny_dir, *args), "--resume", "--run-dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (_lines(run), _samples(run)) == runs["off"]


@pytest.mark.slow
def test_in_flight_updates_under_torchrun_keep_the_bound_in_every_process(tiny_dir, tmp_path):  # noqa: F811
    """rollout.in_flight = 'recompute' under torchrun (2 processes on gloo, DDP): each process's engine thread loads the
    versions its own trainer thread publishes, at its own steps, so the two shares of a batch may be sampled by
    different versions (a first run swapped batch 2's two shares after 9 and 7 tokens); the gathered batch still keeps
    every token within the bound (the logged mean and largest staleness), and the samples of both shares record their
    tokens' versions, each within the bound and only ever moving to a newer one. (Whether a swap lands inside a
    batch is timing's: the test asserts what holds either way.)"""
    from test_dist import _overrides, _torchrun, _train

    args = ["rollout.max_staleness=2", "rollout.in_flight='recompute'", "rollout.engine='graph'", "train.steps=6",
            "train.minibatches=1", "train.lr=1e-2", "rollout.max_new_tokens=48", "dist.strategy='ddp'",
            "log.samples_per_batch=1000"]
    run = tmp_path / "run"
    done = _train(tmp_path, _torchrun(2), _overrides(tiny_dir, *args), "--run-dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["minibatch"] == 0]
    assert len(rows) == 6 and all(0 <= r["async/staleness_mean"] <= r["async/staleness_max"] <= 2 for r in rows)
    assert [r["async/staleness_max"] for r in rows[:2]] == [0, 1]
    samples = _raw_samples(run)
    per_batch = {}
    for sample in samples:
        runs = sample["versions"]
        assert sum(n for _, n in runs) == sample["length"]
        assert all(sample["rollout_batch"] - 2 <= v <= sample["rollout_batch"] for v, _ in runs)
        assert [v for v, _ in runs] == sorted({v for v, _ in runs})  # a swap only moves a row to a newer version
        per_batch[sample["rollout_batch"]] = per_batch.get(sample["rollout_batch"], 0) + 1
    assert per_batch == {b: 6 for b in range(6)}  # one per prompt of the gathered batch: both shares of 6 (_overrides)


# ------------------------------------------------------------------------------------------ decode processes


def test_a_checkpoint_resumed_into_another_layout_has_its_streams_before_any_batch_arrives():
    """A checkpoint resumed into another number of decode processes seeds their streams afresh from (seed, step,
    index). The trainers compute those streams themselves, so a checkpoint written before any batch arrives (a resume
    within the run's last η + 1 batches, whose final checkpoint comes first) has them too: it used to fail on an
    assertion after the run had finished."""
    from gspo.feed.remote import RemoteCollector

    one_process = {"generator": torch.Generator().manual_seed(5).get_state(), "data": {"position": 7},
                   "skipped_prompts": 1, "step": 12, "world_size": 1}
    for payload, decoders in ((one_process, 2), ({**one_process, "world_size": 2}, 1),
                              ({**one_process, "decoder_generators": [one_process["generator"]] * 3}, 2)):
        c = RemoteCollector(decoders, seed=3, device=torch.device("cpu"))
        c.load_state_dict(payload)
        state = c.state_dict()
        want = [torch.Generator().manual_seed(3 + 1_000_003 * 12 + i).get_state() for i in range(decoders)]
        assert all(torch.equal(a, b) for a, b in zip(state["decoder_generators"], want, strict=True))
        assert torch.equal(state["generator"], want[0]) and state["data"] == {"position": 7}
    same = RemoteCollector(1, seed=3, device=torch.device("cpu"))  # one process's stream: the one decode process's
    same.load_state_dict(one_process)
    assert torch.equal(same.state_dict()["generator"], one_process["generator"])


@pytest.mark.slow
def test_a_decode_process_computes_the_one_process_run(tiny_dir, tmp_path):  # noqa: F811
    """rollout.decode_processes = 1 under torchrun (2 processes on gloo): process 1 only samples, process 0 only
    trains, the weights travel after every update. The same fixed lag, so the job writes the one-process run's metrics
    and samples bit for bit (eta = 2: two versions in flight), whether the weights travel by broadcast or through
    shared memory (rollout.decode_gpu = 'shared': its 3 slots are reused by versions 3 and 4). A kill after step 4's
    checkpoint resumes to it in one process (the checkpoint is a one-process run's, plus the decode processes'
    streams)."""
    from test_dist import _overrides, _torchrun, _train

    args = ["rollout.max_staleness=2", "train.steps=14", "log.keep_checkpoints=10"]
    one, two, shared = tmp_path / "one", tmp_path / "two", tmp_path / "shared"
    done = _train(tmp_path, [sys.executable], _overrides(tiny_dir, *args), "--run-dir", str(one))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = (_lines(one), _samples(one))
    done = _train(tmp_path, _torchrun(2), _overrides(tiny_dir, *args, "rollout.decode_processes=1",
                                                     "rollout.decode_gpu='shared'"), "--run-dir", str(shared))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (_lines(shared), _samples(shared)) == expected
    done = _train(tmp_path, _torchrun(2), _overrides(tiny_dir, *args, "rollout.decode_processes=1"), "--run-dir",
                  str(two))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (_lines(two), _samples(two)) == expected
    assert [r["async/staleness_max"] for r in expected[0][::2]] == [0, 1, 2, 2, 2, 2, 2]
    payload = torch.load(two / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    assert [q.version for q in payload["async_queue"]] == [0, 1, 2]  # batches 2-4: what the decode process owed
    assert len(payload["decoder_generators"]) == 1
    # resumed in one process (a restore into decode processes: the rollback test's)
    for ckpt in (two / "checkpoints").iterdir():
        if ckpt.name != "step-000004":
            shutil.rmtree(ckpt)
    done = _train(tmp_path, [sys.executable], _overrides(tiny_dir, *args), "--resume", "--run-dir", str(two))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (_lines(two), _samples(two)) == expected


@pytest.mark.slow
def test_two_trainers_and_a_decode_process_and_a_failing_one(tiny_dir, tmp_path):  # noqa: F811
    """3 processes: 2 trainers (FSDP2 among themselves) and 1 decode process. The batches sampled by the first policy
    are the one-process run's (the decode process's stream is its); every step is logged once. And a reward function
    that fails on every completion in the decode process ends the job in its one line."""
    from test_dist import _overrides, _torchrun, _train

    args = ["rollout.max_staleness=1", "train.steps=6", "dist.strategy='fsdp'"]
    runs = {}
    for n, launcher in ((1, [sys.executable]), (3, _torchrun(3))):
        run = tmp_path / f"n{n}"
        done = _train(tmp_path, launcher, _overrides(tiny_dir, *args, f"rollout.decode_processes={int(n > 1)}"),
                      "--run-dir", str(run))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[n] = run
    assert [r["step"] for r in read_jsonl(runs[3] / "metrics.jsonl")] == list(range(1, 7))
    first = [s for s in _samples(runs[1]) if s[0] < 2]
    assert first == [s for s in _samples(runs[3]) if s[0] < 2] and first
    failing = _overrides(tiny_dir, *args, "rollout.decode_processes=1",
                         "rewards.functions=[{path='reward_fixtures:always_fails'}]")
    done = _train(tmp_path, _torchrun(2), failing, "--run-dir", str(tmp_path / "fails"))
    assert done.returncode != 0 and "'always_fails' failed on all" in done.stderr, done.stderr[-3000:]


# ------------------------------------------------------------------------------------------ with the other features

from test_dist import turn_taking_dir  # noqa: E402,F401  (module fixtures)
from test_moe import moe_dir  # noqa: E402,F401


@pytest.mark.slow
@pytest.mark.parametrize("case", ["env", "moe_r3"])
def test_environments_and_routing_replay_collect_in_the_background_as_in_turn(case, tmp_path, request):
    """A multi-turn environment (env_fixtures:Echo: tools between the engine's turns, per-turn credit) and an MoE with
    Routing Replay R3 (the graph engine records the routes of the version that sampled each token, replayed in the old
    log-prob pass and the update), asynchronously: the threaded run equals the one in turn, bit for bit."""
    if case == "env":
        model = request.getfixturevalue("turn_taking_dir")
        extra = ["env.path='env_fixtures:Echo'", "env.workers=1", "env.max_turn_tokens=4", "rollout.max_new_tokens=40",
                 "rewards.functions=[]", "algorithm='gspo_token'", "loss.step_credit='env'"]
    else:
        model = request.getfixturevalue("moe_dir")
        extra = ["moe.routing_replay='rollout'", "rollout.engine='graph'", "rollout.max_new_tokens=6",
                 "rewards.functions=[{path='trainer_rewards:dyadic_length'}]", "train.lr=1e-2"]
    base = [f"model.name='{model}'", "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
            "train.minibatches=2", "train.steps=6", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=2",
            "rollout.max_staleness=1", *extra]
    runs = {}
    for overlap in ("thread", "off"):
        run = tmp_path / overlap
        Trainer(build_config({}, [*base, f"rollout.overlap='{overlap}'"], device="cpu"), run).train()
        runs[overlap] = (_lines(run), _samples(run))
    assert runs["thread"] == runs["off"]
    lines = runs["thread"][0]
    assert [r["async/staleness_max"] for r in lines[::2]] == [0, 1, 1]
    if case == "env":
        assert all(r["env/turns_mean"] > 1 for r in lines)
    else:
        assert all(r.get("moe/engine_flip_rate") is not None and r.get("moe/flip_rate") is not None for r in lines)


@pytest.mark.parametrize(("decode_gpu", "steps", "lines"), [("own", 16, 4), ("shared", 8, 7)],
                         ids=["own-mid-run", "shared-at-the-end"])
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGSTOP"])  # (a killed process: test_dist's test, the same launcher path)
def test_a_lost_decode_process_ends_the_job_in_one_line_and_it_resumes(tiny_dir, tmp_path, fault,  # noqa: F811
                                                                       decode_gpu, steps, lines):
    """The decode process of `gspo train --nproc 2` (1 trainer + 1 decode process) is SIGSTOPped (it hangs): the
    trainer gives up within dist.timeout_s (the groups the job makes wait that long, not torch's 30 minutes) and the
    launcher's one line names the cause, whether the weights travel by broadcast or through shared memory; --resume
    trains to the end with every step logged once, in one process (the job's checkpoint is a one-process run's,
    whichever way its weights travelled). Mid-run (batches 4-7 still owed), and at the end: once the last batch is
    in (line 7 of 8, before the final checkpoint and the stop order) the decode process has nothing left to send but
    its word that it stopped, and the trainer used to finish without it, leaving torchrun waiting for it for ever."""
    import os
    import signal

    from test_dist import _overrides, _train, _two_processes_after, check_run_dir

    run = tmp_path / "run"
    overrides = _overrides(tiny_dir, f"train.steps={steps}", "dist.timeout_s=10", "rollout.max_staleness=1")
    proc, workers = _two_processes_after(tmp_path, run, [*overrides, "rollout.decode_processes=1",
                                                         f"rollout.decode_gpu='{decode_gpu}'"], lines=lines)
    os.kill(workers[1], getattr(signal, fault))  # process 1: the decode process
    if fault == "SIGSTOP":  # once the trainer has given up, end the hung one (torchrun would wait 30 s to)
        deadline = time.time() + 90
        while time.time() < deadline and os.path.exists(f"/proc/{workers[0]}"):
            time.sleep(0.1)
        os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("gspo: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    if fault == "SIGKILL":
        assert proc.returncode == 1 and f"(pid {workers[1]}) was killed by SIGKILL" in lines[0], err[-3000:]
    else:
        assert proc.returncode == 2 and "lost the others" in lines[0], err[-3000:]
    again = _train(tmp_path, [sys.executable], [*overrides, f"rollout.decode_processes={int(fault == 'SIGKILL')}"],
                   "--resume", "--run-dir", str(run), *(["--nproc", "2"] if fault == "SIGKILL" else []))
    assert again.returncode == 0, again.stderr[-3000:]
    check_run_dir(run, steps)


@pytest.mark.parametrize("decode_gpu", ["own", "shared"])
def test_the_sentinel_rolls_back_a_job_with_a_decode_process(tiny_dir, tmp_path, decode_gpu):  # noqa: F811
    """A reward collapse in a job of 1 trainer + 1 decode process: the trainer takes the batches the decode process
    owes the abandoned timeline, restarts it from the checkpoint before the decline (its collect state with it), and
    after the rollbacks the sentinel allows stops the job in its one line; nothing hangs; by broadcast, and through
    shared memory (rollout.decode_gpu = 'shared'), whose slots every new timeline reuses."""
    from test_dist import _overrides, _torchrun, _train

    overrides = _overrides(tiny_dir, "train.steps=20", "rollout.max_staleness=1", "rollout.decode_processes=1",
                           f"rollout.decode_gpu='{decode_gpu}'", "sentinel.action='rollback'", "sentinel.reward_drop=0.5", "sentinel.window=1",
                           "log.keep_checkpoints=10",
                           "rewards.functions=[{path='trainer_rewards:declining_after_four'}]")
    done = _train(tmp_path, _torchrun(2), overrides, "--run-dir", str(tmp_path / "run"))
    assert done.returncode != 0 and "Collapse sentinel stopped the run" in done.stderr, done.stderr[-3000:]
    assert "rolling back to step-" in done.stderr, done.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # the abandoned lines rewound, each step once


def test_a_checkpoint_written_before_the_feed_loads_its_queued_batches():
    """Checkpoints of asynchronous runs written before gspo.feed pickled their queued batches as
    gspo.train.pipeline.Queued: the checkpoint reader maps that class to where it lives now, and only that one."""
    import io
    import pickle

    from gspo.feed.base import Queued
    from gspo.train import checkpoint

    payload = {"async_queue": [Queued(batch=None, version=3, engine_wait_s=0.5)]}
    buf = io.BytesIO()
    torch.save(payload, buf, pickle_protocol=0, _use_new_zipfile_serialization=False)  # class names as text
    old = buf.getvalue().replace(b"gspo.feed.base", b"gspo.train.pipeline")
    assert b"gspo.train.pipeline\nQueued" in old
    with pytest.raises(ModuleNotFoundError):
        torch.load(io.BytesIO(old), weights_only=False)
    loaded = torch.load(io.BytesIO(old), weights_only=False, pickle_module=checkpoint._moved_classes)
    assert loaded["async_queue"] == payload["async_queue"]
    other = pickle.dumps(Queued(None, 1), protocol=0).replace(b"Queued", b"Gone")  # not a moved class: not found
    with pytest.raises(AttributeError):
        checkpoint._MovedClasses(io.BytesIO(other)).load()
