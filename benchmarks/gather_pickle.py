"""What one process's share of the rollout-batch gather costs to pickle and unpickle under torchrun: torch's own
tensor pickling (each storage through torch.save / torch.load) against gspo.parallel.comm's (CPU tensors as numpy arrays),
on a Groups of the reference run's size per process (32 prompts x 8 completions, 128 completion tokens, ~60 prompt
tokens). The gather pickles one share and unpickles every process's. Also: the rows' prompt ids as one list per row
(before ``Rollout.repeat_prompts``) against one list per prompt shared by its rows (what the engines return now).
Prints a table and writes JSON.

    python benchmarks/gather_pickle.py --world 4 --out gather_pickle.json
"""
from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.parallel.comm import dumps as array_pickle  # noqa: E402  (what gather_objects sends)
from gspo.collect.stage import Groups, Scores  # noqa: E402
from gspo.types import Example, Rollout  # noqa: E402


def share(rows: int, tokens: int, prompt_tokens: int, group: int, shared_prompts: bool = True):
    """One process's part of the gather: its groups, its rounds' rewards, counts, timings, no error."""
    g = torch.Generator().manual_seed(0)
    examples = [Example(f"What is {i} + {7 * i}?", str(8 * i)) for i in range(rows // group)]
    prompts = [list(range(i, i + prompt_tokens)) for i in range(rows // group)]
    prompt_ids = (Rollout.repeat_prompts(prompts, group) if shared_prompts
                  else [list(prompts[i // group]) for i in range(rows)])
    rollout = Rollout(prompt_ids=prompt_ids,
                      completion_ids=torch.randint(0, 49152, (rows, tokens), generator=g),
                      completion_mask=torch.rand(rows, tokens, generator=g) < 0.9,
                      logprobs=-torch.rand(rows, tokens, generator=g), finish_reasons=["stop"] * rows,
                      texts=["The answer is 42."] * rows)
    groups = Groups(rollout, [examples[i // group] for i in range(rows)], torch.rand(rows, generator=g),
                    {"correct": torch.rand(rows, generator=g)})
    scores = [Scores(groups.rewards, groups.per_function)]
    counts = {"dropped": 0, "padded": 0, "rounds": 1, "zero_flags": torch.zeros(rows // group, dtype=torch.bool)}
    return groups, scores, counts, {"rollout": 0.25, "reward": 0.01}, None


def time_it(dump, world: int, obj, repeat: int) -> tuple[float, float, int]:
    """Median seconds to pickle ``obj`` once and to unpickle ``world`` copies, and the pickle's size."""
    dumps, loads = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        data = dump(obj)
        t1 = time.perf_counter()
        for _ in range(world):
            pickle.loads(data)
        dumps.append(t1 - t0)
        loads.append(time.perf_counter() - t1)
    return statistics.median(dumps), statistics.median(loads), len(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="processes whose shares each process unpickles")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default="gather_pickle.json")
    p.add_argument("--prompt-tokens", type=int, default=150, help="the reference run's GSM8K prompts: ~150 tokens")
    a = p.parse_args()
    obj = share(a.rows, a.tokens, a.prompt_tokens, 8)

    def torch_pickle(o):
        return pickle.dumps(o, protocol=4)

    results = {}
    print(f"{'pickling':<24}{'bytes':>10}{'dump ms':>10}{'load x' + str(a.world) + ' ms':>14}")
    for name, dump, o in (("torch", torch_pickle, obj), ("arrays", array_pickle, obj),
                          ("arrays, a list per row", array_pickle,
                           share(a.rows, a.tokens, a.prompt_tokens, 8, shared_prompts=False))):
        d, lo, size = time_it(dump, a.world, o, a.repeat)
        results[name] = {"bytes": size, "dump_s": d, "load_all_s": lo}
        print(f"{name:<24}{size:>10}{d * 1e3:>10.2f}{lo * 1e3:>14.2f}")
    speed = results["torch"]["load_all_s"] / results["arrays"]["load_all_s"]
    print(f"unpickling {speed:.1f}x faster with arrays")
    shared = results["arrays, a list per row"]["load_all_s"] / results["arrays"]["load_all_s"]
    print(f"unpickling {shared:.1f}x faster with a prompt's rows sharing its list")
    Path(a.out).write_text(json.dumps({"args": vars(a), "host": platform.processor() or platform.machine(),
                                       "torch": torch.__version__, "results": results, "load_speedup": speed,
                                       "shared_prompts_load_speedup": shared}, indent=1))


if __name__ == "__main__":
    main()
