"""All-reduce time and bus bandwidth of the gradient of a model of N parameters (fp32) over the GPUs of a torchrun
job: what `dist.strategy = "ddp"` adds to every optimizer step. Prints one line per size on rank 0.

    torchrun --standalone --nproc_per_node 4 benchmarks/allreduce.py 134.5e6 1e9
"""
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
for n in map(float, sys.argv[1:] or ["134.5e6"]):
    x = torch.ones(int(n), device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 10
    if rank == 0:  # bus bandwidth as nccl-tests counts it: 2 (W - 1) / W x bytes / time
        print(f"{world} GPUs: all-reduce of {n * 4 / 1e6:.0f} MB fp32 in {dt * 1e3:.2f} ms, "
              f"bus bandwidth {2 * (world - 1) / world * n * 4 / dt / 1e9:.0f} GB/s", flush=True)
dist.destroy_process_group()
