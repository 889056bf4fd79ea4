"""Probe 2: is a CUDA graph captured on a green-context stream confined to its SMs (replayed there, or elsewhere)?"""
import json
import time
import torch

if __name__ == "__main__":
    import torch.cuda.green_contexts as gcm
    GC = gcm.GreenContext
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    def t(stream, fn, reps=50):
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        return round((time.perf_counter() - t0) / reps * 1e3, 4)
    out = {}
    ctx = GC.create(num_sms=16, device_id=0)
    gs = ctx.Stream()
    out["eager_default"] = t(torch.cuda.current_stream(), lambda: a @ a)
    out["eager_green16"] = t(gs, lambda: a @ a)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(gs):
        a @ a
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(g, stream=gs):
            b = a @ a
        out["graph_captured_green_replay_green"] = t(gs, g.replay)
        out["graph_captured_green_replay_default"] = t(torch.cuda.current_stream(), g.replay)
    except Exception as e:  # noqa: BLE001
        out["capture_on_green_error"] = repr(e)
    g2 = torch.cuda.CUDAGraph()
    ctx.set_context() if hasattr(ctx, "set_context") else None
    try:
        s2 = torch.cuda.Stream()
        with torch.cuda.graph(g2, stream=s2):
            c = a @ a
        out["graph_captured_in_set_context"] = t(torch.cuda.current_stream(), g2.replay)
    except Exception as e:  # noqa: BLE001
        out["set_context_error"] = repr(e)
    finally:
        ctx.pop_context() if hasattr(ctx, "pop_context") else None
    print(json.dumps(out), flush=True)
