"""Data-parallel training with real torchrun processes on gloo (CPU): FSDP2 shards the policy, a batch trained by two
processes equals the batch trained by one, sharded checkpoints resume at other process counts, a killed process
leaves a resumable run, and two torchrun agents meet through a c10d rendezvous as two nodes would."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo.runlog.metrics import read_jsonl

from test_faults import check_run_dir
from test_trainer import tiny_dir  # noqa: F401  (the module fixture)

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]), "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(tiny_dir, *extra: str) -> list[str]:
    # 6 prompts x 2 completions, 2 minibatches of 6: shared evenly by 1, 2 or 3 processes.
    return [f"model.name='{tiny_dir}'", "model.device='cpu'", "rollout.prompts_per_batch=6", "rollout.group_size=2",
            "rollout.max_new_tokens=6", "train.minibatches=2", "train.lr=1e-3", "rewards.workers=0",
            "log.progress=false", "log.checkpoint_every=1", "dist.timeout_s=60",
            "rewards.functions=[{path='trainer_rewards:dyadic_length'}]", *extra]


def _train(cwd: Path, launcher: list[str], overrides: list[str], *flags: str, timeout: int = 300):
    return subprocess.run([*launcher, "-m", "gspo.cli", "train", *overrides, *flags], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _torchrun(n: int) -> list[str]:
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={n}"]


@pytest.fixture(scope="module")
def one_process_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "one.pt"
    one = subprocess.run([sys.executable, str(TESTS / "dist" / "step_worker.py"), str(out)], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_processes_train_a_batch_as_one_does(one_process_steps, tmp_path, strategy):
    """Every preset (and KL with micro-batches, engine log-probs over 4 minibatches, MoE with and without Routing Replay
    R2, LoRA): one rollout batch's update on
    the same fixed batch -- rows of uneven lengths, so the two processes' slices hold different token counts -- gives
    the same losses, metrics, gradients and weights on two processes (FSDP2 shards, or DDP copies) as in one."""
    worker = str(TESTS / "dist" / "step_worker.py")
    two = subprocess.run([*_torchrun(2), worker, str(tmp_path / "two.pt"), strategy], env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = one_process_steps, torch.load(tmp_path / "two.pt")
    assert list(a) == list(b) and len(a) == 11
    for case in a:
        for x, y in zip(a[case]["steps"], b[case]["steps"], strict=True):
            # the processes' timing to their gradients exists under torchrun only
            assert {"dist/compute_max_s", "dist/compute_min_s"} <= set(y), case
            y = {k: v for k, v in y.items() if not k.startswith("dist/")}
            assert set(x) == set(y), case
            for key in x:
                if key.startswith("time/") or x[key] != x[key]:
                    continue
                assert y[key] == pytest.approx(x[key], rel=2e-4, abs=1e-6), (case, key)
        for name, grad in a[case]["grads"].items():  # the first step's gradient, before AdamW touches anything
            torch.testing.assert_close(b[case]["grads"][name], grad, rtol=1e-4, atol=1e-6 * a[case]["grad_scale"])
        for name, w in a[case]["weights"].items():  # after every step (lr 1e-2: AdamW moves a weight ~1e-2 a step)
            torch.testing.assert_close(b[case]["weights"][name], w, rtol=0, atol=5e-4)
        torch.testing.assert_close(b[case]["old_logprobs"], a[case]["old_logprobs"], rtol=0, atol=1e-5)


def test_auto_strategy_replicates_what_fits_half_a_device_and_shards_the_rest(monkeypatch):
    """dist.strategy = 'auto': DDP while 18 bytes a parameter (22 with a reference model) take at most half of the
    device's memory -- here the host's, shared by its processes -- FSDP beyond; an explicit choice is kept."""
    from gspo.parallel import strategy
    from conftest import tiny_llama

    model = tiny_llama(vocab_size=512, seed=0)
    n = sum(p.numel() for p in model.parameters())
    cpu = torch.device("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    page = os.sysconf("SC_PAGE_SIZE")
    fits, fits_ref = -(-2 * 2 * 18 * n // page), -(-2 * 2 * 22 * n // page)  # pages: two processes, half each
    for pages, reference, expected in [(fits, False, "ddp"), (fits - 1, False, "fsdp"), (fits, True, "fsdp"),
                                       (fits_ref, True, "ddp")]:
        monkeypatch.setattr(os, "sysconf", lambda key, pages=pages: page if key == "SC_PAGE_SIZE" else pages)
        assert strategy.choose_strategy("auto", model, cpu, reference=reference) == expected, (pages, reference)
        assert strategy.choose_strategy("fsdp", model, cpu, reference=reference) == "fsdp"
        assert strategy.choose_strategy("ddp", model, cpu, reference=reference) == "ddp"


def test_gather_pickling_round_trips_every_tensor_kind():
    """What gather_objects sends (comm.dumps, tensors as numpy arrays) loads back equal, with dtype and shape: bool,
    int64, float32 and 0-dim tensors, a strided view (only the view travels), bfloat16 (as its int16 bits), nested
    in dataclasses, lists and dicts; the loaded tensors are writable and share nothing with the sender's. A tensor
    that requires grad keeps torch's pickling."""
    import pickle

    from gspo.parallel.comm import dumps
    from gspo.collect.stage import Scores

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sent = {"ids": torch.randint(0, 50_000, (3, 5)), "mask": torch.rand(3, 5) > 0.5, "view": base[:, ::2],
            "scalar": torch.tensor(2.5), "bf16": torch.randn(4, dtype=torch.bfloat16)[::2], "empty": torch.zeros(0, 7),
            "bf16_scalar": torch.tensor(-3.25, dtype=torch.bfloat16), "grad": torch.ones(2, requires_grad=True),
            "nested": [Scores(torch.rand(3), {"f": torch.rand(3)}), (1, "text", None)]}
    got = pickle.loads(dumps(sent))
    for key in ("ids", "mask", "view", "scalar", "bf16", "empty", "bf16_scalar", "grad"):
        assert got[key].dtype == sent[key].dtype and torch.equal(got[key], sent[key]), key
    assert got["grad"].requires_grad
    assert len(dumps(base[:, ::2])) < len(pickle.dumps(base[:, ::2]))  # torch's pickling sends the whole storage
    assert torch.equal(got["nested"][0].per_function["f"], sent["nested"][0].per_function["f"])
    assert got["nested"][1] == (1, "text", None)
    got["view"].add_(1)  # writable, and a copy
    assert torch.equal(base[:, ::2], torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2])


def test_largest_micro_batches_by_hand():
    """Rows 0..7 with 100, 90, 1, 1, 1, 1, 80, 70 tokens, 2 processes, micro-batches of 2: process 0 holds rows 0-3
    (micro-batches of 190 and 2 tokens), process 1 rows 4-7 (2 and 150); each pads its j-th micro-batch to the larger:
    190, then 150. A second minibatch in reverse order gives 150 then 190. One process's plan has no such lengths."""
    from gspo.parallel import plan

    tokens = torch.tensor([100, 90, 1, 1, 1, 1, 80, 70])
    rows = torch.arange(8)
    assert plan.largest_micro_batches([rows, rows.flip(0)], tokens, 2, 2) == [[190, 150], [150, 190]]
    assert plan.largest_micro_batches([rows], tokens, 2, 4) == [[192]]
    assert [c.tolist() for c in plan.micro_batches(rows, 1, 2, 2)] == [[4, 5], [6, 7]]


def test_flat_gradients_stay_views_that_backward_accumulates_into():
    """DDP's gradients as views of one flat buffer (what the all-reduce sums in place): every trainable parameter's
    .grad is its slice of the buffer, two backwards accumulate into it in place (the buffer holds their sum), zeroing
    the buffer zeroes every .grad, and a frozen parameter gets none."""
    from gspo.parallel import ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    (flat,) = ddp.flat_gradients(params)
    assert flat.numel() == sum(p.numel() for p in params) and model[1].bias.grad is None
    x = torch.randn(5, 3)
    expected = [torch.autograd.grad(model(x).square().sum(), p)[0] * 2 for p in params]  # two equal backwards
    for _ in range(2):
        model(x).square().sum().backward()
    offset = 0
    for p, e in zip(params, expected):
        assert p.grad.data_ptr() == flat[offset:].data_ptr()  # still the buffer's slice
        torch.testing.assert_close(p.grad, e)
        offset += p.numel()
    torch._foreach_zero_([flat])
    assert all(not p.grad.any() for p in params)


def test_balanced_slices_hold_near_equal_tokens_by_hand():
    """Rows 0..7 with 100, 90, 1, 1, 1, 1, 80, 70 tokens on 2 processes: contiguous halves would hold 192 and 152
    tokens. Longest first to the lighter slice with room: 0 -> a (100), 1 -> b (90), 6 -> b (170), 7 -> a (170),
    then the ones alternate (ties to the first slice): a = [0, 7, 2, 4], b = [1, 6, 3, 5], 172 tokens each."""
    from gspo.parallel import plan

    tokens = torch.tensor([100, 90, 1, 1, 1, 1, 80, 70])
    assert plan.balance(torch.arange(8), tokens, 2).tolist() == [0, 7, 2, 4, 1, 6, 3, 5]
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    lengths = torch.randint(1, 300, (64,), generator=torch.Generator().manual_seed(1))
    out = plan.balance(rows, lengths, 4)
    assert sorted(out.tolist()) == sorted(rows.tolist())  # the same rows, reordered
    loads = [int(lengths[out[i * 16:(i + 1) * 16]].sum()) for i in range(4)]
    assert max(loads) - min(loads) <= int(lengths.max())


def test_balance_matches_the_plain_greedy_on_random_batches():
    """``dist.balance`` keeps its open slices in a heap; on random batches (many ties among short rows) it deals
    exactly what the plain rule deals: longest row first, to the open slice with the fewest tokens, lowest index on a
    tie."""
    from gspo.parallel import plan

    def plain(rows, tokens, world):
        cap, count = len(rows) // world, tokens.tolist()
        slices, load = [[] for _ in range(world)], [0] * world
        for r in sorted(rows.tolist(), key=lambda r: (-count[r], r)):
            s = min((i for i in range(world) if len(slices[i]) < cap), key=lambda i: (load[i], i))
            slices[s].append(r)
            load[s] += count[r]
        return [r for s in slices for r in s]

    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        world = int(torch.randint(1, 6, (1,), generator=g))
        n = world * int(torch.randint(1, 20, (1,), generator=g))
        tokens = torch.randint(1, 1 + int(torch.randint(1, 400, (1,), generator=g)), (n + 5,), generator=g)
        rows = torch.randperm(n + 5, generator=g)[:n]
        assert plan.balance(rows, tokens, world).tolist() == plain(rows, tokens, world), trial


@pytest.mark.slow
def test_checkpoints_resume_at_another_number_of_processes(tiny_dir, tmp_path):  # noqa: F811
    """A one-process run (HF weights, AdamW state in trainer_state.pt) resumes under `gspo train --nproc 2`, which
    writes sharded checkpoints (FSDP2: DCP, each process's RNG, an HF export) and profiles its batch on both processes;
    that run resumes under one process. Every resume warns that the sampling streams are new, every run finishes with
    each step logged once, the lines before a resume are kept, and every complete checkpoint loads as an HF model. The
    runs are PPO: the value model and its optimizer are sharded too, and cross process counts with the policy. (A
    resume at three processes, DDP: test_async's decode-process test; the 3-process leg here went for CI time.)"""
    run = tmp_path / "run"
    ppo = "algorithm='ppo'"
    first = _train(tmp_path, [sys.executable], _overrides(tiny_dir, ppo, "train.steps=2"), "--run-dir", str(run))
    assert first.returncode == 0, first.stderr[-3000:]
    two = _train(tmp_path, [sys.executable], _overrides(tiny_dir, ppo, "train.steps=4", "dist.strategy='fsdp'",
                                                        "log.profile_batch=2"), "--nproc", "2", "--resume", "--run-dir",
                 str(run))
    assert "FSDP2: the value model is sharded over 2 processes" in two.stderr
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resumed on 2 process(es) from a checkpoint written by 1" in two.stderr
    rows = check_run_dir(run, 4)
    ckpt = run / "checkpoints" / "step-000004"
    assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "rank-00001.pt").is_file()
    assert '"LlamaForCausalLM"' in (ckpt / "config.json").read_text()  # not FSDP's class name
    for rank in range(2):  # the profiled batch: every process's stages, the gradient sum and the gather among them
        table = (run / "profile" / f"rank{rank}.txt").read_text()
        assert all(f"gspo/{s}" in table for s in ("collect", "gather_objects", "sum_gradients", "reduce_metrics"))
        assert (run / "profile" / f"rank{rank}.trace.json.gz").stat().st_size > 0

    one = _train(tmp_path, [sys.executable], _overrides(tiny_dir, ppo, "train.steps=6"), "--resume", "--run-dir",
                 str(run))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed on 1 process(es) from a checkpoint written by 2" in one.stderr
    resumed = check_run_dir(run, 6)
    assert resumed[:4] == rows  # the lines before the resume are kept as they were
    assert all("critic/value_loss" in r for r in resumed)
    assert resumed[4]["data/position"] == resumed[5]["data/position"] > rows[-1]["data/position"]


def test_ppo_value_model_shards_under_bf16_compute(tiny_dir, tmp_path):  # noqa: F811
    """PPO under FSDP2 with bf16 compute over fp32 masters (a GPU's default): the layers gather bf16 weights, and the
    value model's scalar head, which computes in fp32 outside autocast, gathers fp32 ones (a unit of its own)."""
    two = _train(tmp_path, [sys.executable], _overrides(tiny_dir, "algorithm='ppo'", "train.steps=2",
                                                        "dist.strategy='fsdp'", "model.precision='bf16-autocast'"),
                 "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    assert two.returncode == 0, two.stderr[-3000:]
    rows = check_run_dir(tmp_path / "run", 2)
    assert all(math.isfinite(r["critic/value_loss"]) for r in rows)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _two_processes_after(cwd: Path, run: Path, overrides: list[str], lines: int):
    """`gspo train --nproc 2` started in the background (in a session of its own, as a shell starts a job), once
    ``lines`` metrics lines are written: the launcher process and the pids of its two workers (torchrun's
    children)."""
    proc = subprocess.Popen([sys.executable, "-m", "gspo.cli", "train", *overrides, "--nproc", "2", "--run-dir",
                             str(run)], cwd=cwd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and len(read_jsonl(run / "metrics.jsonl")
                                                                   if (run / "metrics.jsonl").exists() else []) < lines:
        time.sleep(0.05)
    workers = sorted(w for torchrun in _children(proc.pid) for w in _children(torchrun))
    assert proc.poll() is None and len(workers) == 2, "the run finished or never started"
    return proc, workers


@pytest.mark.slow
def test_lora_trains_under_two_processes_and_resumes_in_one(tiny_dir, tmp_path):  # noqa: F811
    """LoRA under torchrun (DDP, what `auto` picks for it): two processes train with replicated adapters, process 0
    writes the adapter checkpoint (with every process's RNG file), and one process resumes it: the lines before are
    kept, the adapter loads, and the resumed run finishes."""
    pytest.importorskip("peft")
    run = tmp_path / "run"
    lora = ["lora.rank=4", "lora.alpha=8"]
    two = _train(tmp_path, _torchrun(2), _overrides(tiny_dir, "train.steps=2", *lora), "--run-dir", str(run))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "DDP: every one of the 2 processes" in two.stderr and "LoRA: rank 4" in two.stderr
    ckpt = run / "checkpoints" / "step-000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "rank-00001.pt").is_file()
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    one = _train(tmp_path, [sys.executable], _overrides(tiny_dir, "train.steps=4", *lora), "--resume", "--run-dir",
                 str(run))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resumed on 1 process(es) from a checkpoint written by 2" in one.stderr
    resumed = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed[:2] == rows
    from gspo.models import load_model

    load_model(str(run / "checkpoints" / "step-000004"))  # the base with the adapter merged in


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_lost_process_ends_the_run_in_one_line_and_it_resumes(tiny_dir, tmp_path, fault):  # noqa: F811
    """One of the two processes of `gspo train --nproc 2` is SIGKILLed (it crashed) or SIGSTOPped (it hangs) mid-run:
    the other ends within dist.timeout_s, and the launcher's one line names the cause -- the killed process, its pid
    and signal (exit 1), or the one that lost the other and the one that did not answer (exit 2) -- and the last
    complete checkpoint; nothing half-written is taken for a checkpoint, and after the kill --resume on two processes
    trains to the end with every step logged once."""
    run = tmp_path / "run"
    overrides = _overrides(tiny_dir, "train.steps=8", "dist.timeout_s=10")
    proc, workers = _two_processes_after(tmp_path, run, overrides, lines=4)
    os.kill(workers[1], getattr(signal, fault))
    if fault == "SIGSTOP":  # once the survivor has given up, end the hung one (torchrun would wait 30 s to)
        deadline = time.time() + 90
        while time.time() < deadline and Path(f"/proc/{workers[0]}").exists():
            time.sleep(0.1)
        os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("gspo: error:")]
    assert len(lines) == 1 and "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    if fault == "SIGKILL":
        assert proc.returncode == 1 and f"(pid {workers[1]}) was killed by SIGKILL" in lines[0], err[-3000:]
        assert f"the last complete checkpoint is {run / 'checkpoints' / 'step-'}" in lines[0]
    else:
        assert proc.returncode == 2 and " did not answer " in lines[0] and "of 2 lost the others" in lines[0], err
        assert "the last complete checkpoint is step-" in lines[0]
    assert not (run / "checkpoints").exists() or not any(
        p.name.endswith(".tmp") and (p / "COMPLETE").exists() for p in (run / "checkpoints").iterdir())
    if fault == "SIGSTOP":  # (a resume in one process after a hang: test_async's lost decode process; CI time)
        return
    again = _train(tmp_path, [sys.executable], overrides, "--resume", "--run-dir", str(run), "--nproc", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    check_run_dir(run, 8)


@pytest.mark.slow
def test_processes_agree_on_which_prompts_fit_as_one_process_does(tiny_dir, tmp_path):  # noqa: F811
    """The arithmetic prompts encode to 47-49 tokens; with data.max_prompt_tokens = 48 about a quarter are skipped. Two
    processes, each encoding half of every draw (dist.split_work), skip the same prompts and read the data stream to
    the same position as one process, batch after batch."""
    overrides = _overrides(tiny_dir, "train.steps=6", "data.max_prompt_tokens=48", "data.long_prompts='skip'",
                           "log.checkpoint_every=0")
    one = _train(tmp_path, [sys.executable], overrides, "--run-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = _train(tmp_path, _torchrun(2), overrides, "--run-dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    data = [[(r["data/position"], r["data/skipped_prompts"]) for r in read_jsonl(tmp_path / run / "metrics.jsonl")]
            for run in ("one", "two")]
    assert data[0] == data[1] and len(data[0]) == 6
    assert data[0][-1][1] >= 1  # some were skipped: 3 batches of 6 prompts fitting from position data[0][-1][0]
    assert data[0][-1][0] == 18 + data[0][-1][1]


def test_two_nodes_meet_through_a_c10d_rendezvous(tiny_dir, tmp_path):  # noqa: F811
    """Two torchrun agents, one process each, on one host, with a c10d rendezvous on localhost: how a multi-node job
    starts (each node runs the same command). They train one DAPO run together (dynamic sampling: the processes
    refill their zero-variance groups in rounds taken together); rank 0 alone writes it."""
    port = _free_port()
    run = tmp_path / "run"
    cmd = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=gspo-test", "-m", "gspo.cli", "train",
           *_overrides(tiny_dir, "train.steps=4", "algorithm='dapo'", "dapo.overlong_cache=4",
                       "rewards.functions=[{path='trainer_rewards:even_a_dyadic'}]"), "--run-dir",
           str(run)]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(err[-2000:] for _, err in outs)
    rows = check_run_dir(run, 4)
    assert sum("done: 4 optimizer steps" in out for out, _ in outs) == 1  # the first process talks to the user
    # prompts with an even first operand score all alike: their groups are dropped and refilled
    assert all(r["dynamic/dropped_groups"] >= 1 and r["dynamic/rounds"] >= 2 for r in rows)
    # the wait for the slower process is part of the gather, timed apart from the transfer
    assert all(0 <= r["time/gather_wait"] <= r["time/gather"] for r in rows)
    assert json.loads((run / "timings.json").read_text())["log_s"] > 0  # rank 0 wrote the log


@pytest.mark.slow
def test_a_stop_signal_to_one_process_stops_them_together(tiny_dir, tmp_path):  # noqa: F811
    """SIGTERM to one of two processes only: both stop at the same rollout-batch boundary (they agree on it), write a
    checkpoint together and exit 143 (the launcher prints the --resume line); the newest checkpoint is the last step
    logged, and --resume trains to the end."""
    run = tmp_path / "run"
    overrides = _overrides(tiny_dir, "train.steps=8", "log.checkpoint_every=0")
    proc, workers = _two_processes_after(tmp_path, run, overrides, lines=2)
    os.kill(workers[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    stops = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM after")]
    assert proc.returncode == 143 and len(stops) == 1 and "Traceback" not in err, err[-3000:]
    rows = check_run_dir(run, len(read_jsonl(run / "metrics.jsonl")))
    assert 2 <= len(rows) < 8
    assert (run / "checkpoints" / f"step-{len(rows):06d}" / "COMPLETE").exists()
    again = _train(tmp_path, _torchrun(2), overrides, "--resume", "--run-dir", str(run))
    assert again.returncode == 0, again.stderr[-3000:]
    check_run_dir(run, 8)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.prompts_per_batch=3"], "prompts_per_batch = 3 cannot be shared by 2 processes"),
    (["rollout.prompts_per_batch=2", "rollout.group_size=3", "train.minibatches=2"], "cannot be cut into 2 equal"),
    (["train.micro_batch_size=2"], "must divide each process's slice"),
    (["model.device='cuda:0'"], "all 2 processes on one GPU"),
    (["lora.rank=4", "dist.strategy='fsdp'"], "lora.rank = 4 with dist.strategy = 'fsdp'.*set dist.strategy = 'ddp'"),
    (["rollout.engine='vllm'"], "rollout.engine = 'vllm' under torchrun is not built"),
])
def test_a_setting_the_processes_cannot_share_is_refused_in_one_line(overrides, match):
    """Checked before any process group or model exists (gspo.parallel.strategy.check_layout), with the key and the fix."""
    from gspo.config import build_config
    from gspo.parallel.strategy import check_layout
    from gspo.errors import UserError

    cfg = build_config({}, ["rollout.prompts_per_batch=6", "rollout.group_size=2", "train.minibatches=2",
                            "train.steps=2", *overrides], device="cpu")
    with pytest.raises(UserError, match=match):
        check_layout(cfg, 2)
    check_layout(cfg, 1)  # one process shares nothing


@pytest.mark.slow
def test_a_sentinel_rollback_under_two_processes(tiny_dir, tmp_path):  # noqa: F811
    """The collapse sentinel sees the same reduced metrics on both processes, so both roll back together: the sharded
    checkpoint before the collapse is reloaded by every process, the abandoned ones are renamed by process 0 alone,
    and the run trains to the end with every step logged once."""
    run = tmp_path / "run"
    # 8 prompts x 2: each process scores 8 completions a batch, so the reward collapses in its third batch only
    overrides = _overrides(tiny_dir, "train.steps=10", "rollout.prompts_per_batch=8", "sentinel.action='rollback'",
                           "dist.strategy='fsdp'",
                           "sentinel.reward_drop=0.05",
                           "sentinel.window=1", "rewards.functions=[{path='trainer_rewards:collapses_in_third_batch'}]")
    done = subprocess.run([*_torchrun(2), "-m", "gspo.cli", "train", *overrides, "--run-dir", str(run)], cwd=tmp_path,
                          env={**ENV, "GSPO_TEST_COLLAPSE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rolling back to step-" in done.stderr
    check_run_dir(run, 10)
    assert any(p.name.startswith("rolled-back-step-") for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def turn_taking_dir(tmp_path_factory, tokenizer):
    """A tiny Llama that ends its turn with probability about 0.3 at every token, whatever it was fed (the final norm
    keeps one dimension, which every embedding carries at 30, the stop tokens' at 36), with the tokenizer."""
    from conftest import tiny_llama
    from gspo.models.load import stop_token_ids

    model = tiny_llama(vocab_size=len(tokenizer), seed=0)
    stop = stop_token_ids(tokenizer, model)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0
        model.model.embed_tokens.weight[stop, 0] = 36.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    d = tmp_path_factory.mktemp("turn_taking")
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_multi_turn_rows_train_under_two_processes(turn_taking_dir, tmp_path):
    """An environment under torchrun (2 processes, DDP), GSPO-token with per-turn credit: each process runs its share
    of the trajectories in its own environment workers, the rows hold several turns (their turn rewards gathered with
    them), the env/* metrics are the job's, and the run directory is whole."""
    from gspo.runlog.metrics import read_jsonl

    run = tmp_path / "run"
    overrides = _overrides(turn_taking_dir, "train.steps=4", "dist.strategy='ddp'", "env.path='env_fixtures:Echo'",
                           "env.workers=1", "env.max_turn_tokens=4", "rollout.max_new_tokens=40", "rewards.functions=[]",
                           "algorithm='gspo_token'", "loss.step_credit='env'")  # each turn credited with its reward
    done = _train(tmp_path, _torchrun(2), overrides, "--run-dir", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 4 and all(r["env/turns_mean"] > 1 and r["env/appended_tokens_mean"] > 0 for r in rows)
    turns = [s["turns"] for s in read_jsonl(run / "samples.jsonl")]
    assert any(any(not p["trained"] and "again" in p["text"] for p in t) for t in turns)
    check_run_dir(run, 4)
