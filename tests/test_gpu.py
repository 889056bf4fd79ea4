"""GPU checks (skipped without CUDA): bf16 training runs end to end and the on-policy ratio is exactly 1."""
import pytest
import torch

from gspo.config import build_config
from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.train import Trainer

from conftest import tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _tiny_cuda_config(tmp_path, tokenizer):
    """Two optimizer steps of a tiny random Llama on CUDA (bf16 autocast by default), rewards in-process."""
    d = tmp_path / "tiny"
    tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return build_config({}, [f"model.name='{d}'", "model.device='cuda'", "rollout.prompts_per_batch=4",
                             "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=2", "train.minibatches=2",
                             "rewards.workers=0", "rewards.functions=[{path='trainer_rewards:text_length'}]",
                             "log.progress=false"], device="cuda")


def test_bf16_training_on_cuda(tmp_path, tokenizer):
    """Two bf16-autocast steps on CUDA train with finite losses and an exactly-1 on-policy ratio."""
    trainer = Trainer(_tiny_cuda_config(tmp_path, tokenizer), tmp_path / "run")
    assert trainer.runtime.autocast == torch.bfloat16
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["loss"] is not None for r in rows)
    assert rows[0]["ratio/token_min"] == rows[0]["ratio/token_max"] == 1.0


def test_lora_trains_with_the_graph_engine_fed_merged_weights(tmp_path, tokenizer):
    """LoRA on CUDA: the CUDA-graphed packed update over the adapters, the graph engine (fused step) fed merged bf16
    weights before every batch; finite losses, an exactly-1 on-policy ratio, trained adapters, and an engine that
    samples what a fresh one built on the merged weights samples."""
    pytest.importorskip("peft")
    cfg = _tiny_cuda_config(tmp_path, tokenizer)
    lora = build_config({}, [f"model.name='{cfg.model.name}'", "model.device='cuda'", "rollout.prompts_per_batch=4",
                             "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=6",
                             "train.minibatches=2", "train.lr=1e-2", "lora.rank=8", "rollout.engine='graph'",
                             "rewards.workers=0", "rewards.functions=[{path='trainer_rewards:text_length'}]",
                             "log.progress=false"], device="cuda")
    trainer = Trainer(lora, tmp_path / "lora")
    assert trainer.actor.graphs is not None and trainer.engine.fused is not None
    trainer.train()
    rows = read_jsonl(tmp_path / "lora" / "metrics.jsonl")
    assert all(r["loss"] is not None for r in rows)
    assert all(r["ratio/token_min"] == r["ratio/token_max"] == 1.0 for r in rows if r["minibatch"] == 0)
    changed = [n for n, p in trainer.actor.model.named_parameters() if ".lora_B." in n and p.abs().max() > 0]
    assert changed
    # Synced, the engine samples exactly what a fresh engine built on a plain model holding the merged weights does.
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams

    trainer.engine.sync_weights(trainer.actor.weights())
    plain = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    plain.load_state_dict(dict(trainer.actor.weights()))
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi there"]]
    params = SamplingParams(max_new_tokens=24, greedy=True)
    fresh = GraphEngine(plain, tokenizer, stop_ids=trainer.engine.stop_ids, device=torch.device("cuda"),
                        autocast_dtype=torch.bfloat16)
    assert torch.equal(trainer.engine.generate(prompts, 2, params).completion_ids,
                       fresh.generate(prompts, 2, params).completion_ids)


def test_graph_engine_on_cuda_matches_the_simple_engine(tokenizer):
    """On CUDA in fp32, the graph engine's greedy tokens equal the simple engine's and its log-probs agree."""
    from gspo.rollout.graph import GraphEngine
    from gspo.rollout.hf import HFEngine
    from gspo.types import SamplingParams

    model = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat."]]
    params = SamplingParams(max_new_tokens=40, greedy=True)
    graph = GraphEngine(model, tokenizer, stop_ids=[2], device=torch.device("cuda"))
    a = graph.generate(prompts, 2, params)
    b = HFEngine(model, tokenizer, stop_ids=[2], device=torch.device("cuda")).generate(prompts, 2, params)
    assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert (a.logprobs - b.logprobs).abs().max() < 1e-3
    assert graph.warmup_s < 15


def test_graph_engine_sees_synced_updates_under_bf16(tokenizer):
    """Under bf16 autocast the captured graph reads the engine's own copy in place: after an update and sync_weights
    its greedy output equals that of a freshly built engine (a stale copy or a re-allocated one would not)."""
    from gspo.models import named_weights
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams

    model = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi there"]]
    params = SamplingParams(max_new_tokens=24, greedy=True)
    cuda = torch.device("cuda")
    engine = GraphEngine(model, tokenizer, stop_ids=[2], device=cuda, autocast_dtype=torch.bfloat16)
    before = engine.generate(prompts, 2, params).completion_ids
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    assert torch.equal(engine.generate(prompts, 2, params).completion_ids, before)  # no sync yet: the old weights
    engine.sync_weights(named_weights(model))
    after = engine.generate(prompts, 2, params).completion_ids
    fresh = GraphEngine(model, tokenizer, stop_ids=[2], device=cuda, autocast_dtype=torch.bfloat16).generate(prompts, 2, params)
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh.completion_ids)


def _engine_vs_trainer(model, tokenizer, **engine_kwargs):
    """A bf16 graph engine (``engine_kwargs`` pick its paths) samples 4 completions of 3 prompts; returns the engine and
    |engine log-prob - trainer's recomputation| per completion token."""
    from gspo.train.passes import sequence_logprobs
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams

    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a long story about a cat and a dog."]]
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    cuda = torch.device("cuda")
    engine = GraphEngine(model, tokenizer, stop_ids=[2], device=cuda, autocast_dtype=torch.bfloat16, **engine_kwargs)
    r = engine.generate(prompts, 4, params, generator=torch.Generator(device=cuda).manual_seed(0))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, pad_id=r.pad_id,
                                    autocast_dtype=torch.bfloat16)
    return engine, (logp.cpu() - r.logprobs)[r.completion_mask].abs()


def test_flash_decode_agrees_with_the_trainer(tokenizer):
    """Decode attention over live slots only (flash, variable length) gives the trainer's log-probs as closely as the
    masked SDPA path over every slot does; a wrong slot range would miss by far more."""
    from gspo.rollout.graph import GraphEngine

    model = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    gaps = {flash: _engine_vs_trainer(model, tokenizer, flash_decode=flash, fused=False)[1] for flash in (True, False)}
    assert GraphEngine(model, tokenizer, stop_ids=[2], device=torch.device("cuda"), autocast_dtype=torch.bfloat16).flash_decode
    assert gaps[True].mean() < 2 * gaps[False].mean() + 1e-3 and gaps[True].max() < 0.1


def test_packed_logprobs_on_cuda_match_padded(tokenizer):
    """Under bf16 on CUDA, packed log-probs (flash attention, variable length) agree with the padded layout to bf16
    noise, and their gradients are finite."""
    from gspo.train.passes import packing_available, sequence_logprobs

    cuda = torch.device("cuda")
    assert packing_available(cuda, torch.bfloat16)
    model = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30)]
    lengths = torch.tensor([12, 3, 20, 1])
    ids = torch.randint(3, 500, (4, 20), generator=g)
    mask = torch.arange(20)[None, :] < lengths[:, None]
    out = {}
    for packed in (False, True):
        logp, _ = sequence_logprobs(model, prompts, ids, mask, pad_id=0, autocast_dtype=torch.bfloat16, packed=packed)
        logp.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad(set_to_none=True)
        out[packed] = logp.detach()
    diff = (out[True] - out[False])[mask.cuda()].abs()
    assert diff.mean() < 0.02 and diff.max() < 0.1


def test_cuda_graphed_packed_passes_match_eager(tokenizer):
    """The CUDA-graphed packed decoder gives the eager packed log-probs and gradients (bf16 noise) at every call, sees
    in-place weight updates, and accumulates two backward passes (a second graphed backward added to a .grad that
    aliased the graph's buffer would come out doubled)."""
    from gspo.train.passes import PackedGraphs, sequence_logprobs

    model = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 17, 9, 30)]
    ids = torch.randint(3, 500, (4, 20), generator=g)
    mask = torch.arange(20)[None, :] < torch.tensor([12, 3, 20, 1])[:, None]
    graphs = PackedGraphs(model, torch.bfloat16)
    kw = dict(pad_id=0, autocast_dtype=torch.bfloat16, packed=True)

    def run(use_graphs, backward_times=1):
        model.zero_grad(set_to_none=True)  # the graphed backward must not leave .grad as a view of its own buffer
        for _ in range(backward_times):
            logp, _ = sequence_logprobs(model, prompts, ids, mask, graphs=graphs if use_graphs else None, **kw)
            (logp * torch.linspace(0.5, 1.5, 20, device="cuda")).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    for _ in range(3):  # later rounds run after in-place weight changes, with .grad reset to None each time
        (a, ga), (b, gb) = run(False), run(True)
        assert graphs.graphed and graphs.enabled
        diff = (a - b)[mask.cuda()].abs()
        assert diff.mean() < 0.01 and diff.max() < 0.05
        for x, y in zip(ga, gb):
            assert (x - y).norm() <= 0.05 * x.norm() + 1e-6
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    _, once = run(True)
    _, twice = run(True, backward_times=2)
    for x, y in zip(once, twice):
        assert (2 * x - y).norm() <= 1e-3 * x.norm() + 1e-6
    # padded to a larger bucket (what a process does when another one's micro-batch is longer): one more graph of
    # that size, the same log-probs as its own bucket's
    own = dict(graphs.graphed)
    model.zero_grad(set_to_none=True)
    logp_own, _ = sequence_logprobs(model, prompts, ids, mask, graphs=graphs, **kw)
    logp_big, _ = sequence_logprobs(model, prompts, ids, mask, graphs=graphs, pack_tokens=3000, **kw)
    assert set(graphs.graphed) - set(own) == {(PackedGraphs.bucket(3001), len(prompts) + 2)}
    diff = (logp_big - logp_own)[mask.cuda()].abs()  # other kernel shapes: bf16 rounding only
    assert diff.mean() < 0.01 and diff.max() < 0.05


def test_fused_decode_agrees_with_the_trainer_and_warms_up_fast(tokenizer):
    """The fused decode step (Triton kernels, captured in a CUDA graph) is on by default for a bf16 Llama on CUDA,
    captures in well under 15 s (Triton compiles included), and gives the trainer's log-probs as closely as the HF-module
    step does."""
    from gspo.rollout.graph import GraphEngine

    model = tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).cuda()
    engine, fused_gap = _engine_vs_trainer(model, tokenizer, fused=True)
    assert engine.warmup_s < 15
    _, module_gap = _engine_vs_trainer(model, tokenizer, fused=False)
    assert GraphEngine(model, tokenizer, stop_ids=[2], device=torch.device("cuda"),
                       autocast_dtype=torch.bfloat16).fused is not None
    assert fused_gap.mean() < 2 * module_gap.mean() + 1e-3 and fused_gap.max() < 0.1


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module-flash"])
def test_multi_turn_rows_on_cuda_graphs_agree_with_the_trainer(tokenizer, fused, monkeypatch):
    """bf16, CUDA graphs, rows of 1-3 turns with answers of 1-4 ids: every sampled token's engine log-prob is as close
    to the trainer's recomputation over the whole row as single-turn rows' are (a later turn attending a wrong slot,
    position or row would miss by far); the fused step compacts rows whose turn ended and brings them back, and its
    rows that end after one turn are the single-turn rollout bit for bit."""
    from gspo.train.passes import sequence_logprobs
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams
    from test_envs import Answers
    from test_graph_engine import _count_compactions
    from test_rollout import force_token

    cuda = torch.device("cuda")
    model = tiny_llama(vocab_size=len(tokenizer), seed=7, init_std=0.3)
    force_token(model, 2, 9.0)
    model.cuda()
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story.", "Name a colour."]]
    params = SamplingParams(max_new_tokens=120, temperature=0.9, max_turn_tokens=40)
    engine = GraphEngine(model, tokenizer, stop_ids=[2], device=cuda, autocast_dtype=torch.bfloat16, fused=fused)
    assert engine.use_graphs and engine.compact
    sizes = _count_compactions(engine, monkeypatch)
    gaps = {True: [], False: []}
    for seed in (0, 1):  # the second call replays the graphs the first one captured
        gen = lambda: torch.Generator(device=cuda).manual_seed(seed)  # noqa: E731
        answers = Answers([1 + (r * 7 + seed) % 3 for r in range(32)], lambda r: list(range(100, 101 + r % 4)))
        for multi in (True, False):
            r = engine.generate(prompts, 8, params, generator=gen(), turns=answers if multi else None)
            with torch.no_grad():
                logp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.9,
                                            pad_id=r.pad_id, autocast_dtype=torch.bfloat16)
            gaps[multi].append((logp.cpu() - r.logprobs)[r.sampled].abs())
            assert (r.completion_mask & ~r.sampled).any() == multi
        assert len(answers.calls) >= 2
        if not fused:  # the module step keeps every row in multi-turn (no compaction): another random stream
            continue
        once = Answers([1] * 32, lambda r: [100])
        whole = SamplingParams(max_new_tokens=40, temperature=0.9)  # no turn limit: the single-turn rows' own
        # Fresh engines: a CUDA graph's capture draws from the generator (its warm-up steps), so two calls compare
        # step for step only when each captures at the same moment.
        fresh = lambda: GraphEngine(model, tokenizer, stop_ids=[2], device=cuda,  # noqa: E731
                                    autocast_dtype=torch.bfloat16, fused=fused)
        single = fresh().generate(prompts, 8, whole, generator=gen())
        again = fresh().generate(prompts, 8, whole, generator=gen(), turns=once)
        width = single.completion_ids.shape[1]
        assert torch.equal(single.completion_ids, again.completion_ids[:, :width])
        assert torch.equal(single.logprobs, again.logprobs[:, :width])
    if fused:  # rows whose turn ended were moved out of the step, and came back for their next turn
        assert len(sizes) > 2
    gap, plain = torch.cat(gaps[True]), torch.cat(gaps[False])
    assert gap.numel() > 1000 and gap.mean() < 2 * plain.mean() + 1e-3 and gap.max() < 0.1


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module-flash"])
def test_compacted_graph_steps_agree_with_the_trainer(tokenizer, fused, monkeypatch):
    """bf16, CUDA graphs, rows of geometric lengths (a likely stop token): the live rows move to steps of 16, then 8
    rows, each captured mid-decode in the first call and replayed in the second, through the fused step and through
    the HF modules' step with flash attention over live slots; the engine's log-probs stay as close to the trainer's
    as the uncompacted engine's, and every row keeps its prompt (a moved row scored under another prompt, or attending
    another row's slots, would miss by far)."""
    from gspo.train.passes import sequence_logprobs
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams
    from test_graph_engine import _count_compactions
    from test_rollout import force_token

    cuda = torch.device("cuda")
    model = tiny_llama(vocab_size=len(tokenizer), seed=7, init_std=0.3)
    force_token(model, 2, 11.0)
    model.cuda()
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story.", "Name a colour."]]
    params = SamplingParams(max_new_tokens=40, temperature=0.9)
    gaps, sizes = {True: [], False: []}, []  # sizes: the row counts the compacting engine moved to
    for compact in (True, False):
        engine = GraphEngine(model, tokenizer, stop_ids=[2], device=cuda, autocast_dtype=torch.bfloat16, compact=compact,
                             fused=fused)
        assert (engine.fused is not None) == fused and engine.use_graphs and (fused or engine.flash_decode)
        if compact:
            sizes = _count_compactions(engine, monkeypatch)
        for seed in (0, 1):  # the second call replays the graphs the first one captured
            r = engine.generate(prompts, 8, params, generator=torch.Generator(device=cuda).manual_seed(seed))  # 32 rows
            with torch.no_grad():
                logp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.9,
                                            pad_id=r.pad_id, autocast_dtype=torch.bfloat16)
            gaps[compact].append((logp.cpu() - r.logprobs)[r.completion_mask].abs())
            assert r.lengths.max() > 2 * r.lengths.float().median()
    assert sizes[:2] == [16, 8] and len(sizes) > 2  # the second call compacted too
    gap, plain = torch.cat(gaps[True]), torch.cat(gaps[False])
    assert gap.mean() < 2 * plain.mean() + 1e-3 and gap.max() < 0.1


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "module-flash"])
def test_an_in_flight_update_with_a_recomputed_cache_samples_by_the_new_weights(tokenizer, fused):
    """bf16, CUDA graphs, compacted rows: weights B replace weights A at a host sync mid-decode (rollout.in_flight =
    'recompute'). The fused step's rows go back over their own cache rows, every live row's cache is rewritten by B,
    and the captured graphs replay with B's weights: the tokens after the swap are as close to B's recomputation as
    the tokens before it are to A's."""
    from gspo.models import named_weights
    from gspo.train.passes import sequence_logprobs
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams
    from test_graph_engine import _SwapAt
    from test_rollout import force_token

    cuda = torch.device("cuda")
    a, b = (tiny_llama(vocab_size=len(tokenizer), seed=s, init_std=0.3) for s in (7, 8))
    for m in (a, b):
        force_token(m, 2, 11.0)
        m.cuda()
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story.", "Name a colour."]]
    params = SamplingParams(max_new_tokens=40, temperature=0.9)
    engine = GraphEngine(a, tokenizer, stop_ids=[2], device=cuda, autocast_dtype=torch.bfloat16, fused=fused)
    engine.swaps = _SwapAt(engine, named_weights(b), at=3, recompute=True)  # the host sync before step 9
    r = engine.generate(prompts, 8, params, generator=torch.Generator(device=cuda).manual_seed(0))
    gaps = {}
    with torch.no_grad():
        for version, model in ((0, a), (1, b)):
            logp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.9,
                                        pad_id=r.pad_id, autocast_dtype=torch.bfloat16)
            gaps[version] = (logp.cpu() - r.logprobs)[r.versions == version].abs()
    assert gaps[1].numel() > 20 and gaps[1].mean() < 2 * gaps[0].mean() + 1e-3 and gaps[1].max() < 0.1


def test_fused_moe_step_agrees_with_the_trainer_as_the_module_step_does(tokenizer):
    """On CUDA the fused step is the default for a bf16 Mixtral too (the fused attention kernels around the family's
    grouped-GEMM sparse block), and its log-probs are as close to the trainer's as the HF-module step's.

    Unlike the dense test there is no bound on the largest gap: with routers this sharp a bf16 pass picks another
    expert than the trainer's bf16 pass for a few tokens, and such a token's log-prob moves by tenths (on an H100 the
    fused step's largest gap was 0.40 at a mean of 0.026, the module step's mean 0.024). Both paths have those flips,
    so they are compared on the mean, the 90th percentile and the count of gaps above 0.1."""
    from test_moe import sharp_moe

    model = sharp_moe("mixtral", len(tokenizer)).cuda()
    engine, fused_gap = _engine_vs_trainer(model, tokenizer)
    assert engine.fused is not None
    _, module_gap = _engine_vs_trainer(model, tokenizer, fused=False)
    assert fused_gap.mean() < 2 * module_gap.mean() + 1e-3
    assert fused_gap.quantile(0.9) < 2 * module_gap.quantile(0.9) + 1e-3
    assert (fused_gap > 0.1).sum() <= 2 * (module_gap > 0.1).sum() + 3  # outliers: as rare as the module step's


def test_non_finite_step_is_skipped_on_the_device(tmp_path, tokenizer, monkeypatch):
    """With the fused AdamW a non-finite loss skips the optimizer step on the GPU (found_inf, no host sync): the
    weights and Adam's step count stay as they were, the step is counted, and a finite step afterwards trains."""
    import gspo.train.actor

    real = gspo.train.actor.policy_loss
    calls = []

    def nan_once(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 1 else loss), metrics

    monkeypatch.setattr(gspo.train.actor, "policy_loss", nan_once)
    trainer = Trainer(_tiny_cuda_config(tmp_path, tokenizer), tmp_path / "run")
    assert trainer.actor.holding.fused_optimizer
    before = {k: v.detach().clone() for k, v in trainer.actor.model.named_parameters()}
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["nonfinite_steps"] for r in rows] == [1.0, 1.0]
    steps = {int(s["step"]) for s in trainer.actor.holding.optimizer.state_dict()["state"].values()}
    assert steps == {1}  # the skipped step did not count
    assert any(not torch.equal(before[k], v) for k, v in trainer.actor.model.named_parameters())


def test_checkpoint_snapshot_of_gpu_tensors_is_exact_and_keeps_ties(tokenizer):
    """The pinned, non-blocking snapshot of a CUDA model and its AdamW state equals the live tensors bit for bit once
    it returns, keeps tied weights one tensor, and does not change when training goes on."""
    from gspo.checkpoint import to_cpu

    model = tiny_llama(vocab_size=len(tokenizer), seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.tensor([[1, 2, 3]], device="cuda")).logits.sum().backward()
    opt.step()
    live = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    snap = to_cpu(live)
    assert snap["model"]["lm_head.weight"] is snap["model"]["model.embed_tokens.weight"]
    for k, v in live["model"].items():
        assert snap["model"][k].device.type == "cpu" and torch.equal(snap["model"][k], v.cpu()), k
    before = {k: v.clone() for k, v in snap["model"].items()}
    opt.step()
    assert all(torch.equal(before[k], snap["model"][k]) for k in before)


def test_gather_pickling_sends_gpu_tensors_as_their_cpu_values():
    """dist.dumps (what the rollout gather sends) pickles a CUDA tensor -- float32, bfloat16, a strided view -- as its
    values, loaded on the CPU of whichever process reads it."""
    import pickle

    from gspo.parallel.comm import dumps

    sent = {"f": torch.randn(3, 5, device="cuda"), "bf16": torch.randn(6, device="cuda", dtype=torch.bfloat16)[::2],
            "ids": torch.arange(12, device="cuda").reshape(3, 4)[:, 1:]}
    got = pickle.loads(dumps(sent))
    for key, value in sent.items():
        assert got[key].device.type == "cpu" and got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value.cpu()), key


def test_r3_records_inside_the_captured_decode_graph(tmp_path, tokenizer):
    """R3 in the graph engine on CUDA: the route records are written by kernels captured in the decode step's CUDA
    graph (hooks do not run at replay). They agree with the hf engine's (no graphs) on the same greedy completions, and
    a bf16 MoE training run with R3 on the graph engine logs the flip rates."""
    from transformers import AutoModelForCausalLM

    from gspo.models.moe import Routing
    from gspo.rollout import HFEngine
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams
    from test_moe import sharp_moe

    model = sharp_moe("mixtral", len(tokenizer)).cuda()
    routing = Routing(model, "rollout")
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat."]]
    params = SamplingParams(max_new_tokens=16, greedy=True)
    with pytest.raises(UserError, match="fp32 MoE"):  # fp32 grouped GEMMs cannot be captured: refused, not crashed
        GraphEngine(model, tokenizer, stop_ids=[2])
    graph = GraphEngine(model, tokenizer, stop_ids=[2], autocast_dtype=torch.bfloat16)
    assert graph.use_graphs and graph.fused is not None  # the fused MoE step, by default: R3 records from inside it
    hf = HFEngine(model, tokenizer, stop_ids=[2], autocast_dtype=torch.bfloat16)
    out = []
    for engine in (hf, graph):
        engine.routing = routing
        out.append(engine.generate(prompts, 2, params))
    assert graph._buckets and all(b.graphs for b in graph._buckets.values())  # the decode ran as graph replays
    a, b = out
    # bf16 on two code paths: greedy completions part where two tokens nearly tie (a random model has many such
    # ties), so the routes (by sequence position: prompt, then completion) are compared on each row's prompt and
    # the completions' common prefix, where both engines were fed the same tokens
    width = min(a.routes_mask.shape[1], b.routes_mask.shape[1])
    common = torch.zeros(len(a.prompt_ids), width, dtype=torch.bool)
    for i, prompt in enumerate(a.prompt_ids):
        t = min(a.completion_ids.shape[1], b.completion_ids.shape[1])
        differ = (a.completion_ids[i, :t] != b.completion_ids[i, :t]).nonzero()
        common[i, :len(prompt) + (int(differ[0]) if len(differ) else t)] = True
    m = a.routes_mask[:, :width] & common
    assert torch.equal(m, b.routes_mask[:, :width] & common) and m.sum() >= 3 * len(a.prompt_ids), m.sum()
    agree = (a.routes[:, :width][m] == b.routes[:, :width][m]).float().mean().item()
    assert agree >= 0.98, agree
    routing.close()
    d = tmp_path / "moe"
    AutoModelForCausalLM.from_config(model.config).save_pretrained(d)
    tokenizer.save_pretrained(d)
    run_cfg = build_config({}, [f"model.name='{d}'", "model.device='cuda'", "rollout.prompts_per_batch=4",
                                "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=4",
                                "train.minibatches=2", "rewards.workers=0", "moe.routing_replay='rollout'",
                                "rewards.functions=[{path='trainer_rewards:text_length'}]", "log.progress=false"],
                           device="cuda")
    trainer = Trainer(run_cfg, tmp_path / "run")
    assert type(trainer.engine).__name__ == "GraphEngine"
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r.get("moe/flip_rate") is not None and r.get("moe/engine_flip_rate") is not None for r in rows)


def test_r3_records_the_appended_turns_inside_the_captured_extension(tokenizer):
    """R3 over multi-turn rows on CUDA graphs (bf16, the fused MoE step): a later turn's appended ids are fed by the
    captured extension graph, which records their experts; after row compaction and ``_home`` every fed position is
    recorded, and the trainer's pass replaying the records routes as the engine did (a record in the wrong row or
    slot would flip about half of the appended quarter of the positions)."""
    from gspo.models.moe import Routing
    from gspo.rollout.graph import GraphEngine
    from gspo.train.passes import sequence_logprobs
    from gspo.types import SamplingParams
    from test_envs import Answers
    from test_moe import sharp_moe
    from test_rollout import force_token

    model = sharp_moe("mixtral", len(tokenizer))
    force_token(model, 2, 9.0)
    model.cuda()
    routing = Routing(model, "rollout")
    engine = GraphEngine(model, tokenizer, stop_ids=[2], autocast_dtype=torch.bfloat16, routing=routing)
    assert engine.use_graphs and engine.fused is not None and engine.compact
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat."]]
    answers = Answers([3] * 24, lambda r: list(range(100, 106 + r % 5)))
    r = engine.generate(prompts, 8, SamplingParams(max_new_tokens=96, temperature=0.9, max_turn_tokens=12),
                        generator=torch.Generator(device="cuda").manual_seed(0), turns=answers)
    assert len(answers.calls) >= 2  # later turns ran, through captured extension graphs:
    assert any(key[0] == "extend" for b in engine._buckets.values() for key in b.graphs)
    appended = (r.completion_mask & ~r.sampled).sum().item()
    assert appended >= 0.15 * r.completion_mask.sum().item()
    for i, prompt in enumerate(r.prompt_ids):
        fed = len(prompt) + int(r.completion_mask[i].sum()) - 1
        assert r.routes_mask[i].nonzero().flatten().tolist() == list(range(fed)), i
    n = len(r.prompt_ids)
    routing.begin_batch(n, int(r.routes_mask.sum(-1).max()) + 1, torch.device("cuda"))
    routing.load_rollout_routes(r.routes.cuda(), r.routes_mask.cuda())
    with routing.updating(), torch.no_grad():
        sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.9, pad_id=r.pad_id,
                          routing=routing, row_ids=torch.arange(n), autocast_dtype=torch.bfloat16)
    flips = routing.flip_metrics()["moe/flip_rate"].item()
    routing.close()
    assert flips <= 0.03, flips


def _cuda_job(tmp_path, tokenizer) -> tuple[dict, list[str]]:
    """The environment and the start of a `gspo train` command on a tiny model saved under ``tmp_path``, on CUDA."""
    import os
    import sys
    from pathlib import Path

    d = tmp_path / "tiny"
    tiny_llama(vocab_size=len(tokenizer), seed=0, init_std=0.3).save_pretrained(d)
    tokenizer.save_pretrained(d)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    return env, [sys.executable, "-m", "gspo.cli", "train", f"model.name='{d}'", "model.device='cuda'",
                 "rollout.prompts_per_batch=8", "rollout.group_size=4", "rollout.max_new_tokens=16",
                 "train.minibatches=2", "rollout.engine='graph'", "rewards.workers=0",
                 "rewards.functions=[{path='trainer_rewards:text_length'}]", "log.progress=false"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_gpus_train_with_nccl_fsdp2_and_the_graph_engine(tmp_path, tokenizer, strategy):
    """`gspo train --nproc 2` on two GPUs: NCCL, FSDP2 with bf16 compute (or DDP with the CUDA-graphed update), each
    process's graph engine (fused decode step) fed the weights after every step; finite losses, an exactly-1
    on-policy ratio, a checkpoint that loads, and a resume on the two GPUs to the end."""
    import subprocess

    from test_faults import check_run_dir

    env, base = _cuda_job(tmp_path, tokenizer)
    base += ["log.checkpoint_every=1", f"dist.strategy='{strategy}'", "--nproc", "2", "--run-dir", str(tmp_path / "run")]
    first = subprocess.run([*base, "train.steps=4"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run([*base, "train.steps=6", "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = check_run_dir(tmp_path / "run", 6)
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in rows)
    assert all(r["ratio/token_min"] == r["ratio/token_max"] == 1.0 for r in rows if r["minibatch"] == 0)
    # the time to the gradient from CUDA events, read (after a wait on the own device) into the step's one reduce
    assert all(r["dist/compute_max_s"] >= r["dist/compute_min_s"] > 0 for r in rows)


@pytest.mark.parametrize("decode_gpu", ["shared", pytest.param("own", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices"))])
def test_a_decode_process_computes_the_one_process_run_on_gpus(tmp_path, tokenizer, decode_gpu):
    """A decode process on GPUs, `gspo train --nproc 2`: with rollout.decode_gpu = 'shared' the trainer and the decode
    process are both on cuda:0, the weights handed over through CUDA IPC slots (NCCL refuses two processes of a group
    on one GPU); with 'own' the decode process is on cuda:1 and the weights are broadcast over NCCL. The job trains
    every step, and its first batches are those of the one-process run of the same eta, including the ones sampled by
    versions that only the hand-over brought (the same engine on the same kind of GPU; the updates may differ in the
    last bits, CUDA's atomics in the embedding's backward, which would take a token flip to show)."""
    import subprocess

    from test_faults import check_run_dir

    env, base = _cuda_job(tmp_path, tokenizer)
    base += ["log.checkpoint_every=2", "rollout.max_staleness=1", "train.steps=16", "log.samples_per_batch=1000"]
    runs = {}
    for name, extra in (("one", []), ("two", ["rollout.decode_processes=1", f"rollout.decode_gpu='{decode_gpu}'",
                                                 "--nproc", "2"])):
        runs[name] = tmp_path / name
        done = subprocess.run([*base, *extra, "--run-dir", str(runs[name])], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    rows = check_run_dir(runs["two"], 16)
    assert all(r["loss"] is not None for r in rows)
    # batches 2 and 3 are sampled by versions 1 and 2, which only the hand-over brought (IPC: its two slots reused
    # from version 2)
    early = [[(r["rollout_batch"], r["completion"]) for r in read_jsonl(runs[n] / "samples.jsonl")
              if r["rollout_batch"] < 4] for n in ("one", "two")]
    assert early[0] and early[0] == early[1]


def test_ppo_value_model_runs_as_cuda_graphs(tmp_path, tokenizer):
    """PPO on CUDA: the value model's packed passes are CUDA graphs as the policy's are (captured, and replayed in
    later batches), its estimates and gradients those of the eager pass up to bf16 rounding, and the run trains."""
    from gspo.train.passes import sequence_values

    cfg = _tiny_cuda_config(tmp_path, tokenizer)
    cfg = build_config({}, [f"model.name='{cfg.model.name}'", "model.device='cuda'",
                            "rollout.prompts_per_batch=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                            "train.steps=4", "train.minibatches=2", "rewards.workers=0", "log.progress=false",
                            "rewards.functions=[{path='trainer_rewards:text_length'}]", "algorithm='ppo'",
                            "ppo.critic_lr=1e-3"], device="cuda")
    trainer = Trainer(cfg, tmp_path / "run")
    critic = trainer.actor.critic
    assert trainer.actor.graphs is not None and critic.graphs is not None
    trainer.train()
    assert critic.graphs.graphed and critic.graphs.enabled
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["critic/value_loss"] == r["critic/value_loss"] for r in rows)  # finite, logged on every step
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 17, 9)]
    ids = torch.randint(3, 500, (3, 12), generator=g)
    mask = torch.arange(12)[None, :] < torch.tensor([12, 3, 7])[:, None]
    kw = dict(pad_id=0, autocast_dtype=torch.bfloat16, packed=True)
    out = []
    for graphs in (None, critic.graphs):
        critic.model.zero_grad(set_to_none=True)
        v = sequence_values(critic.model, prompts, ids, mask, graphs=graphs, **kw)
        v.square().sum().backward()
        out.append((v.detach(), [p.grad.clone() for p in critic.model.parameters() if p.grad is not None]))
    (a, ga), (b, gb) = out
    assert (a - b)[mask.cuda()].abs().max() <= 0.05 * a[mask.cuda()].abs().max() + 1e-3
    assert len(ga) == len(gb) and all((x - y).norm() <= 0.05 * x.norm() + 1e-6 for x, y in zip(ga, gb))
