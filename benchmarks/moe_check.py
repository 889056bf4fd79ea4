"""Function preservation of `gspo upcycle` on the real model: the dense SmolLM2 against its copy-upcycled Mixtral
(drop 0, a strong random router), max |logit difference| over real prompts, fp32. Prints a line and writes JSON."""
from __future__ import annotations

import json
import sys

import torch

from gspo.data import build_dataset, dataset_args
from gspo.config import build_config
from gspo.models import load_model, pad_prompts
from gspo.prompts import encode_prompts
from gspo.commands.upcycle import upcycle


def main(model: str, out: str) -> None:
    cfg = build_config({}, [f"model.name='{model}'"])
    dense, tok = load_model(model)
    moe = upcycle(dense, experts=8, top_k=2, drop=0.0, seed=0, router_std=0.5)
    ds = build_dataset(dataset_args(cfg.data, 0))
    ids, mask = pad_prompts(encode_prompts(tok, [ds[i] for i in range(16)]), tok.pad_token_id)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        a = dense.to(dev)(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[mask.bool().to(dev)]
        dense.cpu()
        b = moe.to(dev)(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[mask.bool().to(dev)]
    result = {"max_abs_logit_diff": (a - b).abs().max().item(), "logit_scale": a.abs().max().item(),
              "tokens": int(mask.sum()), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    print("[moe_check]", json.dumps(result))
    open(out, "w").write(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
