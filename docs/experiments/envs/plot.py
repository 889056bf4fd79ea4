"""The figure of docs/experiments/envs/README.md from runs.json (per rollout batch: step, seconds, mean reward)."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).resolve().parent
runs = json.loads((here / "runs.json").read_text())["runs"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, prefix, title in ((axes[0], "calculator", "calculator tool: 3-digit products (accuracy)"),
                          (axes[1], "guess_number", "guess a number 1-10 (reward, optimum ~0.81)")):
    for label, run in runs.items():
        if label.startswith(prefix):
            b = run["batches"]
            ax.plot([r[0] for r in b], [r[2] for r in b], label=label.removeprefix(prefix + " "), lw=1.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the rollout batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "reward.png", dpi=110)
