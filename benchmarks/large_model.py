"""Full fine-tuning of a model that does not fit one GPU: ``gspo train`` on a randomly initialised model of a real
shape (Qwen2.5-7B: 7.6 B parameters; fp32 weights, gradients and AdamW state are 16 bytes a parameter, 122 GB) under
torchrun + FSDP2, and the largest shape one GPU holds for comparison. Prints a table and writes JSON.

    python benchmarks/large_model.py --shape qwen2.5-7b --gpus 4 --models /root/models --out results/7b.json
    python benchmarks/large_model.py --shape qwen2.5-3b --gpus 1 --models /root/models --out results/3b.json

The model is written once as a bf16 HF directory (random weights, std 0.02; SmolLM2's tokenizer beside it: the ids
past its vocabulary decode to nothing, and a random model never stops early, so every completion is
``rollout.max_new_tokens`` long). Random weights are fine for throughput and memory, not for rewards.

Columns, averaged over the rollout batches after the first (warm-up, graph capture):
- ``train tok/s``: completion tokens of a minibatch per second of its optimizer step (forward, backward, AdamW, the
  weight copy to the engine), the whole job's;
- ``MFU``: 6 x parameters x trained tokens (prompt and completion: every position goes through the model) per
  second of the step, over the GPUs' dense bf16 peak (989 TFLOP/s for an H100/H200 SXM). Gradient checkpointing
  recomputes the forward, which the 6 N T convention does not count;
- ``rollout tok/s``: generated tokens per second of sampling, the whole job's;
- ``peak GiB``: ``torch.cuda.max_memory_allocated`` of the busiest GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.runlog.metrics import read_jsonl  # noqa: E402

# Public config.json values of the Qwen2.5 models (hub: Qwen/Qwen2.5-*), the parts that set the compute and memory.
SHAPES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
PEAK_BF16 = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM (the vendor's datasheet, without sparsity)
TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "models" / "smollm2-135m-instruct"


def make_model(shape: str, folder: Path, tokenizer: Path) -> int:
    """Writes the random ``shape`` model to ``folder`` once; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in meta.parameters())
    if (folder / "DONE").exists():
        return n_params
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    with torch.device(device):  # initialised where it is fast; save_pretrained copies to the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="5GB")
    tok.save_pretrained(tmp)
    (tmp / "DONE").write_text(str(n_params))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    print(f"wrote {shape} ({n_params / 1e9:.2f} B parameters) to {folder} in {time.time() - t0:.0f} s", flush=True)
    return n_params


def count_parameters(name: str) -> int:
    from gspo.models import load_model

    model, _ = load_model(name)
    return sum(p.numel() for p in model.parameters())


def mean_prompt_tokens(run_dir: Path, folder: Path) -> float:
    """The mean length of the logged prompts as the trainer encodes them (chat template included)."""
    from gspo.prompts import encode_prompts
    from gspo.types import Example

    config = json.loads((run_dir / "config.json").read_text())
    examples = [Example(prompt=r["prompt"], answer=r["answer"]) for r in read_jsonl(run_dir / "samples.jsonl")]
    from gspo.models import load_tokenizer

    ids = encode_prompts(load_tokenizer(str(folder)), examples, config["data"]["system_prompt"])
    return sum(map(len, ids)) / len(ids)


def run(args, folder: Path, n_params: int, run_dir: Path) -> dict:
    prompts = args.prompts_per_gpu * args.gpus
    cmd = [sys.executable, "-m", "gspo.cli", "train", args.config, f"model.name='{folder}'",
           f"rollout.prompts_per_batch={prompts}", f"rollout.group_size={args.group_size}",
           f"rollout.max_new_tokens={args.new_tokens}", f"train.steps={args.batches * args.minibatches}",
           f"train.minibatches={args.minibatches}", f"train.micro_batch_size={args.micro_batch}",
           f"model.gradient_checkpointing={str(not args.no_checkpointing).lower()}", "log.checkpoint_every=0",
           "log.progress=false",
           *args.overrides, "--run-dir", str(run_dir), "--nproc", str(args.gpus)]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-3000:], "command": cmd}
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["rollout_batch"] > 0]
    prompt_tokens = mean_prompt_tokens(run_dir, folder)
    firsts = [r for r in rows if r["minibatch"] == 0]
    mean = lambda key, rs=rows: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    # Every position of a sequence goes through the model: prompt + completion tokens of a minibatch.
    seq_tokens = prompts * args.group_size / args.minibatches * (mean("completion/len_mean") + prompt_tokens)
    step_s = mean("time/update")
    timings = json.loads((run_dir / "timings.json").read_text()) if (run_dir / "timings.json").exists() else {}
    return {
        "command": cmd, "wall_s": wall, "params": n_params, "gpus": args.gpus, "prompts_per_batch": prompts,
        "completions_per_batch": prompts * args.group_size, "completion_len_mean": mean("completion/len_mean"),
        "prompt_len_mean": prompt_tokens,
        "step_s": step_s, "train_tok_s": mean("throughput/train_tok_s"),
        "mfu": 6 * n_params * seq_tokens / step_s / (args.gpus * PEAK_BF16),
        "logprobs_s": mean("time/logprobs", firsts), "rollout_s": mean("time/rollout", firsts),
        "rollout_tok_s": mean("throughput/rollout_tok_s", firsts),
        "peak_gib": max(r.get("memory/peak_gib", float("nan")) for r in rows), "timings": timings,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    p.add_argument("--model", help="an existing model (any form model.name takes) instead of a random --shape one")
    p.add_argument("--tag", default="", help="added to the run directory's name (several runs of one shape)")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--models", default="/tmp/gspo-models", help="where the random models are written (once)")
    p.add_argument("--tokenizer", default=str(TOKENIZER))
    p.add_argument("--config", default="configs/quickstart.toml")
    p.add_argument("--prompts-per-gpu", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (train.micro_batch_size)")
    p.add_argument("--no-checkpointing", action="store_true", help="model.gradient_checkpointing = false")
    p.add_argument("--batches", type=int, default=3, help="rollout batches (the first is not averaged)")
    p.add_argument("--make-only", action="store_true", help="write the model and stop")
    p.add_argument("--out", default="large_model.json")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = p.parse_args()
    if args.model:
        folder, args.shape = args.model, Path(args.model).stem
        n_params = count_parameters(args.model)
    else:
        folder = Path(args.models) / args.shape
        n_params = make_model(args.shape, folder, Path(args.tokenizer))
    if args.make_only:
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    r = run(args, folder, n_params, out.parent / f"run-{args.shape}-{args.gpus}gpu{args.tag}")
    import torch

    r["device"] = f"{args.gpus} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
    r["shape"], r["args"] = args.shape, vars(args)
    out.write_text(json.dumps(r, indent=1))
    if "error" in r:
        print(f"{args.shape} on {args.gpus} GPU(s) failed:\n{r['error']}")
        sys.exit(1)
    print(f"{'model':>12} {'params':>7} {'GPUs':>4} {'step s':>7} {'train tok/s':>11} {'MFU':>6} "
          f"{'rollout tok/s':>13} {'peak GiB':>8}")
    print(f"{args.shape:>12} {n_params / 1e9:>6.2f}B {args.gpus:>4} {r['step_s']:>7.2f} {r['train_tok_s']:>11.0f} "
          f"{r['mfu']:>6.1%} {r['rollout_tok_s']:>13.0f} {r['peak_gib']:>8.1f}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
