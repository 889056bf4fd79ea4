"""gspo report / compare: the numbers of the key-metrics table, every figure written, and the page in a real browser."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.runlog.metrics import read_jsonl
from gspo.commands.report import Run, key_metrics, write_report

from test_trainer import tiny_config  # noqa: F401  (the tiny model fixture lives there too)
from test_trainer import tiny_dir  # noqa: F401
from gspo.train import Trainer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _benchmark(name: str):
    """The module ``benchmarks/<name>.py`` (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _runs(packed: Path, out: Path) -> Path:
    """The run directories that ``benchmarks/pack_runs.py`` packed into ``packed``, written under ``out``."""
    _benchmark("pack_runs").unpack(packed, out)
    return out


def _summarize(dirs: list[Path], device: str, out: Path) -> tuple[str, list[dict]]:
    """``benchmarks/scaling.py --summarize`` of ``dirs`` as a user runs it: its printed table and its JSON results."""
    import json
    import sys

    done = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--summarize", *map(str, dirs),
                           "--device", device, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, json.loads(out.read_text())["results"]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FIGURES = ["reward.png", "clipping.png", "ratios.png", "token_strip.png", "length_entropy.png", "minibatch_depth.png"]


def _row(step, batch, minibatch, reward, clip=0.0, entropy=1.0, elapsed=None):
    return {"step": step, "rollout_batch": batch, "minibatch": minibatch, "reward/mean": reward, "clip/token_total": clip,
            "clip/seq_total": clip, "entropy": entropy, "time/elapsed": elapsed if elapsed is not None else float(step)}


def _synthetic_run(d: Path, algorithm: str, clip: list[float], loss: dict | None = None,
                   probe: dict | None = None) -> Path:
    """A run directory of ``len(clip)`` rollout batches of two steps each: an on-policy one, then an off-policy one that
    clipped ``clip[b]`` of its tokens and sequences and logged a ratio histogram; ``loss`` goes into config.json."""
    import json

    from gspo.runlog.diagnostics import LOG_RATIO_EDGES

    d.mkdir(parents=True)
    config = {"algorithm": algorithm, "seed": 1, "model": {"name": "tiny-base"}, **({"loss": loss} if loss else {})}
    (d / "config.json").write_text(json.dumps(config))
    rows, hists = [], []
    for b, c in enumerate(clip):
        rows += [_row(2 * b + 1, b, 0, 0.1 * b), _row(2 * b + 2, b, 1, 0.1 * b, clip=c)]
        counts = [0] * (len(LOG_RATIO_EDGES) + 1)
        counts[12], counts[13] = 40, 60
        hists.append({"step": 2 * b + 2, "rollout_batch": b, "minibatch": 1, "edges": LOG_RATIO_EDGES, "token": counts,
                      "seq": counts})
    for name, lines in (("metrics", rows), ("histograms", hists)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if probe is not None:
        (d / "probe_noise.json").write_text(json.dumps(probe))
    return d


def _figcaption(page: Path, figure: str) -> str:
    """The caption under ``figure`` on the report page (unescaped)."""
    import html

    return html.unescape(re.search(f"src='{figure}'.*?<figcaption>(.*?)</figcaption>", page.read_text(), re.S).group(1))


def test_key_metrics_hand_worked(tmp_path):
    """Rewards 0.2, 0.6, 1.0, 0.0, 0.0, 0.0 per batch (two steps each): final = mean of all 6 (fewer than 10) = 0.3;
    5-batch moving averages over full windows only, 0.36, 0.32 -> best 0.36, largest drop 0.04 (the first batches'
    shorter windows, 0.2, 0.4, 0.6, 0.45, are no 5-batch means: they made the best 0.6 and the drop 0.28); clipping is
    the mean over the off-policy steps only (0.1 each), entropy the mean of the last batch (0.5, 0.7)."""
    rewards = [0.2, 0.6, 1.0, 0.0, 0.0, 0.0]
    rows = []
    for b, r in enumerate(rewards):
        rows += [_row(2 * b + 1, b, 0, r, clip=0.0), _row(2 * b + 2, b, 1, r, clip=0.1)]
    rows[-2]["entropy"], rows[-1]["entropy"] = 0.5, 0.7
    m = key_metrics(Run(tmp_path, "gspo", 1, {}, rows))
    assert m["reward_final"] == pytest.approx(0.3) and m["reward_best"] == pytest.approx(0.36)
    assert m["largest_drop"] == pytest.approx(0.04) and m["clip_token"] == pytest.approx(0.1)
    assert m["entropy_end"] == pytest.approx(0.6) and m["wall_s"] == 12.0 and m["steps"] == 12


def test_key_metrics_of_a_run_shorter_than_their_windows_say_what_they_took(tmp_path):
    """Rewards 0.375, 0.25, 0.125 (3 batches, fewer than the 5-batch window): best is the best batch, 0.375, and the
    largest drop the fall to 0.125, 0.25 (one mean of all 3 had no drop: the table showed 0.000); the table's labels
    say 'last 3' and 'batch'; a 6-batch run beside it makes them say 'or ... where fewer'."""
    from gspo.commands.report import metrics_table

    rows = []
    for b, r in enumerate([0.375, 0.25, 0.125]):
        rows += [_row(2 * b + 1, b, 0, r), _row(2 * b + 2, b, 1, r)]
    m = key_metrics(Run(tmp_path, "gspo", 1, {}, rows))
    assert (m["reward_best"], m["largest_drop"], m["reward_final"]) == (0.375, 0.25, 0.25)
    table = metrics_table([m], markdown=True)
    assert "reward, final (last 3)" in table and "best (batch)" in table and "5-batch" not in table
    longer = []
    for b, r in enumerate([0.2, 0.6, 1.0, 0.0, 0.0, 0.0]):
        longer += [_row(2 * b + 1, b, 0, r), _row(2 * b + 2, b, 1, r)]
    both = metrics_table([m, key_metrics(Run(tmp_path, "grpo", 1, {}, longer))], markdown=True)
    assert "reward, final (last 10) (or all, where fewer)" in both and "best (5-batch mean, or batch where fewer)" in both


def test_long_panel_titles_wrap_inside_the_image_and_the_table_scrolls(tmp_path):
    """A panel title longer than its panel (a long run name; the token strip's sequence ratio) is wrapped onto lines
    that stay inside the image (it ran past the edge and was cut), the figure's own title too; short titles are left
    as they are. The key-numbers table scrolls inside the page instead of widening it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gspo.commands.report import fit_titles

    long = "gspo+lr2e-3 (a-rather-long-run-name-seed1): ratios of the off-policy steps " * 2
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].set_title(long)
    axes[1].set_title("Reward vs step")
    fig.suptitle(long * 2)
    fit_titles(fig)
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for text in (axes[0].title, fig._suptitle):
        box = text.get_window_extent(renderer)
        assert "\n" in text.get_text() and 0 <= box.x0 and box.x1 <= fig.bbox.width, text.get_text()
    assert axes[1].get_title() == "Reward vs step"
    plt.close(fig)
    page = write_report([_synthetic_run(tmp_path / "a", "gspo", [0.1, 0.2])], tmp_path / "report").read_text()
    assert "overflow-x:auto" in page


@pytest.fixture(scope="module")
def two_runs(tiny_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for algo in ("gspo", "grpo"):
        d = root / algo
        Trainer(tiny_config(tiny_dir, f"algorithm='{algo}'", "train.steps=4", "log.trace_every=1",
                            "log.checkpoint_every=0"), d).train()
        dirs.append(d)
    return dirs


def test_report_writes_every_figure_and_the_table(two_runs, tmp_path):
    page = write_report(two_runs, tmp_path / "report")
    for f in FIGURES:
        assert (tmp_path / "report" / f).stat().st_size > 5000, f
        assert f"src='{f}'" in page.read_text()
    assert "noise.png" not in page.read_text() and "gspo probe noise" in page.read_text()
    table = (tmp_path / "report" / "table.md").read_text()
    assert table.count("\n") == 4 and "| gspo |" in table.replace("gspo | 1", "gspo |")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_report_opens_in_headless_chromium(two_runs, tmp_path):
    """The page renders in a real browser and every image on it loads (the page's own check sets data-images-loaded)."""
    page = write_report(two_runs, tmp_path / "report")
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'data-images-loaded="(\d+)/(\d+)"', out.stdout)
    assert m, out.stderr[-2000:]
    assert m.group(1) == m.group(2) == str(len(FIGURES))


def test_compare_trains_each_algorithm_and_seed_then_reports(tiny_dir, tmp_path, capsys):  # noqa: F811
    """`gspo compare` runs arms x seeds into <out>/<arm>-seed<seed>, writes the report, prints the key-metrics table;
    run again, it keeps the finished runs instead of training them twice. An arm's suffix sets its settings
    (+lr: the learning rate) and names it in the report."""
    args = ["compare", "--algos", "gspo,grpo+lr2e-3", "--seeds", "3", "--out", str(tmp_path / "cmp"), f"model.name='{tiny_dir}'",
            "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2",
            "train.minibatches=2", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=0",
            "rewards.functions=[{path='trainer_rewards:text_length'}]"]
    assert main(args) == 0
    printed = capsys.readouterr()
    assert (tmp_path / "cmp" / "gspo-seed3" / "metrics.jsonl").exists()
    assert [r["lr"] for r in read_jsonl(tmp_path / "cmp" / "grpo+lr2e-3-seed3" / "metrics.jsonl")] == [2e-3, 2e-3]
    assert (tmp_path / "cmp" / "report" / "index.html").exists() and "| gspo (mean of 1) |" in printed.out
    assert "| grpo+lr2e-3 (mean of 1) |" in printed.out
    assert main(args) == 0
    assert printed.err.count("training") == 2 and capsys.readouterr().err.count("complete; kept") == 2


def test_bad_seed_list_is_one_clear_error(tmp_path, capsys):
    assert main(["compare", "--seeds", "one", "--out", str(tmp_path)]) == 2
    assert "argument --seeds: 'one' is not a comma-separated list of integers" in capsys.readouterr().err


def test_a_bad_arm_is_one_line_naming_it(tmp_path, capsys):
    """An arm whose suffixes clash, or whose settings are invalid, ends compare before any run in one line naming it."""
    assert main(["compare", "--algos", "gspo,grpo+r2+r3", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert "'grpo+r2+r3' sets moe.routing_replay twice" in err and len(err.splitlines()) == 1
    assert main(["compare", "--algos", "gspo,grpo+mb0", "--out", str(tmp_path / "b"), "rewards.workers=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo") and "--algos grpo+mb0: train.minibatches = 0" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "b" / "grpo+mb0-seed1").exists()


def test_length_bins_and_bin_summary_hand_worked():
    """Lengths 1..6 in 3 bins -> [1,2], [3,4], [5,6]; GRPO weights (1, 3) and GSPO (2, 2) in one bin: variances 1 and 0."""
    from gspo.commands.probe import length_bins, summarize_bins

    assert length_bins([6, 1, 2, 5, 3, 4], 3) == [(1, 2), (3, 4), (5, 6)]
    rec = {"length": 2, "grpo_weights": [1.0, 3.0], "gspo_weights": [2.0, 2.0], "grpo_grad_norm": 1.0,
           "gspo_grad_norm": 0.5, "grpo_is_noise": 0.2, "gspo_is_noise": 0.1}
    out = summarize_bins([rec], 1)
    assert out["grpo"][0]["weight_var"] == 1.0 and out["gspo"][0]["weight_var"] == 0.0
    assert out["gspo"][0]["grad_norm"] == 0.5 and out["grpo"][0]["n"] == 1


def test_probe_noise_writes_a_report_figure(tiny_dir, two_runs, tmp_path, capsys):  # noqa: F811
    """`gspo probe noise` on the tiny model: every probed response is off-policy after the minibatch updates, and the
    report of a run directory holding probe_noise.json gains the noise figure."""
    run = two_runs[0]
    args = ["probe", "noise", "--out", str(run), "--rows", "6", "--bins", "2", f"model.name='{tiny_dir}'",
            "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.minibatches=2",
            "train.lr=1e-3", "rewards.workers=0", "log.progress=false",
            "rewards.functions=[{path='trainer_rewards:text_length'}]"]
    assert main(args) == 0
    import json

    result = json.loads((run / "probe_noise.json").read_text())
    assert result["responses"] > 0 and set(result["by_algorithm"]) == {"grpo", "gspo"}
    assert all(r["grpo_is_noise"] > 0 for r in result["per_response"])
    assert "| grpo |" in capsys.readouterr().out
    page = write_report([run], tmp_path / "report")
    assert (tmp_path / "report" / "noise.png").exists() and "noise.png" in page.read_text()
    assert (run / "probe_noise.png").exists()
    (run / "probe_noise.json").unlink()  # the other tests of this module expect no probe


def test_compare_moves_a_run_without_checkpoint_aside(tiny_dir, tmp_path, capsys):  # noqa: F811
    """A run directory left without any checkpoint (killed early) is moved aside, not deleted, and trained again."""
    out = tmp_path / "cmp"
    (out / "gspo-seed1").mkdir(parents=True)
    (out / "gspo-seed1" / "metrics.jsonl").write_text("")
    args = ["compare", "--algos", "gspo", "--seeds", "1", "--out", str(out), f"model.name='{tiny_dir}'",
            "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "train.steps=2",
            "train.minibatches=2", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=0",
            "rewards.functions=[{path='trainer_rewards:text_length'}]"]
    assert main(args) == 0
    assert "had no checkpoint; moved to" in capsys.readouterr().err
    assert len(list(out.glob("gspo-seed1.incomplete-*"))) == 1 and (out / "gspo-seed1" / "checkpoints").exists()


def test_moe_runs_get_arm_labels_a_flip_figure_and_summary_numbers(tmp_path, capsys):
    """The H100 runs of docs/moe (GSPO, GRPO, GRPO + R2 on the upcycled SmolLM2): the report labels the replay arm
    `grpo+r2`, draws the flip-rate figure with a layer heat map per arm, and gspo summary gives the mean flip rate."""
    import json

    root = _runs(FIXTURES / "moe_first_runs.json.gz", tmp_path / "runs")
    runs = [root / n for n in ("gspo", "grpo", "grpo_r2")]
    page = write_report(runs, tmp_path / "report")
    assert (tmp_path / "report" / "moe_flips.png").stat().st_size > 10_000
    assert "grpo+r2" in page.read_text() and "moe_flips.png" in page.read_text()
    groups = json.loads((tmp_path / "report" / "summary.json").read_text())["groups"]
    flips = {g["algorithm"]: g["flip_rate"] for g in groups}
    assert set(flips) == {"gspo", "grpo", "grpo+r2"} and flips["grpo+r2"] < flips["grpo"]
    assert main(["summary", str(runs[2]), "--json"]) == 0
    assert 0 < json.loads(capsys.readouterr().out)["moe_flip_rate_mean"] < 0.01


def test_compare_arms_parse_and_refuse_unknown_suffixes(tmp_path):
    from gspo.commands.arms import arm_label, parse_arm
    from gspo.config import Config, build_config
    from gspo.errors import UserError

    assert parse_arm("grpo+r2") == ("grpo", {"moe.routing_replay": "old"})
    assert parse_arm("gspo") == ("gspo", {})
    assert parse_arm("grpo+mb8+lr2e-5") == ("grpo", {"train.minibatches": 8, "train.lr": 2e-5})
    assert parse_arm("gspo+stale4+tis") == ("gspo", {"rollout.max_staleness": 4, "loss.mismatch_correction": "tis"})
    assert parse_arm("gspo+enginelp+int8") == ("gspo", {"train.old_logprobs": "rollout", "rollout.engine_weight_bits": 8})
    assert parse_arm("gspo_token+credit") == ("gspo_token", {"loss.step_credit": "task"})
    assert parse_arm("gspo+exact+enginelp") == ("gspo", {"rollout.exact": True, "train.old_logprobs": "rollout"})
    for bad in ("grpo+r9", "grpo+mb", "grpo+mbx", "grpo+lr", "grpo+lrfast", "grpo+", "gspo+stale", "gspo+stale1.5"):
        with pytest.raises(UserError, match="unknown suffix"):
            parse_arm(bad)
    assert parse_arm("gspo+int8+seqmask") == ("gspo", {"rollout.engine_weight_bits": 8,
                                                      "loss.mismatch_correction": "sequence_mask"})
    for twice in ("grpo+r2+r3", "gspo+mb8+mb16", "grpo+tis+icepop"):
        with pytest.raises(UserError, match="twice; keep one suffix"):
            parse_arm(twice)
    # a run's arm: the suffixes its settings switch on, or the label compare gave it
    cfg = build_config({}, ["algorithm='grpo'", "train.old_logprobs='rollout'", "rollout.engine_weight_bits=8"])
    assert arm_label(cfg.to_dict()) == "grpo+enginelp+int8"
    assert arm_label(build_config({}, ["log.label='grpo+mb8'"]).to_dict()) == "grpo+mb8"
    assert arm_label(Config().to_dict()) == "gspo"
    # a boolean suffix reaches the run's config as a boolean (+exact once arrived as the string 'True')
    from gspo.commands.compare import plan_runs

    _, todo = plan_runs(None, [], [("gspo+exact", "gspo", {"rollout.exact": True})], [1], tmp_path)
    assert "rollout.exact=true" in todo[0][0]


def test_by_length_figure_and_experiment_summary_from_length_bins(tmp_path, capsys):
    """Runs whose responses fall in two length bins get the by-length figure; benchmarks/experiments_summary.py gives
    each arm's row, its per-minibatch rows and its per-bin rows (responses counted, values averaged over the
    off-policy steps); an arm's runs that differ in more than their seed are arms of their own there, as in the
    report."""
    import json
    import shutil

    for arm, clip in (("grpo", 0.01), ("gspo", 0.3)):
        d = tmp_path / "cmp" / f"{arm}-seed1"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"algorithm": arm, "seed": 1, "log": {"label": arm},
                                                   "train": {"lr": 1e-6}}))
        rows = []
        for step in range(1, 9):
            mb = (step - 1) % 2
            row = {"step": step, "rollout_batch": (step - 1) // 2, "minibatch": mb, "reward/mean": 0.1 * step,
                   "time/elapsed": float(step), "clip/token_total": clip * mb, "ratio/token_std": 0.05 * mb}
            for name, n in (("0-63", 3), ("64-127", 5)):
                row.update({f"bylen/{name}/seqs": n, f"bylen/{name}/clip_token": clip * mb,
                            f"bylen/{name}/ratio_token_std": 0.04 * mb, f"bylen/{name}/ratio_seq_std": 0.01 * mb})
            rows.append(row)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = write_report(sorted((tmp_path / "cmp").glob("*-seed1")), tmp_path / "report")
    assert (tmp_path / "report" / "by_length.png").stat().st_size > 5000 and "by_length.png" in page.read_text()
    mod = _benchmark("experiments_summary")
    arms = mod._runs([str(tmp_path / "cmp")])
    assert set(arms) == {"gspo", "grpo"}
    row = mod.arm_row("gspo", arms["gspo"])
    assert row["seeds"] == 1 and row["collapsed"] == 0 and row["clip_token"] == pytest.approx(0.3)
    bins = mod.length_rows("gspo", arms["gspo"])
    assert [(b["bin"], b["responses"]) for b in bins] == [("0-63", 12), ("64-127", 20)]  # 4 off-policy steps
    assert bins[1]["ratio_token_std"] == pytest.approx(0.04)
    assert [r["minibatch"] for r in mod.depth_rows("grpo", arms["grpo"])] == [0, 1]
    other = tmp_path / "cmp" / "gspo-seed2"
    shutil.copytree(tmp_path / "cmp" / "gspo-seed1", other)
    (other / "config.json").write_text(json.dumps({"algorithm": "gspo", "seed": 2, "log": {"label": "gspo"},
                                                   "train": {"lr": 5e-6}}))
    assert {a: len(r) for a, r in mod._runs([str(tmp_path / "cmp")]).items()} == {
        "grpo": 1, "gspo (train.lr=1e-06)": 1, "gspo (train.lr=5e-06)": 1}
    # with the engine's log-probs as pi_old every step is off-policy (Run.off_policy): the bins count all 8
    (other / "config.json").write_text(json.dumps({"algorithm": "gspo", "seed": 2, "log": {"label": "gspo"},
                                                   "train": {"lr": 5e-6, "old_logprobs": "rollout"}}))
    engine_old = mod._runs([str(tmp_path / "cmp")])["gspo (train.lr=5e-06)"]
    assert [(b["bin"], b["responses"]) for b in mod.length_rows("gspo", engine_old)] == [("0-63", 24), ("64-127", 40)]


def test_packed_runs_come_back_bit_for_bit(tmp_path):
    """benchmarks/pack_runs.py keeps the docs' figure data without the raw runs: float32 values written short, a
    float64 flip rate (3 flips of 2393 x 2 slots) as a fraction, other floats as they are, absent keys absent, ints
    ints; a second pack of the same runs is the same bytes."""
    import json
    import struct

    pack_runs = _benchmark("pack_runs")
    run = tmp_path / "raw" / "gspo-seed1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"algorithm": "gspo", "seed": 1}))
    f32 = struct.unpack("f", struct.pack("f", 0.1))[0]
    rows = [{"step": 1, "rollout_batch": 0, "minibatch": 0, "reward/mean": 0.25, "entropy": f32, "time/elapsed": 0.1,
             "moe/flip_rate": 3 / 4786, "samples/text": "dropped"},
            {"step": 2, "rollout_batch": 0, "minibatch": 1, "reward/mean": 0.5, "entropy": 2 * f32, "time/elapsed": 1 / 3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "runs.json.gz"
    pack_runs.pack([str(run)], str(out), "t")
    stored = pack_runs.load(out)["runs"][0]
    assert stored["columns"]["entropy"] == [0.1, 0.2] and stored["columns"]["moe/flip_rate"] == [[3, 4786], None]
    back = pack_runs.unpack(out, tmp_path / "back")[0]
    got = [json.loads(line) for line in (back / "metrics.jsonl").read_text().splitlines()]
    assert got == [{k: v for k, v in r.items() if k != "samples/text"} for r in rows]
    assert json.dumps(got) == json.dumps([{k: v for k, v in r.items() if k != "samples/text"} for r in rows])
    first = out.read_bytes()
    pack_runs.pack([str(run)], str(out), "t")
    assert out.read_bytes() == first


def test_committed_scaling_tables_are_what_the_script_computes_from_the_committed_runs(tmp_path):
    """benchmarks/scaling.py --summarize on the 4 x H200 lease's runs (benchmarks/README.md#scale-out; the runs' metrics
    in tests/fixtures/scale_out/ab_h200x4) gives the committed table: the whole-run and median-batch rates, and
    speed-ups over the faster one-GPU run. By hand for the median batch: 128 prompts x 8 completions over a 0.532 s
    median batch is ~1925 completions/s."""
    import json

    lease = FIXTURES / "scale_out" / "ab_h200x4"
    committed = json.loads((lease / "new.json").read_text())
    runs = _runs(lease / "new_runs.json.gz", tmp_path / "new")
    stdout, got = _summarize([runs / r["run"] for r in committed["results"]], committed["device"],
                             tmp_path / "new.json")
    for mine, theirs in zip(got, committed["results"], strict=True):
        for key in ("completions_per_s", "completions_per_s_median_batch", "speedup", "speedup_median_batch"):
            assert mine[key] == pytest.approx(theirs[key]), key
    four = next(r for r in got if r["run"] == "gpus4-prompts128")
    assert 128 * 8 / sorted(four["batch_s"])[len(four["batch_s"]) // 2] == pytest.approx(
        four["completions_per_s_median_batch"]) and 1900 < four["completions_per_s_median_batch"] < 1950
    assert "3.62x" in stdout


def test_speedup_at_equal_longest_response_by_hand(tmp_path):
    """The longest-response decomposition of benchmarks/scaling.py. The line through (1, 2), (2, 4), (3, 7): slope
    Σ(x - 2)(y - 13/3) / Σ(x - 2)² = (7/3 + 8/3) / 2 = 2.5, intercept 13/3 - 5 = -2/3. On the committed 4 x H100 runs:
    a least-squares line passes through the means, so the baseline at its own mean longest response runs at its
    whole-run rate, and the 4-GPU run at that length takes its mean batch time less slope x (its mean - the baseline's)."""
    import statistics

    scaling = _benchmark("scaling")
    a, b = scaling.fit_line([1, 2, 3], [2, 4, 7])
    assert (a, b) == (pytest.approx(-2 / 3), pytest.approx(2.5))
    assert scaling.fit_line([5, 5], [1, 3]) == (2, 0.0)  # one length: no slope, the mean
    runs = _runs(FIXTURES / "scale_out" / "h100x4_40" / "runs.json.gz", tmp_path / "runs")
    one, four = (scaling.summarize(runs / d, n) for d, n in (("gpus1-prompts32", 1), ("gpus4-prompts128", 4)))
    scaling.speedups([one, four])
    assert one["speedup_equal_longest"] == 1.0
    a1, b1 = one["batch_s_fit"]
    assert 32 * 8 / (a1 + b1 * one["len_max_mean"]) == pytest.approx(one["completions_per_s"])
    _, b4 = four["batch_s_fit"]
    at_base_length = statistics.fmean(four["batch_s"]) - b4 * (four["len_max_mean"] - one["len_max_mean"])
    assert four["speedup_equal_longest"] == pytest.approx(128 * 8 / at_base_length / one["completions_per_s"])
    assert four["len_max_mean"] > one["len_max_mean"] and 3.7 < four["speedup_equal_longest"] < 3.9  # 3.82x


def test_trace_steps_overlap_and_busy_time_by_hand():
    """benchmarks/trace_steps.py on a hand-made trace: gradient sums on stream 17 at 100-1100 us and 5000-5600 us;
    compute on stream 7 at 0-200, 500-700 and 650-900 us. The first sum runs under compute for 100 (100-200) + 400
    (the union of 500-700 and 650-900) = 500 us; the step from 100 to 5000 us holds the sum, the two later kernels and
    a 20 us fp32 sum at 3000 (the metrics': not a gradient sum), busy 1000 + 20 us (the kernel starting at 0 belongs to
    the step before)."""
    ts = _benchmark("trace_steps")

    def ev(name, start, dur, stream, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": {"stream": stream}}

    nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    trace = {"traceEvents": [ev(nccl, 100, 1000, 17), ev("gemm", 0, 200, 7), ev("add", 500, 200, 7),
                             ev("copy", 650, 250, 7, "gpu_memcpy"), ev(nccl, 3000, 20, 17), ev(nccl, 5000, 600, 17),
                             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 150, "dur": 5000}]}
    out = ts.analyse(trace)
    assert [r["overlapped_us"] for r in out["all_reduces"]] == [500, 0]
    assert [r["us"] for r in out["all_reduces"]] == [1000, 600]
    assert out["steps"][0]["window_ms"] == 4.9 and out["steps"][0]["busy_ms"] == 1.02


@pytest.mark.parametrize("table", ["new_round1", "new_round2", "base_round1", "base_round2", "all"])
def test_committed_h100x4_tables_are_what_the_script_computes(tmp_path, table):
    """The 4 x H100 40-batch A/B lease (benchmarks/README.md#scale-out; its tables and runs in
    tests/fixtures/scale_out/ab_h100x4_40): each committed table is benchmarks/scaling.py --summarize of the committed
    runs it names."""
    import json

    lease = FIXTURES / "scale_out" / "ab_h100x4_40"
    committed = json.loads((lease / f"{table}.json").read_text())
    for code in ("new", "base"):
        _runs(lease / f"{code}_runs.json.gz", tmp_path / code)
    stdout, got = _summarize([tmp_path / d for d in committed["args"]["summarize"]], committed["device"],
                             tmp_path / "t.json")
    assert stdout == (lease / f"{table}.txt").read_text()
    for mine, theirs in zip(got, committed["results"], strict=True):
        for key in ("completions_per_s", "speedup", "speedup_median_batch", "speedup_equal_longest"):
            assert mine[key] == pytest.approx(theirs[key]), key
    if table == "all":  # as benchmarks/README.md#scale-out quotes it: the new 4-GPU runs over the mean one-GPU rate
        ones = [r["completions_per_s"] for r in got if r["gpus"] == 1]
        fours = [r["completions_per_s"] for r in got if r["gpus"] == 4][:2]  # the new code's, listed first
        assert len(ones) == 4 and [round(f / (sum(ones) / 4), 2) for f in fours] == [3.64, 3.62]


def test_ratio_panels_shade_each_runs_own_clip_band(tmp_path, monkeypatch):
    """Each ratio panel shades the clip range its run trained with: config.json's eps, else the algorithm's preset."""
    import math

    from matplotlib.axes import Axes

    from gspo.config import PRESETS

    spans = []
    draw = Axes.axvspan
    monkeypatch.setattr(Axes, "axvspan", lambda ax, lo, hi, **kw: spans.append((lo, hi)) or draw(ax, lo, hi, **kw))
    runs = [_synthetic_run(tmp_path / "grpo", "grpo", [0.01, 0.02]),
            _synthetic_run(tmp_path / "gspo", "gspo", [0.3, 0.2], loss={"eps_low": 1e-3, "eps_high": 2e-3})]
    page = write_report(runs, tmp_path / "report")
    low, high = PRESETS["grpo"]["loss.eps_low"], PRESETS["grpo"]["loss.eps_high"]
    assert spans == [pytest.approx((math.log(1 - low), math.log(1 + high))),
                     pytest.approx((math.log(1 - 1e-3), math.log(1 + 2e-3)))]
    text = _figcaption(page, "ratios.png")
    assert f"grpo: clip band on the token ratio, 1 - {low:g} to 1 + {high:g}" in text
    assert "gspo: clip band on the sequence ratio, 1 - 0.001 to 1 + 0.002" in text


def test_ratio_panels_shade_each_objectives_own_band(tmp_path, monkeypatch):
    """CISPO's truncation band (its lower bound 0 is open: drawn from the axis' end), GMPO's band on the token
    log-ratios, and none for SAPO's soft gate; the caption names each."""
    import math

    from matplotlib.axes import Axes

    spans = []
    draw = Axes.axvspan
    monkeypatch.setattr(Axes, "axvspan", lambda ax, lo, hi, **kw: spans.append((lo, hi)) or draw(ax, lo, hi, **kw))
    runs = [_synthetic_run(tmp_path / algo, algo, [0.01, 0.02]) for algo in ("cispo", "gmpo", "sapo")]
    page = write_report(runs, tmp_path / "report")
    assert spans == [pytest.approx((-2.0, math.log(5.0))), pytest.approx((-0.4, 0.4))]
    text = _figcaption(page, "ratios.png")
    assert "cispo: CISPO's truncation band on the token ratio, 1 - 1 to 1 + 4" in text
    assert "gmpo: GMPO's clip band on each token's log ratio inside the geometric mean, -0.4 to 0.4" in text
    assert "sapo: no clip band (SAPO's soft gate)" in text


def _alt(page: Path, figure: str) -> str:
    """The alt text of ``figure`` on the report page: the figure's titles."""
    import html

    return html.unescape(re.search(f"src='{figure}' alt='(.*?)'>", page.read_text()).group(1))


def test_a_single_run_clipping_figure_states_its_numbers_and_compares_nothing(tmp_path):
    """On a one-run page the clipping title and caption give that run's mean clipped fractions and no comparison."""
    page = write_report([_synthetic_run(tmp_path / "gspo", "gspo", [0.3, 0.1])], tmp_path / "report")
    title, text = _alt(page, "clipping.png"), _figcaption(page, "clipping.png")
    assert title == "Clipped tokens, mean over the off-policy steps: gspo 20%"
    assert "Means over the off-policy steps: gspo 20% of tokens, 20% per sequence." in text
    for claim in (" more ", " than ", "orders of magnitude", "GRPO", "grpo"):
        assert claim not in title + text, claim


def test_batches_that_clipped_nothing_are_named_in_the_clipping_caption(tmp_path):
    """Batches whose clipped fraction is 0, which the log axis cannot draw, are counted per arm in the caption."""
    runs = [_synthetic_run(tmp_path / "gspo", "gspo", [0.3, 0.2, 0.1, 0.2]),
            _synthetic_run(tmp_path / "grpo", "grpo", [0.01, 0.0, 0.0, 0.02])]
    text = _figcaption(write_report(runs, tmp_path / "report"), "clipping.png")
    assert "grpo tokens: 0 in 2 of 4 batches; grpo per sequence: 0 in 2 of 4 batches." in text
    assert "gspo tokens" not in text and "gspo per sequence" not in text


def test_a_zero_on_a_log_axis_sits_on_a_floor_and_its_legend_counts_it():
    """A zero on a log axis is drawn on a floor under the smallest positive value; its line's legend entry counts it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gspo.commands.report import _draw_log

    fig, ax = plt.subplots()
    _draw_log(ax, [([1, 2, 3], [0.1, 0.0, 0.02], "grpo", {"color": "red"}), ([1, 2, 3], [0.5, 0.4, 0.3], "gspo", {})],
              "batches")
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) >= {"grpo; 0 in 1 of 3 batches (\u25bd)", "gspo"}
    floor = lines["grpo; 0 in 1 of 3 batches (\u25bd)"].get_ydata()[1]
    assert 0 < floor < 0.02 and ax.get_yscale() == "log" and ax.get_ylim()[0] < floor
    plt.close(fig)


def test_the_noise_figure_says_it_measured_the_base_model_on_one_batch_moved_off_policy(tmp_path):
    """The probe's figure names the base model it measured and the updates that moved its one batch off-policy."""
    bins = [{"length_lo": 1, "length_hi": 4, "length_mid": 3.0, "n": 2, "weight_var": 0.1, "grad_norm": 2.0,
             "is_noise": 0.3}]
    probe = {"model": "tiny-base", "algorithm_of_the_updates": "gspo", "minibatches": 4, "responses": 6,
             "by_algorithm": {"grpo": bins, "gspo": bins}}
    page = write_report([_synthetic_run(tmp_path / "gspo", "gspo", [0.3, 0.1], probe=probe)], tmp_path / "report")
    title = _alt(page, "noise.png").split(" | ")[0]
    assert title == ("gspo probe noise on the base model tiny-base: one rollout batch it sampled, moved off-policy by "
                     "3 gspo updates on it; 6 responses probed")
    assert "measured on the base model tiny-base as the probe's model.name loaded it" in _figcaption(page, "noise.png")


def test_runs_of_one_arm_with_other_settings_are_not_averaged_as_seeds(tmp_path):
    """Two unlabelled gspo runs at other learning rates are two groups named by the setting that tells them apart; seeds
    of one setting (that differ in how they logged and their GPU share) stay one group, averaged; a key an older run's
    config lacks is no difference."""
    import json

    from gspo.commands.report import group_means, group_runs, key_metrics, load_runs

    dirs = []
    for name, lr, seed, extra in (("a1", 1e-6, 1, {}), ("a2", 1e-6, 2, {"rollout": {"decode_gpu": "own"}}),
                                  ("b1", 5e-6, 1, {})):
        d = _synthetic_run(tmp_path / name, "gspo", [0.1, 0.2])
        config = json.loads((d / "config.json").read_text())
        config.update(seed=seed, train={"lr": lr}, log={"progress": seed == 1}, model={"name": "tiny-base",
                                                                                       "gpu_memory": 0.1 * seed},
                      **extra)
        (d / "config.json").write_text(json.dumps(config))
        dirs.append(d)
    runs = load_runs(dirs)
    assert {k: [r.name for r in v] for k, v in group_runs(runs).items()} == {
        "gspo (train.lr=1e-06)": ["a1", "a2"], "gspo (train.lr=5e-06)": ["b1"]}
    means = group_means([key_metrics(r) for r in runs])
    assert [m["run"] for m in means] == ["gspo (train.lr=1e-06) (mean of 2)", "gspo (train.lr=5e-06) (mean of 1)"]
    same = load_runs(dirs[:2])  # seeds alone: the arm's own name
    assert {r.algorithm for r in same} == {"gspo"}


def test_a_run_whose_old_log_probs_are_the_engines_counts_its_first_minibatch_as_off_policy(tmp_path):
    """With train.old_logprobs = 'rollout' minibatch 0's ratio is the trainer's over the engine's, so its clipping is in
    the run's numbers (and the depth figure draws k = 0); with recomputed log-probs minibatch 0 is on-policy."""
    import json

    from gspo.commands.report import key_metrics, load_runs

    dirs = []
    for name, old in (("recomputed", "recompute"), ("engine", "rollout")):
        d = _synthetic_run(tmp_path / name, "gspo", [0.4, 0.4])
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "train": {"old_logprobs": old}}))
        rows = [{**r, "clip/token_total": 0.2} if r["minibatch"] == 0 else r for r in read_jsonl(d / "metrics.jsonl")]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dirs.append(d)
    recomputed, engine = load_runs(dirs)
    assert key_metrics(recomputed)["clip_token"] == pytest.approx(0.4)
    assert key_metrics(engine)["clip_token"] == pytest.approx(0.3)
    assert engine.per_batch("clip/token_total", off_policy=True) == pytest.approx([0.3, 0.3])
    for d in dirs:  # one minibatch per rollout batch: only the engine's run has off-policy steps to draw
        rows = [r for r in read_jsonl(d / "metrics.jsonl") if r["minibatch"] == 0]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        page = write_report([d], tmp_path / f"report-{d.name}")
        assert (page.parent / "minibatch_depth.png").exists() == (d.name == "engine")


def test_arms_with_the_same_curve_stay_apart(tmp_path, monkeypatch):
    """Two arms with identical numbers differ in line style, marker and colour, the later one thinner and on top."""
    import gspo.commands.report as report

    drawn, save = {}, report._save

    def spy(fig, path):
        drawn[path.name] = [[ln for ln in ax.get_lines() if not ln.get_label().startswith("_")] for ax in fig.axes]
        return save(fig, path)

    monkeypatch.setattr(report, "_save", spy)
    runs = [_synthetic_run(tmp_path / a, a, [0.1, 0.2, 0.1]) for a in ("gspo", "grpo")]
    write_report(runs, tmp_path / "report")
    first, second = drawn["reward.png"][0]
    assert first.get_linestyle() != second.get_linestyle() and first.get_marker() != second.get_marker()
    assert first.get_color() != second.get_color() and list(first.get_ydata()) == list(second.get_ydata())
    assert second.get_linewidth() < first.get_linewidth() and second.get_zorder() > first.get_zorder()


def _processes_under(out: Path) -> list[str]:
    """The command lines of the processes whose command line names ``out`` (a compare into it, and its runs)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(out) in text:
            found.append(text)
    return found


def _wait_for(paths: list[Path], proc: subprocess.Popen, what: str) -> None:
    import time

    deadline = time.time() + 300
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, (what, proc.communicate()[1][-3000:])
        assert time.time() < deadline, f"{what}: still missing {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


@pytest.mark.extended
def test_compare_jobs_survives_a_failed_run_a_killed_run_and_sigterm_then_resumes(tiny_dir, tmp_path):  # noqa: F811
    """`gspo compare --jobs 2` over three arms, with real faults at chosen moments (tests/compare_rewards.py holds a run
    inside its second rollout batch, after its first checkpoint, until the test releases it):

    1. grpo's reward raises on every call (its training fails) and gspo's process is SIGKILLed: the third arm still
       trains to its end; compare ends in one line naming each of the two runs and its directory, how it ended and
       what to do, exit 2, no report, no process left.
    2. The same command: gspo resumes from its checkpoint, grpo's directory (no checkpoint) is moved aside and trained
       again; a real SIGTERM to compare (what a scheduler or `timeout` sends) while both are in a batch: each finishes
       it, checkpoints and stops; one line naming both runs, exit 143, no process left.
    3. The same command: both resume to the end, the finished one is kept, and the report holds the three runs, each
       a whole run directory (check_run_dir)."""
    import os
    import signal
    import sys
    import time

    from test_faults import check_run_dir

    out, hold = tmp_path / "cmp", tmp_path / "hold"
    cmd = [sys.executable, "-m", "gspo.cli", "compare", "--algos", "gspo,grpo,grpo+lr2e-3", "--seeds", "1", "--jobs",
           "2", "--out", str(out), f"model.name='{tiny_dir}'", "model.device='cpu'", "rollout.prompts_per_batch=2",
           "rollout.group_size=4", "rollout.max_new_tokens=6", "train.minibatches=2", "train.steps=8",
           "rewards.workers=0", "log.progress=false", "log.checkpoint_every=1",
           "rewards.functions=[{path='compare_rewards:text_length_unless'}]"]
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    gspo, grpo, lr = out / "gspo-seed1", out / "grpo-seed1", out / "grpo+lr2e-3-seed1"

    hold.touch()
    proc = subprocess.Popen(cmd, env={**env, "GSPO_TEST_FAIL_RUN": grpo.name, "GSPO_TEST_HOLD_RUNS": gspo.name,
                                      "GSPO_TEST_HOLD": str(hold)}, stderr=subprocess.PIPE, text=True)
    _wait_for([Path(f"{hold}.{gspo.name}"), gspo / "checkpoints" / "step-000002" / "COMPLETE"], proc, "gspo held")
    [pid] = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/cmdline")
             if f"--run-dir\0{gspo}\0".encode() in _read(p)]
    os.kill(pid, signal.SIGKILL)
    err = proc.communicate(timeout=600)[1]
    lines = err.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in err and err.count("gspo: error:") == 1, err[-3000:]
    assert lines[-1].startswith("gspo: error: ") and f"{gspo.name} ({gspo}) was killed by SIGKILL" in lines[-1]
    assert f"{grpo.name} ({grpo}) failed (exit 2: " in lines[-1] and "broken verifier" in lines[-1]
    assert "run the same command again" in lines[-1]
    assert not (out / "report").exists() and not _processes_under(out)
    assert len(read_jsonl(lr / "metrics.jsonl")) == 8  # the third arm trained to its end meanwhile

    for marker in tmp_path.glob("hold.*"):
        marker.unlink()
    proc = subprocess.Popen(cmd, env={**env, "GSPO_TEST_HOLD_RUNS": f"{gspo.name},{grpo.name}",
                                      "GSPO_TEST_HOLD": str(hold)}, stderr=subprocess.PIPE, text=True)
    _wait_for([Path(f"{hold}.{gspo.name}"), Path(f"{hold}.{grpo.name}"), grpo / "checkpoints" / "step-000002" /
               "COMPLETE", gspo / "checkpoints" / "step-000004" / "COMPLETE"], proc, "both held")
    proc.send_signal(signal.SIGTERM)
    logs = [out / "logs" / f"{r.name}.log" for r in (gspo, grpo)]
    _wait_for(logs, proc, "logs")
    while not all("SIGTERM: finishing" in log.read_text() for log in logs):  # the signal reached both runs
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    hold.unlink()
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 143 and "Traceback" not in err and "gspo: error" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("[compare] stopped by SIGTERM: ") and f"{gspo.name} ({gspo})" in last, last
    assert f"{grpo.name} ({grpo})" in last and "run the same command again" in last
    assert "had no checkpoint; moved to" in err and len(list(out.glob("grpo-seed1.incomplete-*"))) == 1
    assert not (out / "report").exists() and not _processes_under(out)

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("(resumed)") == 2 and f"{lr} is complete; kept" in done.stderr
    for arm in ("gspo", "grpo", "grpo+lr2e-3"):
        assert f"| {arm} (mean of 1) |" in done.stdout
    for run in (gspo, grpo, lr):
        check_run_dir(run, 8)
    assert "incomplete" not in (out / "report" / "index.html").read_text()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("flag,value,says", [
    ("--algos", "gspo,gspo", "gives gspo twice"), ("--algos", "grpo+r2, grpo + r2", "gives grpo+r2 twice"),
    ("--algos", "gspo,,grpo", "has an empty entry (entry 2)"), ("--algos", "gspo,", "has an empty entry (entry 2)"),
    ("--seeds", "1,01", "gives 1 twice"), ("--seeds", "1,,2", "has an empty entry (entry 2)"),
    # one arm spelled twice: suffixes in another order, a number written otherwise (it trained twice, two labels)
    ("--algos", "gspo+tis+stale4,gspo+stale4+tis", "are the same settings; keep one of them"),
    ("--algos", "grpo+lr2e-5,grpo+lr0.00002", "are the same settings; keep one of them")])
def test_a_repeated_or_empty_arm_or_seed_is_refused_before_any_run(flag, value, says, tmp_path, capsys):
    """Two equal arms or seeds would train into one run directory twice (`--algos gspo,gspo` trained gspo-seed1, then
    failed on it: 'already exists'); an empty entry is an arm or seed lost to a typo. One line, before any work."""
    from gspo.cli import parse_args
    from gspo.errors import UserError

    argv = ["compare", flag, value, "--out", str(tmp_path / "c")]
    with pytest.raises(UserError, match=re.escape(says)):
        parse_args(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("gspo: error:") == 1 and len(err.strip().splitlines()) == 1 and not (tmp_path / "c").exists()


def test_a_run_that_fails_in_compare_without_jobs_is_named_with_its_directory(tiny_dir, tmp_path, capsys):  # noqa: F811
    """Without --jobs the runs train in compare's own process: a run whose training fails (every reward call raises)
    ends compare in one line naming the run, its directory, its error and what to do (it used to be the run's error
    alone, with no word of which arm and seed it was)."""
    out = tmp_path / "cmp"
    argv = ["compare", "--algos", "gspo", "--seeds", "7", "--out", str(out), f"model.name='{tiny_dir}'",
            "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "train.steps=2", "train.minibatches=2", "rewards.workers=0", "log.progress=false",
            "rewards.functions=[{path='reward_fixtures:always_fails'}]"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"gspo: error: gspo-seed7 ({out / 'gspo-seed7'}) failed: ") and "failed on all" in err, err
    assert "run the same command again" in err and not (out / "report").exists()


def test_compare_gives_runs_sharing_a_gpu_an_equal_share_of_its_memory(tmp_path, monkeypatch):
    """``gspo compare --jobs N`` with more runs than GPUs caps each at 90% of its GPU divided by the runs placed on it
    (``model.gpu_memory``), keeps a share the user set, and leaves runs with a GPU each uncapped."""
    from gspo.commands import compare

    def share(gpus, jobs, runs, overrides=()):
        monkeypatch.setattr(compare, "_visible_gpus", lambda: gpus)
        started = []
        monkeypatch.setattr(compare.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or object())
        todo = [([*overrides], tmp_path / f"run{i}", False) for i in range(runs)]
        r = compare._Runs(None, todo, tmp_path / "logs", jobs)
        r.start_next()
        given = [a for a in started[0] if a.startswith("model.gpu_memory=")]
        return [float(a.split("=")[1]) for a in given]

    assert share(["0", "1", "2", "3"], 9, 21) == [0.3]  # 3, 2, 2, 2 runs a GPU: each may take 0.9 / 3
    assert share(["0"], 6, 21) == [0.15]
    assert share(["0"], 6, 2) == [0.45]  # only 2 runs to train: they are all that share it
    assert share(["0", "1"], 2, 5) == []  # a GPU each
    assert share([], 4, 8) == []  # CPU
    assert share(["0"], 6, 21, ["model.gpu_memory=0.5"]) == [0.5]  # the user's share stands


def test_compare_passes_sigint_and_sigterm_to_every_run_and_exits_as_each_asks(tmp_path):
    """`gspo compare --jobs`: a stop signal reaches every running run and no other starts; SIGINT ends the command with
    130, SIGTERM with 143 (tests/test_report.py sends a real SIGTERM through the same handler)."""
    import signal

    from gspo.commands import compare

    class Run:
        def __init__(self):
            self.got = []

        def send_signal(self, signum):
            self.got.append(signum)

    for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        runs = compare._Runs(None, [([], tmp_path / "late", False)], tmp_path / "logs", 2)
        running = [Run(), Run()]
        runs.running = {r: (tmp_path / f"run{i}", tmp_path / "log", None) for i, r in enumerate(running)}
        runs.forward(signum, None)
        assert [r.got for r in running] == [[signum], [signum]] and not runs.pending
        runs.running, runs.halted = {}, [tmp_path / "run0", tmp_path / "run1"]
        assert runs.outcome() == code


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_run_that_stops_itself_is_a_result_compare_keeps_and_reports(tiny_dir, tmp_path, capsys, jobs):  # noqa: F811
    """A run the collapse sentinel stops (here its entropy floor, set above any entropy) is a result, not a failure:
    compare records why, goes on with the other runs, writes the report with the steps it trained, and a second
    compare keeps it (it used to end compare with an error asking to run it again, which resumed the run into the same
    stop, for ever)."""
    out = tmp_path / "cmp"
    argv = ["compare", "--algos", "gspo,grpo", "--seeds", "7", "--out", str(out), "--jobs", str(jobs),
            f"model.name='{tiny_dir}'", "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "train.steps=4", "train.minibatches=2", "rewards.workers=0",
            "log.progress=false", "sentinel.action='stop'", "sentinel.entropy_min=100.0"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    for arm in ("gspo", "grpo"):
        run = out / f"{arm}-seed7"
        assert "Collapse sentinel stopped the run" in json.loads((run / "stopped.json").read_text())["reason"]
        assert f"{arm}-seed7 ({run}) stopped itself: Collapse sentinel stopped the run" in err
        assert 0 < read_jsonl(run / "metrics.jsonl")[-1]["step"] < 4
    assert (out / "report" / "index.html").exists()
    assert main(argv) == 0
    assert capsys.readouterr().err.count("stopped itself (Collapse sentinel") == 2  # kept, not trained again


def test_compare_keeps_a_finished_run_only_with_the_settings_it_asks_for(tiny_dir, tmp_path, capsys):  # noqa: F811
    """A second compare into the same --out keeps the finished runs, unless they were trained otherwise (another
    learning rate, fewer or more steps): then one line naming the run, the key and both values (they used to be
    kept and shown under the new command's title)."""
    out = tmp_path / "cmp"
    base = ["compare", "--algos", "gspo", "--seeds", "7", "--out", str(out), f"model.name='{tiny_dir}'",
            "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "train.minibatches=2", "rewards.workers=0", "log.progress=false"]
    assert main([*base, "train.steps=2"]) == 0
    assert main([*base, "train.steps=2", "log.trace_every=1"]) == 0  # what is logged may differ: kept
    assert "is complete; kept" in capsys.readouterr().err
    for change, key in ((["train.steps=2", "train.lr=1e-3"], "train.lr"),
                        (["train.steps=1", "train.minibatches=1"], "train.steps")):  # (1 step of 1 minibatch)
        assert main([*base, *change]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"gspo: error: {out / 'gspo-seed7'} is kept as finished but was trained with {key} = ")


def test_compare_never_moves_aside_a_run_another_process_still_trains(tiny_dir, tmp_path, capsys):  # noqa: F811
    """A run directory without a checkpoint is moved aside and trained again, unless a process still holds it (the
    same compare started twice, or an orphan of a compare whose terminal went away): then one line naming it (it
    used to be renamed under the live run, and a second run started at the same path)."""
    from gspo.train.guards import lock_run_dir

    out = tmp_path / "cmp"
    run = out / "gspo-seed7"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    held = lock_run_dir(run)  # what a training process holds
    try:
        argv = ["compare", "--algos", "gspo", "--seeds", "7", "--out", str(out), f"model.name='{tiny_dir}'",
                "model.device='cpu'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
                "rollout.max_new_tokens=6", "train.steps=2", "train.minibatches=2", "rewards.workers=0",
                "log.progress=false"]
        assert main(argv) == 2
        assert "is in use by another gspo process" in capsys.readouterr().err and run.is_dir()
    finally:
        held.close()


def test_a_mean_over_seeds_of_different_lengths_says_so():
    """Seeds that trained different numbers of steps (one stopped by the sentinel) are averaged at their own last
    steps: the group's row names their range instead of passing for a mean at one step."""
    from gspo.commands.report import group_means

    rows = [{"algorithm": "gspo", "steps": s, "reward_final": r} for s, r in ((212, 0.5), (320, 0.9), (320, 0.7))]
    rows.append({"algorithm": "grpo", "steps": 320, "reward_final": 0.8})
    gspo, grpo = group_means(rows)
    assert gspo["run"] == "gspo (mean of 3; steps 212-320)" and gspo["reward_final"] == pytest.approx(0.7)
    assert grpo["run"] == "grpo (mean of 1)"
