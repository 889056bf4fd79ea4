"""One rollout batch's update (prepare, then every minibatch's optimizer step) on a fixed batch, for each preset and a
few settings, in one process or under torchrun: rank 0 writes the metrics and the full weights after it, which
test_dist compares across process counts. Usage: step_worker.py OUT_FILE [fsdp|ddp]."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import tiny_llama  # noqa: E402
from test_moe import tiny_moe  # noqa: E402

from gspo.parallel import comm  # noqa: E402
from gspo.parallel.fsdp import full_value  # noqa: E402
from gspo.config import build_config  # noqa: E402
from gspo.runtime import Runtime  # noqa: E402
from gspo.train.actor import build_actor  # noqa: E402
from gspo.types import Batch, Rollout  # noqa: E402

CASES = {
    "gspo": [], "gspo_token": [], "grpo": [], "dapo": ["dapo.overlong_cache=4"], "dr_grpo": [],
    "grpo-kl-micro": ["algorithm='grpo'", "loss.beta=0.04", "train.micro_batch_size=2"],
    "gspo-rollout-logprobs": ["algorithm='gspo'", "train.old_logprobs='rollout'", "train.minibatches=4"],
    # MoE: routing records are kept by batch row, so each process replays its own rows; flip counts are summed
    "mixtral-r2": ["algorithm='grpo'", "moe.routing_replay='old'"],
    "qwen3_moe": ["algorithm='grpo'"],
    # LoRA: every process holds the frozen base and rank 0's adapters (each starts from its own random ones here),
    # the adapters' gradients are summed
    "gspo-lora": ["algorithm='gspo'", "lora.rank=4", "lora.alpha=8"],
    # PPO: the value model is held as the policy is (sharded or replicated), its values shared, its gradients summed
    "ppo": ["ppo.critic_lr=1e-2"],
}


def fixed_batch(n: int = 16, width: int = 12, vocab: int = 512) -> Batch:
    """Rows of uneven prompt and completion lengths (so the processes' slices hold different token counts)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = torch.arange(width)[None] < lengths[:, None]  # (N, T)
    ids = torch.randint(3, vocab, (n, width), generator=g).masked_fill(~mask, 2)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    engine_logp = (-torch.rand(n, width, generator=g) * 4).masked_fill(~mask, 0.0)
    rollout = Rollout(prompts, ids, mask, engine_logp, ["stop"] * n, [""] * n, pad_id=2)
    return Batch(rollout, [None] * n, torch.zeros(n), torch.randn(n, generator=g), mask.clone(), {})  # PPO: the
    # advantages stand for the rewards, which the value model's GAE turns into advantages


def run(name: str, extra: list[str], strategy: str) -> dict:
    algorithm = [] if any(e.startswith("algorithm=") for e in extra) else [f"algorithm='{name}'"]
    cfg = build_config({}, [*algorithm, "rollout.prompts_per_batch=4", "rollout.group_size=4", "train.minibatches=2",
                            "train.steps=8", "train.lr=1e-2", "rollout.max_new_tokens=12", "model.device='cpu'",
                            "model.precision='fp32'", *extra], device="cpu")
    runtime = Runtime.from_config(cfg.model)
    family = name.split("-")[0]
    moe = family in ("mixtral", "qwen3_moe")
    if cfg.lora.rank:
        torch.manual_seed(100 + comm.rank_world()[0])  # different random adapters in every process, until replicated
    world = comm.rank_world()[1]
    # LoRA trains replicated whatever the strategy of the others
    held = "single" if world == 1 else "ddp" if cfg.lora.rank else strategy
    actor = build_actor(cfg, runtime, tiny_moe(family) if moe else tiny_llama(vocab_size=512, seed=0), held)
    batch = fixed_batch(vocab=256 if moe else 512)
    tokens = torch.tensor([len(p) for p in batch.rollout.prompt_ids]) + batch.rollout.lengths
    plan = actor.plan(16, tokens)  # under torchrun: slices balanced by tokens
    actor.prepare(batch, plan)
    steps, grads = [], {}
    for k in range(cfg.train.minibatches):
        out = actor.step(batch, plan, k, k)
        steps.append({key: float(v) for key, v in out.metrics.items()})
        if k == 0:  # gradients stay in .grad after the optimizer step
            grads = {n: full_value(p.grad).clone() for n, p in actor.model.named_parameters()
                     if p.grad is not None}
    return {"steps": steps, "grads": grads, "grad_scale": max(float(g.abs().max()) for g in grads.values()),
            "weights": {n: t.clone() for n, t in actor.weights()}, "old_logprobs": batch.old_logprobs.clone()}


if __name__ == "__main__":
    comm.init(torch.device("cpu"), 120)
    strategy = sys.argv[2] if len(sys.argv) > 2 else "fsdp"
    results = {name: run(name, extra, strategy) for name, extra in CASES.items()}
    if comm.rank_world()[0] == 0:
        torch.save(results, sys.argv[1])
    if torch.distributed.is_initialized():  # an orderly end: no process leaves while another still talks to it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    comm.close()
