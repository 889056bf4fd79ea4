"""``gspo report``: the seeds' figures drawn from the user's own runs, as PNGs and one HTML page readable offline.

Input: run directories (``metrics.jsonl``, ``config.json``; ``histograms.jsonl``, ``traces.jsonl`` and
``probe_noise.json`` when present). Runs are grouped by arm (``log.label``, else the algorithm and its arm suffixes);
runs of one arm that differ only in their seed are averaged, with a band from the lowest to the highest seed. Runs of
one arm with other settings too are not seeds of each other: each group's name gains the settings that tell them
apart (``gspo (train.lr=1e-06)``).

Figures (each saved as a PNG next to ``index.html``):
  1. reward vs optimizer step and vs wall-clock
  2. clipped fraction of the off-policy steps (log scale), per token and per sequence
  3. token and sequence log-ratio histograms of the off-policy steps on one axis, each run's own clip band shaded
  4. a token strip: one response's tokens shaded by their ratio, the outliers labelled, the geometric mean called out
  5. gradient noise vs response length (only when ``gspo probe noise`` wrote ``probe_noise.json``)
  6. response length and entropy over steps
  7. a table of the final numbers per run

and, for multi-turn runs, their last logged conversations with the trained (sampled) tokens marked.
"""
from __future__ import annotations

import dataclasses
import functools
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.commands.arms import arm_label
from gspo.config import flatten
from gspo.errors import UserError
from gspo.runlog.metrics import mean_present, read_jsonl

Drawn = tuple[str, str]  # a figure written: its file name and its titles


@dataclass
class Run:
    path: Path
    algorithm: str
    seed: int
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    histograms: list[dict[str, Any]] = field(default_factory=list)
    traces: list[dict[str, Any]] = field(default_factory=list)
    probe: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.path.name

    def batches(self) -> list[dict[str, Any]]:
        """The first metrics line of every rollout batch (rollout-batch quantities live there)."""
        seen: dict[int, dict[str, Any]] = {}
        for r in self.metrics:
            seen.setdefault(r["rollout_batch"], r)
        return [seen[k] for k in sorted(seen)]

    @functools.cached_property
    def engine_old(self) -> bool:
        """Whether the run's π_old is the engine's (``train.old_logprobs = "rollout"``)."""
        return flatten(self.config).get("train.old_logprobs") == "rollout"

    def off_policy(self, row: dict[str, Any]) -> bool:
        """Whether the step of metrics line (or histogram) ``row`` trained off-policy, so that its ratios can move and
        its clip act: minibatches 1.. of a rollout batch, and every minibatch of a run whose π_old is the engine's
        (minibatch 0's ratio is then the trainer's over the engine's)."""
        return row.get("minibatch", 0) > 0 or self.engine_old

    def per_batch(self, key: str, off_policy: bool = False) -> list[float | None]:
        """``key`` per rollout batch; with ``off_policy`` the mean over the batch's off-policy steps (None if none)."""
        if not off_policy:
            return [b.get(key) for b in self.batches()]
        out: dict[int, list[float]] = {}
        for r in self.metrics:
            if self.off_policy(r) and r.get(key) is not None:
                out.setdefault(r["rollout_batch"], []).append(r[key])
        return [sum(out[b]) / len(out[b]) if out.get(b) else None for b in sorted({r["rollout_batch"] for r in self.metrics})]


def _legend(ax, fontsize: int) -> None:
    """The axes' legend, when a line has a label (a figure of runs without one, e.g. all failed, stays quiet)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)


def clip_band(config: dict[str, Any]) -> tuple[str, float, float, str] | None:
    """The ratio level, clip range (eps_low, eps_high) and objective a run trained with: its config.json's, the fields
    it lacks from its algorithm's preset as training fills them; None when the config names no known algorithm."""
    from gspo.config import PRESETS, Config, LossConfig, apply_preset

    if config.get("algorithm") not in PRESETS:
        return None
    known = {f.name for f in dataclasses.fields(LossConfig)}
    loss = LossConfig(**{k: v for k, v in (config.get("loss") or {}).items() if k in known})
    cfg = Config(algorithm=config["algorithm"], loss=loss)
    apply_preset(cfg)
    return cfg.loss.level, cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.objective


def load_run(path: str | Path) -> Run:
    p = Path(path)
    if not (p / "metrics.jsonl").exists():
        raise UserError(f"{str(p)!r} is not a run directory (no metrics.jsonl); pass directories written by gspo train.")
    metrics = read_jsonl(p / "metrics.jsonl")
    if not metrics:
        raise UserError(f"{str(p / 'metrics.jsonl')!r} is empty; the run has not finished a step yet.")
    config = json.loads((p / "config.json").read_text()) if (p / "config.json").exists() else {}
    opt = lambda name: read_jsonl(p / name) if (p / name).exists() else []  # noqa: E731
    probe = json.loads((p / "probe_noise.json").read_text()) if (p / "probe_noise.json").exists() else None
    return Run(p, arm_label(config), int(config.get("seed", 0)), config, metrics, opt("histograms.jsonl"),
               opt("traces.jsonl"), probe)


# settings that may differ between seeds of one arm: the seed, how the run logged, its share of a shared GPU, how long
# its processes wait for each other
_NOT_SETTINGS = ("seed", "log.", "model.gpu_memory", "dist.timeout_s")


def load_runs(paths: list[str | Path]) -> list[Run]:
    """:func:`load_run` of each path, the runs of one arm that differ in more than their seed told apart
    (:func:`name_arms`)."""
    return name_arms([load_run(p) for p in paths])


def name_arms(runs: list[Run]) -> list[Run]:
    """The runs of one arm that differ in more than their seed told apart: each such run's arm gains the settings in
    which its arm's runs differ (keys a run's config.json lacks, written by an older gspo, count as no difference)."""
    by_arm: dict[str, list[Run]] = {}
    for run in runs:
        by_arm.setdefault(run.algorithm, []).append(run)
    for arm, members in by_arm.items():
        settings = [{k: v for k, v in flatten(r.config).items() if not k.startswith(_NOT_SETTINGS)} for r in members]
        common = set.intersection(*(set(s) for s in settings))
        differ = sorted(k for k in common if len({json.dumps(s[k], sort_keys=True, default=str) for s in settings}) > 1)
        for run, s in zip(members, settings):
            if differ:
                run.algorithm = f"{arm} ({', '.join(f'{k}={s[k]!r}' for k in differ)})"
    return runs


# --------------------------------------------------------------------------------------------- numbers


def _moving_mean(xs: list[float], k: int) -> list[float]:
    """The means of every full window of ``k`` (as the sentinel's), or of all of ``xs`` when it is shorter: a first
    window of one batch is no "5-batch mean"."""
    if len(xs) < k:
        return [sum(xs) / len(xs)] if xs else []
    return [sum(xs[i - k + 1: i + 1]) / k for i in range(k - 1, len(xs))]


def key_metrics(run: Run) -> dict[str, Any]:
    """The seeds' "key metrics comparison" for one run.

    - clipping: mean clipped fraction over the off-policy steps (:meth:`Run.off_policy`), per token and per sequence
    - final reward: mean over the last 10 rollout batches; best: the best 5-batch moving average
    - stability: the largest drop of the 5-batch moving average from its running maximum
    (a run of fewer than 5 batches: the batches themselves, for best and drop; ``final_n`` and ``best_k`` say what
    was taken, for the table's labels)
    - entropy at the end: mean over the last rollout batch's steps; wall-clock of the training loop
    """
    rewards = [r for r in run.per_batch("reward/mean") if r is not None]
    k = 5 if len(rewards) >= 5 else 1  # (one mean of 3 batches has no drop: a 0.375 -> 0.125 fall showed 0.000)
    smooth = _moving_mean(rewards, k)
    peak, drop = -math.inf, 0.0
    for x in smooth:
        peak = max(peak, x)
        drop = max(drop, peak - x)
    off = [r for r in run.metrics if run.off_policy(r)]

    def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
        return mean_present([r.get(key) for r in rows], empty=None)

    last_batch = [r for r in run.metrics if r["rollout_batch"] == run.metrics[-1]["rollout_batch"]]
    return {
        "run": run.name, "algorithm": run.algorithm, "seed": run.seed, "steps": run.metrics[-1]["step"],
        "clip_token": mean("clip/token_total", off), "clip_seq": mean("clip/seq_total", off),
        "reward_first": rewards[0] if rewards else None,
        "reward_final": sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
        "reward_best": max(smooth) if smooth else None, "largest_drop": drop,
        "final_n": min(10, len(rewards)), "best_k": k,
        "entropy_end": mean("entropy", last_batch), "wall_s": run.metrics[-1].get("time/elapsed"),
        "flip_rate": mean("moe/flip_rate", run.metrics),
        "ratio_token_std": mean("ratio/token_std", off), "ratio_seq_std": mean("ratio/seq_std", off),
        "engine_gap": mean("logprob/engine_diff_mean", [r for r in run.metrics if r.get("minibatch", 0) == 0]),
    }


def group_runs(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.algorithm, []).append(r)
    return groups


# --------------------------------------------------------------------------------------------- figures


def _band(series: list[list[float | None]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max across seeds at each index where every seed has a value."""
    n = min(len(s) for s in series)
    idx, mean, lo, hi = [], [], [], []
    for i in range(n):
        vals = [s[i] for s in series]
        if any(v is None for v in vals):
            continue
        idx.append(i)
        mean.append(sum(vals) / len(vals))
        lo.append(min(vals))
        hi.append(max(vals))
    return idx, mean, lo, hi


def _plot_band(ax, x, mean, lo, hi, label, style):
    ax.plot(x, mean, label=label, **_plot_kw(style, len(x)))
    if any(a != b for a, b in zip(lo, hi)):
        ax.fill_between(x, lo, hi, color=style["color"], alpha=0.18, lw=0)


_DASHES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "P", "X", "*", "h")  # no "v": an open "v" marks a zero on a log axis


def _styles(groups: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    """Per arm a colour, a line style, a marker and a width; each later arm's line and markers are smaller and drawn
    over the ones before, so that arms whose curves coincide stay apart, in grey print too."""
    colors = _colors(groups)
    return {g: {"color": colors[g], "ls": _DASHES[i % len(_DASHES)], "marker": _MARKERS[i % len(_MARKERS)],
                "ms": max(3.0, 7.0 - 1.5 * i), "lw": max(1.0, 2.8 - 0.6 * i), "zorder": 2 + 0.1 * i, "arm": i}
            for i, g in enumerate(groups)}


def _plot_kw(style: dict[str, Any], n: int, skip: set[int] = frozenset()) -> dict[str, Any]:
    """``ax.plot`` keywords of ``style`` for a line of ``n`` points: about ten markers, staggered from arm to arm so
    that coinciding lines each show theirs, and none on the points in ``skip``."""
    kw = {k: v for k, v in style.items() if k != "arm"}
    if "marker" in kw:
        every = max(1, n // 10)
        kw["markevery"] = [j for j in range(style.get("arm", 0) % every, n, every) if j not in skip]
    return kw


def _colors(groups: dict[str, list[Run]]) -> dict[str, str]:
    palette = {"gspo": "#1f77b4", "grpo": "#d62728", "gspo_token": "#2ca02c", "dapo": "#ff7f0e", "dr_grpo": "#9467bd"}
    import matplotlib

    taken = {palette[g] for g in groups if g in palette}
    # tab10's strong colours before tab20's pale ones, which vanish under the alpha of a thick line.
    spare = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["tab20"].colors[1::2]
    extra = iter(dict.fromkeys(h for h in map(matplotlib.colors.to_hex, spare) if h not in taken))
    return {g: palette.get(g) or next(extra, "#333333") for g in groups}


def _label(name: str, runs: list[Run]) -> str:
    return f"{name} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"


def fig_reward(plt, groups, styles, out: Path) -> Drawn:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for g, runs in groups.items():
        steps = [b["step"] for b in runs[0].batches()]
        idx, mean, lo, hi = _band([r.per_batch("reward/mean") for r in runs])
        _plot_band(axes[0], [steps[i] for i in idx], mean, lo, hi, _label(g, runs), styles[g])
        widx, wmean, _, _ = _band([r.per_batch("time/elapsed") for r in runs])
        wall = dict(zip(widx, wmean))
        keep = [k for k, i in enumerate(idx) if i in wall]
        _plot_band(axes[1], [wall[idx[k]] for k in keep], [mean[k] for k in keep], [lo[k] for k in keep],
                   [hi[k] for k in keep], _label(g, runs), styles[g])
    axes[0].set(xlabel="optimizer step", ylabel="mean reward of the rollout batch", title="Reward vs step")
    axes[1].set(xlabel="wall-clock (s, training loop)", title="Reward vs wall-clock")
    for ax in axes:
        ax.grid(alpha=0.3)
        _legend(ax, 8)
    return _save(fig, out / "reward.png")


def _draw_log(ax, lines: list[tuple[list, list[float], str, dict]], unit: str) -> None:
    """Draws ``lines`` (x, y, label, style) on a log y axis. A log axis cannot draw 0: zeros go on a dotted
    floor below the smallest positive value, as open triangles, and the line's legend entry counts them."""
    positive = [v for _, ys, _, _ in lines for v in ys if v > 0]
    if not positive:  # nothing a log axis could draw: a linear one draws the zeros where they are
        for x, y, label, kw in lines:
            ax.plot(x, y, label=label, **_plot_kw(kw, len(y)))
        return
    floor = min(positive) / 4
    for x, y, label, kw in lines:
        zeros = {j for j, v in enumerate(y) if v <= 0}
        if zeros:
            label += f"; 0 in {len(zeros)} of {len(y)} {unit} (\u25bd)"
            ax.plot([x[j] for j in sorted(zeros)], [floor] * len(zeros), ls="none", marker="v", mfc="none", ms=6,
                    mew=1.2, color=kw.get("color"), zorder=kw.get("zorder", 2) + 0.05)
        ax.plot(x, [v if v > 0 else floor for v in y], label=label, **_plot_kw(kw, len(y), zeros))
    ax.set_yscale("log")
    if any(v <= 0 for _, ys, _, _ in lines for v in ys):
        ax.axhline(floor, color="#888888", lw=0.8, ls=":", zorder=0.5)
        ax.text(0.01, floor * 1.15, "0 drawn here (a log scale has no 0)", transform=ax.get_yaxis_transform(),
                fontsize=7, color="#666666", va="bottom")
        ax.set_ylim(bottom=floor / 2)


CLIP_KEYS = (("clip/token_total", "clip_token", "tokens"), ("clip/seq_total", "clip_seq", "per sequence"))


def _clip_series(runs: list[Run], key: str) -> tuple[list[int], list[float]]:
    """Per rollout batch (at its first step), the mean over seeds of its off-policy steps' clipped fraction."""
    steps = [b["step"] for b in runs[0].batches()]
    idx, mean, _, _ = _band([r.per_batch(key, off_policy=True) for r in runs])
    return [steps[i] for i in idx], mean


def _seed_mean(runs: list[Run], key: str) -> float | None:
    """A key-metrics number averaged over seeds, as the table's group rows have it."""
    return mean_present([key_metrics(r)[key] for r in runs], empty=None)


def _pct(v: float | None) -> str:
    return "no off-policy step" if v is None else _fmt("clip", v)


def clipping_title(groups: dict[str, list[Run]]) -> str:
    """The arms' mean clipped-token fractions, and nothing they do not show: no ranking, no claim."""
    import textwrap

    # "\0" between an arm and its value, which textwrap does not break at, keeps the two on one line.
    arms = ", ".join(f"{g}\0{_pct(_seed_mean(runs, 'clip_token'))}" for g, runs in groups.items())
    return textwrap.fill(f"Clipped tokens, mean over the off-policy steps: {arms}", 80).replace("\0", " ")


def clipping_caption(groups: dict[str, list[Run]]) -> str:
    means = "; ".join(f"{g} {_pct(_seed_mean(runs, 'clip_token'))} of tokens, {_pct(_seed_mean(runs, 'clip_seq'))} "
                      "per sequence" for g, runs in groups.items())
    zeros = []
    for g, runs in groups.items():
        for key, _, what in CLIP_KEYS:
            _, y = _clip_series(runs, key)
            if any(v <= 0 for v in y):
                zeros.append(f"{g} {what}: 0 in {sum(v <= 0 for v in y)} of {len(y)} batches")
    zero_text = (f"A log scale cannot draw 0; batches that clipped nothing sit on the dotted floor as \u25bd: "
                 f"{'; '.join(zeros)}." if zeros else "Every batch drawn clipped something.")
    return ("Per rollout batch, the clipped fraction of its off-policy steps (minibatches after the first; every "
            "minibatch of a run whose old log-probs are the engine's), mean over "
            "seeds, log scale: thick solid, of all tokens; thin dashed, drawn on top, the mean over sequences of each "
            "sequence's clipped share of its tokens (with a sequence-level ratio, the share of sequences clipped). "
            f"Means over the off-policy steps: {means}. {zero_text}")


def fig_clipping(plt, groups, styles, out: Path) -> Drawn:
    fig, ax = plt.subplots(figsize=(9.5, 4.0))
    lines = []
    for g, runs in groups.items():
        # Tokens thick and pale, sequences thin on top: a sequence-level ratio clips all of a sequence's tokens or
        # none, so the two lines of such an arm nearly coincide.
        st = styles[g]
        tokens = {"color": st["color"], "ls": "-", "lw": 2.8, "alpha": 0.5, "zorder": st["zorder"]}
        seqs = {**st, "ls": "--", "lw": 1.1, "ms": st["ms"] - 2, "zorder": st["zorder"] + 1}
        for (key, _, what), kw in zip(CLIP_KEYS, (tokens, seqs)):
            x, y = _clip_series(runs, key)
            if x:
                lines.append((x, y, f"{g}: {what}", kw))
    _draw_log(ax, lines, "batches")
    ax.set(xlabel="optimizer step (first of its rollout batch)", ylabel="clipped fraction (off-policy steps)",
           title=clipping_title(groups))
    ax.grid(alpha=0.3, which="both")
    if lines:  # beside the axes: the lines span the whole height, from the floor to GSPO-like fractions
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, out / "clipping.png")


def _histogram_counts(run: Run) -> tuple[list[float], list[int], list[int]] | None:
    rows = [h for h in run.histograms if run.off_policy(h)]
    if not rows:
        return None
    edges = rows[0]["edges"]
    tok = [sum(h["token"][i] for h in rows) for i in range(len(edges) + 1)]
    seq = [sum(h["seq"][i] for h in rows) for i in range(len(edges) + 1)]
    return edges, tok, seq


def _band_text(band: tuple[str, float, float, str] | None) -> str:
    if band is None:
        return "no clip band (the run's config.json names no known algorithm)"
    level, low, high, objective = band
    if objective == "cispo":
        return f"CISPO's truncation band on the token ratio, 1 - {low:g} to 1 + {high:g} (tokens outside still train)"
    if objective == "gmpo":
        return f"GMPO's clip band on each token's log ratio inside the geometric mean, -{low:g} to {high:g}"
    if objective == "sapo":
        return "no clip band (SAPO's soft gate)"
    return f"clip band on the {level} ratio, 1 - {low:g} to 1 + {high:g}"


def _band_edges(band: tuple[str, float, float, str]) -> tuple[float, float] | None:
    """The band's edges on the log-ratio axis (-inf where a lower bound of 0 leaves it open); None: no band."""
    _, low, high, objective = band
    if objective == "sapo":
        return None
    if objective == "gmpo":
        return -low, high
    return (math.log(1 - low) if low < 1 else -math.inf), math.log(1 + high)


BAND_COLOR = "#e69f00"  # apart from every arm's colour: the band must not merge with the sequence-ratio bars


def _draw_clip_band(ax, band: tuple[str, float, float, str] | None) -> None:
    """The run's own clip band; its edges as lines too, so that a band narrower than a pixel still shows (an open
    lower edge is drawn from the axis' end)."""
    edges = None if band is None else _band_edges(band)
    if edges is None:
        return
    lo, hi = max(edges[0], -2.0), edges[1]
    ax.axvspan(lo, hi, color=BAND_COLOR, alpha=0.18, lw=0, zorder=0.5, label=_band_text(band))
    for x in (lo, hi) if math.isfinite(edges[0]) else (hi,):
        ax.axvline(x, color=BAND_COLOR, lw=1.0, zorder=0.6)  # under the histograms


def fig_ratios(plt, groups, styles, out: Path) -> Drawn | None:
    data = {g: (runs[0], _histogram_counts(runs[0])) for g, runs in groups.items()}
    data = {g: d for g, d in data.items() if d[1] is not None}
    if not data:
        return None
    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 3.8), squeeze=False)
    for ax, (g, (run, (edges, tok, seq))) in zip(axes[0], data.items()):
        # A linear log-ratio axis, so that clip bands keep their true widths (3e-4 is a sliver next to 0.2); the
        # bins are log-spaced, so each is drawn as a density (fraction of the items / bin width) on a log scale.
        bounds = [-2.0, *edges[1:-1], 2.0]  # beyond +-1 merged into one bin a side, drawn out to +-2 (off the axis)
        counts_tok = [tok[0] + tok[1], *tok[2:-2], tok[-2] + tok[-1]]
        counts_seq = [seq[0] + seq[1], *seq[2:-2], seq[-2] + seq[-1]]
        widths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        lowest = math.inf
        for counts, label, color in ((counts_tok, "token ratios", "#555555"),
                                     (counts_seq, "sequence ratios", styles[g]["color"])):
            total = max(sum(counts), 1)
            dens = [c / total / w for c, w in zip(counts, widths)]
            lowest = min([lowest] + [d for d in dens if d > 0])
            ax.stairs(dens, bounds, label=f"{label} (n={sum(counts):,})", color=color, lw=1.6)
        _draw_clip_band(ax, clip_band(run.config))
        ax.set_yscale("log")
        if math.isfinite(lowest):
            ax.set_ylim(bottom=lowest / 3)
        ax.set_xlim(-0.6, 0.6)
        ax.set(xlabel="log ratio  log(pi / pi_old)", ylabel="density (fraction per unit log ratio)",
               title=f"{g} ({run.name}): ratios of the off-policy steps")
        ax.grid(alpha=0.3)
        _legend(ax, 7)
    return _save(fig, out / "ratios.png")


def ratios_caption(groups: dict[str, list[Run]]) -> str:
    bands = "; ".join(f"{g}: {_band_text(clip_band(runs[0].config))}" for g, runs in groups.items()
                      if _histogram_counts(runs[0]) is not None)
    return ("Distribution of token ratios and of sequence ratios (geometric mean of a sequence's token ratios) over "
            "the off-policy steps of the first run of each arm, on one log-ratio axis; density on a log scale, an "
            "empty bin drops to the bottom edge. Each panel shades the clip band its run's config.json set (edges "
            f"drawn as lines, so that a band narrower than a pixel shows): {bands}.")


def _pick_trace(groups) -> tuple[str, dict[str, Any]] | None:
    """The most extreme trace of the GSPO-like group if any, else of any group: the strip is about outliers."""
    order = sorted(groups, key=lambda g: (g != "gspo", g))
    for g in order:
        traces = [t for r in groups[g] for t in r.traces if t.get("tokens") and t.get("seq_log_ratio") is not None
                  and all(x is not None and math.isfinite(x) for x in t["token_log_ratio"])]
        if traces:
            # A response that carries gradient (non-zero advantage) first, then the most extreme token ratio.
            return g, max(traces, key=lambda t: (t["advantage"] != 0, max(abs(x) for x in t["token_log_ratio"])))
    return None


def fig_token_strip(plt, groups, out: Path) -> Drawn | None:
    picked = _pick_trace(groups)
    if picked is None:
        return None
    g, t = picked
    import matplotlib
    from matplotlib import cm, colors as mcolors

    lrs = t["token_log_ratio"]
    lim = max(max(abs(x) for x in lrs), 1e-3)
    # Symmetric log colours: one outlier token must not wash out the 1e-3..1e-1 ratios of all the others.
    norm = mcolors.SymLogNorm(linthresh=1e-3, vmin=-lim, vmax=lim, base=10)
    cmap = matplotlib.colormaps["coolwarm"]
    per_line, n = 16, len(lrs)
    lines = math.ceil(n / per_line)
    fig, ax = plt.subplots(figsize=(12, 0.55 * lines + 2.0))
    outliers = sorted(range(n), key=lambda i: -abs(lrs[i]))[:3]
    for i, (tok, lr) in enumerate(zip(t["tokens"], lrs)):
        row, col = divmod(i, per_line)
        text = tok.replace("\n", "\\n") or " "
        ax.text(col + 0.5, -row, text, ha="center", va="center", fontsize=8, family="monospace",
                bbox=dict(boxstyle="round,pad=0.25", fc=cmap(norm(lr)), ec="#999999" if i not in outliers else "black",
                          lw=0.5 if i not in outliers else 1.5))
        if i in outliers:
            ax.annotate(f"r = {math.exp(lr):.4f}", (col + 0.5, -row + 0.28), ha="center", fontsize=7, color="black")
    seq = math.exp(t["seq_log_ratio"])
    ax.set_xlim(0, per_line)
    ax.set_ylim(-lines + 0.4, 0.8)
    ax.axis("off")
    ax.set_title(f"{g}, step {t['step']} (minibatch {t['minibatch']}): token ratios; sequence ratio = geometric mean = "
                 f"{seq:.5f}; advantage {t['advantage']:+.2f}", fontsize=9)
    bar = fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, orientation="horizontal", fraction=0.05,
                       pad=0.02, shrink=0.7, aspect=50, label="token log ratio (symmetric log colour scale)")
    ticks = [v for v in (-1.0, -0.01, 0.0, 0.01, 1.0) if abs(v) <= lim]
    bar.set_ticks(ticks, labels=[f"{v:g}" for v in ticks])
    return _save(fig, out / "token_strip.png")


def _probe_run(groups) -> Run | None:
    """The first run holding a ``gspo probe noise`` result: the page draws one probe."""
    return next((r for runs in groups.values() for r in runs if r.probe), None)


def _probed_model(run: Run) -> str:
    """The model the probe measured, as its config's model.name loaded it: the run's base model when the run's own
    config names the same."""
    name = run.probe.get("model", "an unnamed model")
    base = (run.config.get("model") or {}).get("name")
    return f"the base model {name}" if base in (None, name) else f"{name} (this run's base model is {base})"


def _probe_updates(probe: dict[str, Any]) -> str:
    if "minibatches" not in probe or "algorithm_of_the_updates" not in probe:
        return "moved off-policy by its minibatch updates"
    k = probe["minibatches"] - 1
    return f"moved off-policy by {k} {probe['algorithm_of_the_updates']} update{'s' * (k != 1)} on it"


def noise_title(run: Run) -> str:
    n = run.probe.get("responses", "?")
    return (f"gspo probe noise on {_probed_model(run)}:\none rollout batch it sampled, {_probe_updates(run.probe)}; "
            f"{n} responses probed")


def noise_caption(groups: dict[str, list[Run]]) -> str:
    run = _probe_run(groups)
    return (f"From gspo probe noise ({run.name}/probe_noise.json), measured on {_probed_model(run)} as the probe's "
            f"model.name loaded it: one rollout batch it sampled, {_probe_updates(run.probe)} (as far off-policy as a "
            "batch's last minibatch in training). By response length: the variance of the per-token gradient weights (GRPO: "
            "token ratios; GSPO: one sequence ratio per response), the per-response gradient norm, and the share of "
            f"the gradient the importance weights add. {_LOG_ZERO}")


# The probe's two objectives, apart as arms are (GSPO's and GRPO's gradient norms nearly coincide).
_OBJECTIVES = {"grpo": {"color": "#d62728", "ls": "-", "marker": "o", "lw": 2.6, "ms": 6, "zorder": 2},
               "gspo": {"color": "#1f77b4", "ls": "--", "marker": "s", "lw": 1.3, "ms": 4, "zorder": 2.1}}


def fig_noise(plt, groups, out: Path) -> Drawn | None:
    run = _probe_run(groups)
    if run is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.3))
    for ax, key in zip(axes, ("weight_var", "grad_norm", "is_noise")):
        _draw_log(ax, [([b["length_mid"] for b in rows], [b[key] for b in rows], algo,
                        _OBJECTIVES.get(algo, {"color": "#333333", "marker": "o"}))
                       for algo, rows in run.probe["by_algorithm"].items()], "length bins")
    axes[0].set(xlabel="response length (tokens)", ylabel="variance", title="Per-token gradient weights")
    axes[1].set(xlabel="response length (tokens)", ylabel="norm", title="Per-response gradient norm")
    axes[2].set(xlabel="response length (tokens)", ylabel="||g_IS - g_on|| / ||g_on||", title="Noise from importance weights")
    fig.suptitle(noise_title(run), fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        _legend(ax, 8)
    return _save(fig, out / "noise.png")


def noise_figure(probe: dict[str, Any], path: str | Path) -> Path:
    """The gradient-noise figure of one ``gspo probe noise`` result, on its own (``gspo probe`` draws it beside its JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    run = Run(path.parent, "probe", 0, {}, [], probe=probe)
    fig_noise(plt, {"probe": [run]}, path.parent)
    produced = path.parent / "noise.png"
    if produced != path:
        produced.replace(path)
    return path


def fig_length_entropy(plt, groups, styles, out: Path) -> Drawn:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for g, runs in groups.items():
        steps = [b["step"] for b in runs[0].batches()]
        for ax, key in zip(axes, ("completion/len_mean", "entropy")):
            idx, mean, lo, hi = _band([r.per_batch(key) for r in runs])
            _plot_band(ax, [steps[i] for i in idx], mean, lo, hi, _label(g, runs), styles[g])
    axes[0].set(xlabel="optimizer step", ylabel="tokens", title="Mean response length")
    axes[1].set(xlabel="optimizer step", ylabel="nats per token", title="Policy entropy (on-policy step)")
    for ax in axes:
        ax.grid(alpha=0.3)
        _legend(ax, 8)
    return _save(fig, out / "length_entropy.png")


def fig_moe(plt, groups, styles, out: Path) -> Drawn | None:
    """Expert volatility: ``moe/flip_rate`` per optimizer step (mean over seeds, band over seeds), and for each arm a
    layer x step heat map of ``moe/flip_rate/layer_<i>`` (mean over seeds). None for dense runs."""
    moe = {g: runs for g, runs in groups.items() if any(r.get("moe/flip_rate") is not None for run in runs for r in run.metrics)}
    if not moe:
        return None
    fig, axes = plt.subplots(1, 1 + len(moe), figsize=(5.5 * (1 + len(moe)), 3.8), squeeze=False)
    axes = axes[0]
    for ax, (g, runs) in zip(axes[1:], moe.items()):
        steps = [r["step"] for r in runs[0].metrics]
        series = [[r.get("moe/flip_rate") for r in run.metrics] for run in runs]
        idx, mean, lo, hi = _band(series)
        if not idx:
            continue
        _plot_band(axes[0], [steps[i] for i in idx], mean, lo, hi, _label(g, runs), styles[g])
        layers = sorted({int(k.rsplit("_", 1)[1]) for k in runs[0].metrics[-1] if k.startswith("moe/flip_rate/layer_")})
        grid = [[mean_present([run.metrics[i].get(f"moe/flip_rate/layer_{layer}") for run in runs
                               if i < len(run.metrics)]) for i in idx] for layer in layers]
        image = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower", interpolation="nearest",
                          extent=(steps[idx[0]] - 0.5, steps[idx[-1]] + 0.5, -0.5, len(layers) - 0.5))
        ax.set(xlabel="optimizer step (off-policy steps)", ylabel="layer", title=f"{g}: flip rate per layer")
        fig.colorbar(image, ax=ax, fraction=0.05)
    axes[0].set(xlabel="optimizer step", ylabel="fraction of (token, layer, slot)", title="MoE routing flips per update")
    axes[0].grid(alpha=0.3)
    _legend(axes[0], 8)
    return _save(fig, out / "moe_flips.png")


def minibatch_means(runs: list[Run], key: str) -> dict[int, float | None]:
    """``key`` averaged over every step and run at each minibatch index (0 = the on-policy step)."""
    rows: dict[int, list] = {}
    for run in runs:
        for r in run.metrics:
            rows.setdefault(r.get("minibatch", 0), []).append(r.get(key))
    return {k: mean_present(rows[k], empty=None) for k in sorted(rows)}


def length_bins_seen(rows: list[dict[str, Any]]) -> list[str]:
    """The response-length bins (``bylen/<bin>/*``) that hold responses in ``rows``, shortest first."""
    names = {k.split("/")[1] for r in rows for k, v in r.items() if k.startswith("bylen/") and k.endswith("/seqs") and v}
    return sorted(names, key=lambda n: int(n.split("-")[0].rstrip("+")))


def fig_minibatch_depth(plt, groups, styles, out: Path) -> Drawn | None:
    """Off-policy depth: clipped fraction and ratio spread against the minibatch's index in its rollout batch (0 is
    the on-policy step, drawn only for runs whose π_old is the engine's; k is k optimizer steps away from the policy
    that sampled), mean over steps and seeds. None when no run has an off-policy step."""
    if not any(run.off_policy(r) for runs in groups.values() for run in runs for r in run.metrics):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    panels = (("clip/token_total", "clipped tokens"), ("ratio/token_std", "std of token ratios"),
              ("ratio/seq_std", "std of sequence ratios"))
    for ax, (key, what) in zip(axes, panels):
        lines = []
        for g, runs in groups.items():
            # (minibatch 0 too where the run's π_old is the engine's: Run.off_policy)
            engine_old = any(run.engine_old for run in runs)
            pts = [(k, y) for k, y in minibatch_means(runs, key).items() if (k > 0 or engine_old) and y is not None]
            if pts:
                lines.append(([p[0] for p in pts], [p[1] for p in pts], _label(g, runs),
                              styles[g]))
        _draw_log(ax, lines, "minibatches")
        ax.set(xlabel="minibatch index k in its rollout batch (k steps off-policy)", ylabel=what, title=what)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3, which="both")
    _legend(axes[0], 7)
    return _save(fig, out / "minibatch_depth.png")


def fig_by_length(plt, groups, styles, out: Path) -> Drawn | None:
    """By response length: clipped fraction and ratio spreads of each length bin (``bylen/<bin>/*``), mean over the
    off-policy steps and seeds. None unless responses fell in two or more bins."""
    off = {g: [r for run in runs for r in run.metrics if run.off_policy(r)] for g, runs in groups.items()}
    names = length_bins_seen([r for rows in off.values() for r in rows])
    if len(names) < 2:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, (key, what) in zip(axes, (("clip_token", "clipped tokens"), ("ratio_token_std", "std of token ratios"),
                                      ("ratio_seq_std", "std of sequence ratios"))):
        lines = []
        for g, runs in groups.items():
            ys = [mean_present([r.get(f"bylen/{n}/{key}") for r in off[g]], empty=None) for n in names]
            pts = [(i, y) for i, y in enumerate(ys) if y is not None]
            if pts:
                lines.append(([p[0] for p in pts], [p[1] for p in pts], _label(g, runs),
                              styles[g]))
        _draw_log(ax, lines, "length bins")
        ax.set_xticks(range(len(names)), names)
        ax.set(xlabel="response length (tokens), off-policy steps", ylabel=what, title=f"{what}, by length")
        ax.grid(alpha=0.3, which="both")
    _legend(axes[0], 7)
    return _save(fig, out / "by_length.png")


def fit_titles(fig) -> None:
    """Wrap every panel's title (and the figure's) onto as many lines as its width needs: a long one (a run's name,
    a trace's sequence ratio) ran past its panel and was cut at the image's edge."""
    import textwrap

    renderer = fig.canvas.get_renderer()
    texts = [(ax.title, ax.get_position().width * fig.bbox.width) for ax in fig.axes if ax.get_title()]
    if fig.get_suptitle():
        texts.append((fig._suptitle, fig.bbox.width))  # (matplotlib's Text of the suptitle: no public getter)
    for text, room in texts:
        flat = text.get_text().replace("\n", " ")
        text.set_text(flat)
        width = text.get_window_extent(renderer).width
        if width > room:
            text.set_text(textwrap.fill(flat, max(20, int(len(flat) * room / width * 0.95)), break_on_hyphens=False))


def _save(fig, path: Path) -> Drawn:
    """Writes the PNG; returns its file name and its titles, which the page repeats as the image's alt text."""
    fit_titles(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    titles = [t for t in [fig.get_suptitle()] + [ax.get_title() for ax in fig.axes] if t]
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name, " | ".join(t.replace("\n", " ") for t in titles)


# --------------------------------------------------------------------------------------------- page

_COLUMNS = [("run", "run"), ("algorithm", "algorithm"), ("seed", "seed"), ("steps", "steps"),
            ("clip_token", "clipped tokens"), ("clip_seq", "clipped sequences"), ("reward_first", "reward, first"),
            ("reward_final", "reward, final (last 10)"), ("reward_best", "best (5-batch mean)"),
            ("largest_drop", "largest drop"), ("entropy_end", "entropy, end"), ("ratio_token_std", "token-ratio std"),
            ("ratio_seq_std", "sequence-ratio std"), ("engine_gap", "engine gap / token"), ("flip_rate", "MoE flip rate"),
            ("wall_s", "wall-clock s")]


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key.startswith("clip"):
        return f"{100 * v:.3g}%"
    if isinstance(v, float):
        return f"{v:.0f}" if key in ("wall_s", "steps") else f"{v:.3g}" if key in ("ratio_seq_std", "engine_gap") else f"{v:.3f}"
    return html.escape(str(v))


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    """The columns' labels, saying what was computed: over all of a run's batches where it has fewer than 10 (final)
    or 5 (best, per batch)."""
    from gspo.commands.tables import window_label

    batches = [r["final_n"] for r in rows if r.get("final_n") is not None]
    best = {r["best_k"] for r in rows if r.get("best_k") is not None}
    labels = {"reward_final": window_label("reward, final (last 10)", 10, batches),
              "reward_best": "best (5-batch mean)" if best <= {5} else "best (batch)" if best == {1} else
              "best (5-batch mean, or batch where fewer)"}
    return [labels.get(k, t) for k, t in _COLUMNS]


def metrics_table(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    labels = _labels(rows)
    if markdown:
        head = "| " + " | ".join(labels) + " |\n|" + "---|" * len(_COLUMNS) + "\n"
        return head + "".join("| " + " | ".join(_fmt(k, r.get(k)) for k, _ in _COLUMNS) + " |\n" for r in rows)
    head = "<tr>" + "".join(f"<th>{t}</th>" for t in labels) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{_fmt(k, r.get(k))}</td>" for k, _ in _COLUMNS) + "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


def group_means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per algorithm: the mean of each number over its seeds; when the seeds trained different numbers of
    steps (a run stopped by the sentinel), the row's name says so, with their range: its "final" numbers are then
    each seed's at its own last step."""
    out = []
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == algo]
        steps = sorted({r["steps"] for r in mine if r.get("steps") is not None})
        uneven = f"; steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else ""
        mean_row: dict[str, Any] = {"run": f"{algo} (mean of {len(mine)}{uneven})", "algorithm": algo, "seed": None}
        for k, _ in _COLUMNS[3:]:
            xs = [r[k] for r in mine if r.get(k) is not None]
            mean_row[k] = sum(xs) / len(xs) if xs else None
        out.append(mean_row)
    return out


_LOG_ZERO = ("A log scale cannot draw 0: a zero sits on the dotted floor line as \u25bd, and the legend counts a "
             "line's zeros.")
_CAPTIONS = {
    "reward.png": "Mean reward of each rollout batch against optimizer steps and against the training loop's wall-clock; "
                  "the line is the mean over seeds, the band spans the lowest to the highest seed.",
    "token_strip.png": "One response of an off-policy step, each token shaded by its ratio (blue below 1, red above); the "
                       "three most extreme tokens are outlined and labelled. The sequence ratio is their geometric mean.",
    "length_entropy.png": "Mean response length and policy entropy per rollout batch (mean over seeds, band over seeds).",
    "minibatch_depth.png": "Off-policy depth: clipped fraction and the spread of token and sequence ratios in each "
                           "minibatch of a rollout batch, against its index (k = k optimizer steps after the policy "
                           f"that sampled), mean over steps and seeds, log scale. {_LOG_ZERO}",
    "by_length.png": "By response length: clipped fraction and ratio spreads of the responses in each length bin, mean "
                     f"over the off-policy steps and seeds, log scale. {_LOG_ZERO}",
    "moe_flips.png": "MoE expert volatility: the fraction of (token, layer, top-k slot) whose old-policy expert is not "
                     "among the current policy's top-k, per off-policy optimizer step (left; with Routing Replay, "
                     "measured inside the replay), and per layer (right, one map per arm, mean over seeds).",
}

def caption(name: str, groups: dict[str, list[Run]]) -> str:
    """The caption of figure ``name``: fixed text, or for the figures that quote numbers, computed from the runs."""
    computed = {"clipping.png": clipping_caption, "ratios.png": ratios_caption, "noise.png": noise_caption}
    return computed[name](groups) if name in computed else _CAPTIONS[name]


_LOADED_CHECK = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute('data-images-loaded', ok + '/' + imgs.length);
});
</script>"""


def conversations(runs: list[Run], per_run: int = 2) -> str:
    """HTML of the last logged multi-turn samples of each run (``samples.jsonl`` rows with ``turns``): the prompt, then
    the completion with the tokens the policy sampled -- the trained ones -- marked, and the appended messages (tool
    results, observations, template) plain. Empty when no run has multi-turn samples."""
    parts = []
    for run in runs:
        path = run.path / "samples.jsonl"
        rows = [r for r in read_jsonl(path) if r.get("turns")] if path.exists() else []
        if not rows:
            continue
        last = [r for r in rows if r.get("rollout_batch") == rows[-1].get("rollout_batch")][:per_run]
        for r in last:
            pieces = "".join(f"<span class='{'trained' if p.get('trained') else 'appended'}'>"
                             f"{html.escape(str(p.get('text', '')))}</span>" for p in r["turns"])
            parts.append(f"<div class='convo'><p class='note'>{html.escape(run.name)}, step {r.get('step')}, reward "
                         f"{_fmt('reward', r.get('reward'))}</p><pre>{html.escape(str(r.get('prompt', '')))}</pre>"
                         f"<pre>{pieces}</pre></div>")
    if not parts:
        return ""
    return ("<h2>Conversations</h2><p class='note'>The last logged samples of each multi-turn run: "
            "<span class='trained'>highlighted</span> text is what the policy sampled and is trained on; plain text "
            "was appended (tool results, observations, the chat template) and is out of the loss.</p>" + "".join(parts))


def write_report(run_dirs: list[str | Path], out_dir: str | Path, title: str = "gspo report") -> Path:
    """Figures and ``index.html`` for ``run_dirs`` in ``out_dir``; returns the HTML path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise UserError("gspo report needs at least one run directory.")
    runs = load_runs(run_dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    styles = _styles(groups)
    figures = [fig_reward(plt, groups, styles, out), fig_clipping(plt, groups, styles, out),
               fig_ratios(plt, groups, styles, out), fig_token_strip(plt, groups, out),
               fig_noise(plt, groups, out), fig_length_entropy(plt, groups, styles, out),
               fig_moe(plt, groups, styles, out), fig_minibatch_depth(plt, groups, styles, out),
               fig_by_length(plt, groups, styles, out)]
    rows = [key_metrics(r) for r in runs]
    table_rows = rows + (group_means(rows) if any(len(v) > 1 for v in groups.values()) else [])
    (out / "summary.json").write_text(json.dumps({"runs": rows, "groups": group_means(rows)}, indent=1))
    (out / "table.md").write_text(metrics_table(table_rows, markdown=True))
    sections = "".join(f"<figure><img src='{f}' alt='{html.escape(alt, quote=True)}'><figcaption>"
                       f"{html.escape(caption(f, groups))}</figcaption></figure>" for f, alt in filter(None, figures))
    missing = [] if figures[4] else ["<p class='note'>No gradient-noise figure: run <code>gspo probe noise</code> on a "
                                     "run directory to add it.</p>"]
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222}}
figure{{margin:1.5em 0}}img{{max-width:100%;border:1px solid #ddd}}figcaption{{font-size:.9em;color:#555}}
table{{border-collapse:collapse;font-size:.85em;display:block;overflow-x:auto;max-width:100%}}td,th{{border:1px solid #ccc;padding:3px 7px;text-align:right}}
.note{{color:#777}}pre{{white-space:pre-wrap;background:#fafafa;border:1px solid #eee;padding:.5em;font-size:.85em}}
.trained{{background:#d8f0d8}}.appended{{color:#555}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{len(runs)} run(s): {", ".join(html.escape(f"{r.name} ({r.algorithm}, seed {r.seed})") for r in runs)}.</p>
{sections}{"".join(missing)}
<h2>Key numbers</h2>{metrics_table(table_rows)}
<p class="note">Clipping: mean over the off-policy steps. Final reward: mean of the last 10 rollout batches (all of them,
in a shorter run). Best: the best 5-batch moving average (the best batch, in a run of fewer than 5); largest drop: the
largest fall of that average (of the batches' rewards, under 5) from its running maximum. Wall-clock: the training
loop.</p>
{conversations(runs)}
{_LOADED_CHECK}
</body></html>
"""
    path = out / "index.html"
    path.write_text(page)
    return path
