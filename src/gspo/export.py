"""``gspo export``: a trained checkpoint as a standard Hugging Face model directory that transformers, vLLM and other
tools load without gspo: the weights (in the dtype asked for), the config, the tokenizer with its chat template, and a
generation config that stops at the chat template's end-of-turn token as gspo's engines do.

A LoRA checkpoint is exported as its peft adapter (loadable with ``PeftModel.from_pretrained`` on the base model), or
with ``merge_lora`` as the base model with the adapter merged in.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from gspo.checkpoint import MARKER, complete_checkpoints
from gspo.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def checkpoint_of(path: Path) -> Path:
    """``path`` itself when it is a complete checkpoint, the newest complete one when it is a run directory."""
    if (path / MARKER).is_file():
        return path
    done = complete_checkpoints(path / "checkpoints")
    if done:
        return done[-1]
    raise UserError(f"{str(path)!r} is neither a complete checkpoint nor a run directory with one; pass "
                    "runs/NAME or runs/NAME/checkpoints/step-N.")


def export(source: Path, out: Path, *, dtype: str = "bf16", merge_lora: bool = False) -> Path:
    """Write the model of checkpoint (or run directory) ``source`` to the new directory ``out``; returns the
    checkpoint exported. Written to ``out.tmp`` first and renamed, so ``out`` is whole or absent."""
    from gspo import lora
    from gspo.models import load_model, load_tokenizer, stop_token_ids

    ckpt = checkpoint_of(source)
    if out.exists():
        raise UserError(f"--out {str(out)!r} exists; name a new directory (nothing is overwritten).")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if lora.is_adapter(ckpt) and not merge_lora:
            for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS):
                shutil.copy2(ckpt / name, tmp / name)
            load_tokenizer(str(ckpt)).save_pretrained(tmp)
        else:
            model, tokenizer = load_model(str(ckpt), dtype=torch.float32)
            model = model.to(DTYPES[dtype])
            stops = stop_token_ids(tokenizer, model)
            model.generation_config.eos_token_id = stops[0] if len(stops) == 1 else stops
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"Writing {str(out)!r} failed ({e.strerror or e}); nothing was left there. Free disk space or "
                        "pick another --out.") from e
    return ckpt
