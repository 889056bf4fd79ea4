"""Policy-update throughput and peak memory: gspo's update against a plain HF forward/backward loop, same batch.

  python benchmarks/train_step.py --model /root/smollm2/model.gguf --out $OUT/train_step.json
  python benchmarks/train_step.py --model qwen2.5-0.5b-shape --out $OUT/train_step_qwen.json   # random init

One step = forward, loss, backward over ``batch`` sequences of ``prompt + completion`` tokens (random ids; the last
``completion`` positions are the completion, a quarter of the rows end early), with bf16 autocast on fp32 weights.

- ``plain HF``: ``model(input_ids).logits`` -> fp32 log_softmax over the full vocabulary -> gather -> GSPO loss.
- ``gspo``: ``gspo.logprobs.sequence_logprobs`` (the decoder once, the LM head in checkpointed chunks over completion
  tokens only) -> ``gspo.policy_loss``.
- ``gspo logprob pass``: the no-grad old-policy pass alone.

Reports completion tokens per second (median of the timed repeats after warm-up) and the peak memory of each path.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gspo import policy_loss  # noqa: E402
from gspo.logprobs import sequence_logprobs  # noqa: E402
from gspo.models import attention_context, autocast_context, load_model  # noqa: E402
from shapes import qwen25_05b_shape  # noqa: E402


def make_batch(batch: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    comp = torch.randint(3, vocab, (batch, completion), generator=g)  # (B, T)
    lengths = torch.full((batch,), completion)
    lengths[: batch // 4] = completion // 3  # some rows end early, as real completions do
    mask = torch.arange(completion)[None, :] < lengths[:, None]  # (B, T)
    return prompts, comp, mask


def plain_step(model, prompts, comp, mask, adv, autocast, device):
    ids = torch.cat([torch.tensor(prompts), comp], 1).to(device)  # (B, P+T)
    P = len(prompts[0])
    with autocast_context(device, autocast), attention_context():
        logits = model(ids).logits[:, P - 1:-1]  # (B, T, V)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P:, None]).squeeze(-1)  # (B, T)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask.to(device), level="sequence", eps_low=3e-4, eps_high=4e-4,
                          aggregation="seq-mean-token-mean")
    loss.backward()


def gspo_step(model, prompts, comp, mask, adv, autocast, device, chunk):
    logp, _ = sequence_logprobs(model, prompts, comp, mask, pad_id=0, chunk_size=chunk, autocast_dtype=autocast)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask.to(device), level="sequence", eps_low=3e-4, eps_high=4e-4,
                          aggregation="seq-mean-token-mean")
    with attention_context():
        loss.backward()


def logprob_pass(model, prompts, comp, mask, autocast, device, chunk):
    with torch.no_grad():
        sequence_logprobs(model, prompts, comp, mask, pad_id=0, chunk_size=chunk, autocast_dtype=autocast)


def measure(fn, model, device, warmup: int, repeats: int) -> tuple[float, float | None]:
    for _ in range(warmup):
        fn()
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=192)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device(a.device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    if a.model == "qwen2.5-0.5b-shape":
        model = qwen25_05b_shape()
    else:
        model, _ = load_model(a.model)
    model.to(device).train()
    prompts, comp, mask = make_batch(a.batch, a.prompt, a.completion, model.config.vocab_size)
    adv = torch.randn(a.batch, device=device)
    tokens = int(mask.sum())
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    paths = {
        "plain HF forward/backward": lambda: plain_step(model, prompts, comp, mask, adv, autocast, device),
        "gspo update (chunked log-probs)": lambda: gspo_step(model, prompts, comp, mask, adv, autocast, device, a.chunk),
        "gspo log-prob pass (no grad)": lambda: logprob_pass(model, prompts, comp, mask, autocast, device, a.chunk),
    }
    rows = []
    for name, fn in paths.items():
        secs, peak = measure(fn, model, device, a.warmup, a.repeats)
        rows.append({"path": name, "seconds": secs, "completion_tokens_per_s": tokens / secs, "peak_gib": peak})
        print(json.dumps(rows[-1]), flush=True)
    out = {"model": a.model, "card": card, "batch": a.batch, "prompt": a.prompt, "completion": a.completion,
           "completion_tokens": tokens, "torch": torch.__version__, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\n{a.model} on {card}: {a.batch} x ({a.prompt} + {a.completion}) tokens, {tokens} completion tokens")
    print("| path | s / step | completion tokens/s | peak memory |\n|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "-"
        print(f"| {r['path']} | {r['seconds']:.3f} | {r['completion_tokens_per_s']:,.0f} | {peak} |")


if __name__ == "__main__":
    main()
