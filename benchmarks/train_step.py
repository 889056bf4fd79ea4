"""Policy-update throughput and peak memory: gspo's update against a plain HF forward/backward loop, same batch.

  python benchmarks/train_step.py --model /root/smollm2/model.gguf --out $OUT/train_step.json
  python benchmarks/train_step.py --model qwen2.5-0.5b-shape --out $OUT/train_step_qwen.json   # random init

One step = forward, loss, backward over ``batch`` sequences (random ids) with bf16 autocast on fp32 weights. Lengths
are shaped like RL rollouts: prompts of ``prompt`` tokens +-25%, completions with a long tail (exponential with mean
``completion / 4``, 10% truncated at ``completion``), so a padded batch is mostly padding, as real ones are;
``--uniform`` gives every row the full lengths instead (no padding at all).

- ``plain HF``: left-padded batch, ``model(input_ids, attention_mask).logits`` -> fp32 log_softmax over the full
  vocabulary -> gather -> GSPO loss.
- ``gspo padded``: ``gspo.train.passes.sequence_logprobs`` (the decoder once, the LM head in checkpointed chunks over
  completion tokens only) -> ``gspo.policy_loss``.
- ``gspo packed``: the same on packed sequences (no padding; flash attention's variable-length kernel).
- ``+ CUDA graphs``: the packed decoder forward and backward replayed from CUDA graphs (``gspo.train.passes.PackedGraphs``;
  capture happens in the warm-up calls and is not timed).
- ``gspo logprob pass``: the no-grad old-policy pass alone, padded and packed.

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
from gspo.train.passes import PackedGraphs, packing_available, sequence_logprobs  # noqa: E402
from gspo.models import pad_prompts  # noqa: E402
from gspo.models import attention_context, autocast_context  # noqa: E402
from shapes import bench_model  # noqa: E402


def make_batch(batch: int, prompt: int, completion: int, vocab: int, uniform: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if uniform:
        plens = torch.full((batch,), prompt)
        lengths = torch.full((batch,), completion)
    else:
        plens = torch.randint(prompt * 3 // 4, prompt * 5 // 4 + 1, (batch,), generator=g)
        lengths = (torch.empty(batch).exponential_(4 / completion, generator=g).long() + 1).clamp(max=completion)
        lengths[torch.randperm(batch, generator=g)[: batch // 10]] = completion  # truncated rows
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in plens]
    comp = torch.randint(3, vocab, (batch, completion), generator=g)  # (B, T)
    mask = torch.arange(completion)[None, :] < lengths[:, None]  # (B, T)
    return prompts, comp, mask


def plain_step(model, prompts, comp, mask, adv, autocast, device):
    prompt, prompt_mask = pad_prompts(prompts, 0)  # (B, P)
    ids = torch.cat([prompt, comp], 1).to(device)  # (B, P+T)
    attn = torch.cat([prompt_mask, mask.long()], 1).to(device)  # (B, P+T)
    P = prompt.shape[1]
    with autocast_context(device, autocast), attention_context():
        logits = model(ids, attention_mask=attn).logits[:, P - 1:-1]  # (B, T, V)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P:, None]).squeeze(-1)  # (B, T)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask.to(device), level="sequence", eps_low=3e-4, eps_high=4e-4,
                          aggregation="seq-mean-token-mean")
    loss.backward()


def gspo_step(model, prompts, comp, mask, adv, autocast, device, chunk, packed, graphs=None):
    logp, _ = sequence_logprobs(model, prompts, comp, mask, pad_id=0, chunk_size=chunk, autocast_dtype=autocast,
                                packed=packed, graphs=graphs)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask.to(device), level="sequence", eps_low=3e-4, eps_high=4e-4,
                          aggregation="seq-mean-token-mean")
    with attention_context():
        loss.backward()


def logprob_pass(model, prompts, comp, mask, autocast, device, chunk, packed, graphs=None):
    with torch.no_grad():
        sequence_logprobs(model, prompts, comp, mask, pad_id=0, chunk_size=chunk, autocast_dtype=autocast, packed=packed,
                          graphs=graphs)


def measure(fn, model, device, warmup: int, repeats: int) -> tuple[float, float | None]:
    for _ in range(warmup):
        fn()
        model.zero_grad(set_to_none=False)
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
        model.zero_grad(set_to_none=False)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=192)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--uniform", action="store_true", help="every row at the full prompt + completion length")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device(a.device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    model, _ = bench_model(a.model)
    model.to(device).train()
    prompts, comp, mask = make_batch(a.batch, a.prompt, a.completion, model.config.vocab_size, a.uniform)
    packed = packing_available(device, autocast)
    adv = torch.randn(a.batch, device=device)
    tokens = int(mask.sum())
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    paths = {
        "plain HF forward/backward": lambda: plain_step(model, prompts, comp, mask, adv, autocast, device),
        "gspo update, padded": lambda: gspo_step(model, prompts, comp, mask, adv, autocast, device, a.chunk, False),
        "gspo log-prob pass (no grad), padded": lambda: logprob_pass(model, prompts, comp, mask, autocast, device, a.chunk, False),
    }
    if packed:
        paths["gspo update, packed"] = lambda: gspo_step(model, prompts, comp, mask, adv, autocast, device, a.chunk, True)
        paths["gspo log-prob pass (no grad), packed"] = lambda: logprob_pass(model, prompts, comp, mask, autocast, device,
                                                                            a.chunk, True)
        graphs = PackedGraphs(model, autocast)  # captured during the warm-up calls
        paths["gspo update, packed + CUDA graphs"] = lambda: gspo_step(model, prompts, comp, mask, adv, autocast, device,
                                                                       a.chunk, True, graphs)
        paths["gspo log-prob pass (no grad), packed + CUDA graphs"] = lambda: logprob_pass(
            model, prompts, comp, mask, autocast, device, a.chunk, True, graphs)
    rows = []
    for name, fn in paths.items():
        secs, peak = measure(fn, model, device, a.warmup, a.repeats)
        rows.append({"path": name, "seconds": secs, "completion_tokens_per_s": tokens / secs, "peak_gib": peak})
        print(json.dumps(rows[-1]), flush=True)
    padded = a.batch * (max(len(p) for p in prompts) + a.completion)
    real = sum(len(p) for p in prompts) + tokens
    out = {"model": a.model, "card": card, "batch": a.batch, "prompt": a.prompt, "completion": a.completion,
           "uniform": a.uniform, "completion_tokens": tokens, "padded_tokens": padded, "real_tokens": real,
           "torch": torch.__version__, "rows": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\n{a.model} on {card}: {a.batch} rows, prompts ~{a.prompt}, completions <= {a.completion} "
          f"({'uniform' if a.uniform else 'RL-shaped'}): {tokens} completion tokens, {real} real of {padded} padded tokens")
    print("| path | s / step | completion tokens/s | peak memory |\n|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "-"
        print(f"| {r['path']} | {r['seconds']:.3f} | {r['completion_tokens_per_s']:,.0f} | {peak} |")


if __name__ == "__main__":
    main()
