"""The figure of docs/experiments/envs/README.md from runs.json (per rollout batch: step, seconds, mean reward).

Left: the calculator's three-seed runs of leases 2 and 3, coloured by objective (the short ones ran out of GPU memory in
lease 2; GSPO-token's seeds 1 and 2 are lease 3's), and lease 1's run without the worked example (grey). Middle:
guess_number's three seeds of each arm. Right: running_total's two seeds of GSPO-token with and without per-turn
credit (lease 3)."""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).resolve().parent
runs = json.loads((here / "runs.json").read_text())["runs"]
colors = {"gspo": "tab:blue", "grpo": "tab:orange", "gspo_token": "tab:green", "gspo_token+envcredit": "tab:red"}
fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
for ax, task, title, last in ((axes[0], "calculator", "calculator tool: 3-digit products (accuracy)", 1000),
                              (axes[1], "guess_number", "guess a number 1-10 (reward, optimum ~0.81)", 300),
                              (axes[2], "running_total", "running total, paid per turn (fraction right)", 300)):
    shown = set()
    for label, run in runs.items():
        b = [r for r in run["batches"] if r[0] <= last]
        steps, reward = [r[0] for r in b], [r[2] for r in b]
        if task == "calculator" and label == "lease 1: calculator gspo, no example":
            ax.plot(steps, reward, color="grey", ls="--", lw=1, label="gspo, no worked example (lease 1)")
        if not (label.startswith(f"lease 2: {task} ") or label.startswith(f"lease 3: {task} ")):
            continue
        arm = label.split(" ")[3].split("-seed")[0]
        ax.plot(steps, reward, color=colors[arm], lw=1, alpha=0.8, label=None if arm in shown else arm)
        shown.add(arm)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the rollout batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "reward.png", dpi=110)
