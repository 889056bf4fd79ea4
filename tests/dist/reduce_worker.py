"""Run by test_runtime under torchrun: each rank reduces its own metrics and writes what it got."""
import json
import sys

import torch
import torch.distributed as dist

from gspo.config import ModelConfig
from gspo.runtime import Runtime

dist.init_process_group("gloo")
rt = Runtime.from_config(ModelConfig(device="cpu"))
r = float(rt.rank)
values = rt.reduce({"mean": torch.tensor(r), "count": r + 1.0, "max": torch.tensor(2 * r), "min": r - 5,
                    "nan_max": torch.tensor(float("nan") if r else 1.0), "half": torch.tensor(0.1, dtype=torch.float32)},
                   ops={"count": "sum", "max": "max", "min": "min", "nan_max": "max"})
with open(f"{sys.argv[1]}/rank{rt.rank}.json", "w") as f:
    json.dump({"rank": rt.rank, "world": rt.world_size, "is_main": rt.is_main, "values": values}, f)
dist.destroy_process_group()
