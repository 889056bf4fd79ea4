"""Reward of the reference run at each rollout.max_staleness, GSPO, GRPO and DAPO (mean and range of 3 seeds), per rollout
batch (top) and per version of the policy that sampled it (bottom: batch - max_staleness; a batch's reward measures
the policy that sampled it): reward.png. Then the plateau against max_staleness, with and without the decoupled
correction (TIS): eta.png. python docs/experiments/async/plot.py -> both beside it, from curves.json."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
curves = json.loads((HERE / "curves.json").read_text())
COLORS = {0: "black", 1: "tab:blue", 2: "tab:green", 4: "tab:orange", 8: "tab:red"}
ETAS = {"gspo": (0, 1, 2, 4, 8), "grpo": (0, 1, 2, 4, 8), "dapo": (0, 1, 2, 4, 8)}  # the arms that were run
TIS_ETAS = (1, 2, 4, 8)  # gspo and grpo with loss.mismatch_correction = "tis"
fig, grid = plt.subplots(2, 3, figsize=(15, 7.5), sharey=True)
for (row, by_version), (ax, algo) in [((r, r == 1), (grid[r][c], a)) for r in (0, 1) for c, a in enumerate(ETAS)]:
    for eta in ETAS[algo]:
        color = COLORS[eta]
        runs = [curves[f"{algo}_eta{eta}_s{s}"] for s in (1, 2, 3)]
        n = min(len(r) for r in runs)
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(n)]
        x = [i - eta if by_version else i for i in range(n)]
        ax.plot(x, mean, color=color, label=f"max_staleness {eta}")
        ax.fill_between(x, [min(r[i] for r in runs) for i in range(n)],
                        [max(r[i] for r in runs) for i in range(n)], color=color, alpha=0.12)
    ax.set_title(f"{algo.upper()}, 3 seeds (mean, range)")
    ax.set_xlabel("version of the sampling policy (rollout batches trained)" if by_version
                  else "rollout batch (4 optimizer steps each)")
    if by_version:
        ax.set_xlim(-1, 40)
    ax.grid(alpha=0.3)
for r in (0, 1):
    grid[r][0].set_ylabel("reward (accuracy on a + b)")
grid[0][0].legend(loc="lower right")
fig.tight_layout()
fig.savefig(HERE / "reward.png", dpi=110)


def plateau(curve: list[float], eta: int, by_version: bool) -> float:
    """Mean reward of the last 10 rollout batches, or of the batches that policy versions 22-31 sampled."""
    window = curve[eta + 22:eta + 32] if by_version else curve[-10:]
    return sum(window) / len(window)


fig, grid = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
for ax, algo in zip(grid, ETAS):
    arms = [("", ETAS[algo], "-", "no correction")]
    if algo != "dapo":
        arms.append(("_tis", TIS_ETAS, "--", "TIS"))
    for suffix, etas, style, label in arms:
        for by_version, color in ((False, "tab:blue"), (True, "tab:orange")):
            per_seed = [[plateau(curves[f"{algo}_eta{e}_s{s}{suffix}"], e, by_version) for s in (1, 2, 3)] for e in etas]
            mean = [sum(v) / 3 for v in per_seed]
            ax.errorbar(list(etas), mean, yerr=[[m - min(v) for m, v in zip(mean, per_seed)],
                                                [max(v) - m for m, v in zip(mean, per_seed)]],
                        color=color, linestyle=style, marker="o", capsize=3,
                        label=f"{'versions 22-31' if by_version else 'last 10 batches'}, {label}")
    ax.set_title(f"{algo.upper()}, 3 seeds (mean, range)")
    ax.set_xlabel("rollout.max_staleness (eta)")
    ax.set_xticks(ETAS[algo])
    ax.grid(alpha=0.3)
grid[0].set_ylabel("reward (accuracy on a + b)")
grid[0].legend(loc="lower left", fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "eta.png", dpi=110)
