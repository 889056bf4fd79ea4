"""Run by test_runtime under torchrun: each rank reduces its own metrics, gathers objects of different sizes and splits
a list's work, and writes what it got."""
import json
import sys

import torch
import torch.distributed as dist

from gspo.parallel import comm as gd
from gspo.config import ModelConfig
from gspo.runtime import Runtime

dist.init_process_group("gloo")
rt = Runtime.from_config(ModelConfig(device="cpu"))
r = float(rt.rank)
values = rt.reduce({"mean": torch.tensor(r), "count": r + 1.0, "max": torch.tensor(2 * r), "min": r - 5,
                    "nan_max": torch.tensor(float("nan") if r else 1.0), "half": torch.tensor(0.1, dtype=torch.float32)},
                   ops={"count": "sum", "max": "max", "min": "min", "nan_max": "max"})
# a pickle of a different length on every rank, with tensors (bfloat16 and a strided view among them)
parts = gd.gather_objects({"rank": rt.rank, "text": "x" * (1000 * (rt.rank + 1)), "ids": torch.arange(3 + rt.rank),
                           "bf16": torch.full((2,), r + 0.5, dtype=torch.bfloat16), "view": torch.arange(10.0)[::3]})
gathered = [[p["rank"], len(p["text"]), p["ids"].tolist(), p["bf16"].float().tolist(), p["view"].tolist()] for p in parts]
split = gd.split_work(list(range(7)), lambda part: [(x, rt.rank) for x in part])  # each result says who computed it
with open(f"{sys.argv[1]}/rank{rt.rank}.json", "w") as f:
    json.dump({"rank": rt.rank, "world": rt.world_size, "is_main": rt.is_main, "values": values, "gathered": gathered,
               "split": split}, f)
dist.destroy_process_group()
