"""Probe: what slows the engine's decode when an update runs beside it (docs/experiments/async/ section 6).

Beside the update the reference run's collect takes 1.6-1.8x as long as alone, and that bounds the asynchronous loop.
Confining the update to fewer SMs did not help (section 5). This probe times the graph engine's ``generate`` (the
reference run's batch: 32 prompts x 8 completions of "a + b", fixed length) alone and beside four loads:

- ``gil``: a thread of pure Python (holds the GIL, launches nothing on the GPU);
- ``thread``: a thread training a copy of the model (forward, backward, AdamW on 64 rows x 96 tokens, bf16 autocast)
  on a stream of its own, as the asynchronous loop's actor does;
- ``process``: the same training loop in a child process (a CUDA context of its own: no GIL shared, time-sliced);
- under MPS (run the script again with ``--mps`` inside an MPS daemon): ``process`` with both as MPS clients.

It prints and writes (``--out``) the median seconds of a ``generate`` and the training load's median step alone and
beside it:

  python benchmarks/probes/collect_contention.py --model /root/smollm2/model.gguf --out $OUT/contention.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS, TOKENS = 64, 96  # one optimizer step of the load: 64 rows (a minibatch of the reference run), prompt + answer


def train_load(model, stop: threading.Event | mp.synchronize.Event, times: list, ready=None) -> None:
    """Forward, backward and an AdamW step on random ids in a loop until ``stop``; each step's seconds into ``times``."""
    dev = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    ids = torch.randint(0, model.config.vocab_size, (ROWS, TOKENS), device=dev)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(10**9):
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
            if i == 3 and ready is not None:
                ready.set()
            if stop.is_set():
                return


def child(name: str, stop, ready, queue) -> None:
    from shapes import bench_model

    model, _ = bench_model(name)
    times: list[float] = []
    train_load(model.to("cuda"), stop, times, ready)
    queue.put(times)


def python_load(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--new", type=int, default=32, help="tokens each row decodes (stop tokens ignored)")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--modes", default="alone,thread,process,gil")
    p.add_argument("--mps", action="store_true", help="label the results as run under an MPS daemon")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import copy

    from gspo.data.tasks import ArithmeticTask
    from gspo.prompts import encode_prompts
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams
    from shapes import bench_on_device

    device, autocast, model, tok, card = bench_on_device(a.model, "cuda")
    task = ArithmeticTask(seed=0)
    prompts = encode_prompts(tok, [task[i] for i in range(32)])
    engine = GraphEngine(model, tok, stop_ids=[model.config.vocab_size + 1], device=device, autocast_dtype=autocast)
    params = SamplingParams(max_new_tokens=a.new, temperature=1.0)
    gen = torch.Generator(device=device).manual_seed(0)
    engine_stream = torch.cuda.Stream()

    def generate_times(repeats: int) -> list[float]:
        out = []
        with torch.cuda.stream(engine_stream):
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.generate(prompts, 8, params, generator=gen)
                engine_stream.synchronize()
                out.append(time.perf_counter() - t0)
        return out

    generate_times(2)  # capture the graphs, warm the allocator
    trainee = copy.deepcopy(model).to(device)
    results = {"card": card + (" (MPS)" if a.mps else ""), "new_tokens": a.new, "rows": 256,
               "load": f"{ROWS} x {TOKENS} tokens forward + backward + AdamW"}
    for mode in a.modes.split(","):
        stop, load_times = (mp.get_context("spawn").Event() if mode == "process" else threading.Event()), []
        worker, queue = None, None
        if mode == "gil":
            worker = threading.Thread(target=python_load, args=(stop,))
        elif mode == "thread":
            ready = threading.Event()
            worker = threading.Thread(target=train_load, args=(trainee, stop, load_times, ready))
        elif mode == "process":
            ctx = mp.get_context("spawn")
            ready, queue = ctx.Event(), ctx.Queue()
            worker = ctx.Process(target=child, args=(a.model, stop, ready, queue))
        if worker is not None:
            worker.start()
            if mode in ("thread", "process"):
                ready.wait(300)
            n0 = len(load_times)
        gen_times = generate_times(2 if mode == "gil" else a.repeats)  # the GIL mode is slow
        if worker is not None:
            stop.set()
            if queue is not None:
                load_times = queue.get(timeout=120)
            worker.join(120)
            load_times = load_times[4:] if mode == "process" else load_times[n0:]
        row = {"generate_s": round(statistics.median(gen_times), 4),
               "load_step_s": round(statistics.median(load_times), 4) if load_times else None}
        results[mode] = row
        print(f"{mode:8s} generate {row['generate_s']:.4f} s   load step {row['load_step_s']}", flush=True)
        Path(a.out).write_text(json.dumps(results, indent=1))
    alone_stop, alone_times = threading.Event(), []
    # the load's step alone, for the slowdown the decode causes it
    timer = threading.Timer(5.0, alone_stop.set)
    timer.start()
    train_load(trainee, alone_stop, alone_times)
    results["load_alone_step_s"] = round(statistics.median(alone_times[4:]), 4)
    print(f"load alone step {results['load_alone_step_s']}", flush=True)
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
