"""The CUDA-graph engine's own properties (its step runs eagerly on a CPU): other architectures, log-prob agreement
with the trainer, the weight seam (sync_weights), unsupported models."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from gspo.errors import UserError
from gspo.train.passes import sequence_logprobs
from gspo.models import named_weights
from gspo.rollout import graph
from gspo.rollout.graph import GraphEngine
from gspo.types import SamplingParams

STOP = 2


@pytest.fixture
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat and a dog."]]


def test_qwen2_greedy_matches_generate(tokenizer, prompts):
    """A Qwen2-architecture model (attention bias, GQA) decodes greedily exactly like model.generate."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    rollout = GraphEngine(model, tokenizer, stop_ids=[STOP]).generate(prompts, 1, SamplingParams(max_new_tokens=12, greedy=True))
    for row, prompt in enumerate(prompts):
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=12, eos_token_id=[STOP], pad_token_id=STOP)[0, len(prompt):]
        assert rollout.completion_ids[row][rollout.completion_mask[row]].tolist() == expected.tolist()


def test_engine_logprobs_match_the_trainers(make_tiny_model, tokenizer, prompts):
    """Sampled completions' engine log-probs equal the trainer's recomputation (fp32, temperature 0.7)."""
    model = make_tiny_model(seed=3, init_std=0.3)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9)
    r = GraphEngine(model, tokenizer, stop_ids=[STOP]).generate(prompts, 3, params, generator=torch.Generator().manual_seed(0))
    logp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.7, pad_id=r.pad_id)
    diff = (logp - r.logprobs)[r.completion_mask].abs()
    assert diff.max() < 1e-4


def test_weights_reach_the_engine_only_through_sync_weights(make_tiny_model, tokenizer, prompts):
    """The engine samples from its own copy: an in-place change of the trainer's parameters (what the optimizer does)
    changes nothing until sync_weights, after which the engine samples what a freshly built one samples."""
    model = make_tiny_model(seed=1, init_std=0.3)
    engine = GraphEngine(model, tokenizer, stop_ids=[STOP])
    params = SamplingParams(max_new_tokens=6, greedy=True)
    before = engine.generate(prompts, 1, params).completion_ids
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    assert torch.equal(engine.generate(prompts, 1, params).completion_ids, before)
    engine.sync_weights(named_weights(model))
    after = engine.generate(prompts, 1, params).completion_ids
    assert not torch.equal(before, after)
    assert torch.equal(after, GraphEngine(model, tokenizer, stop_ids=[STOP]).generate(prompts, 1, params).completion_ids)
    assert all(p.data_ptr() not in {q.data_ptr() for q in model.parameters()} for p in engine.model.parameters())


@pytest.mark.parametrize("flush_bytes", [0, 4096])
def test_sync_weights_in_chunks_copies_every_weight(make_tiny_model, tokenizer, prompts, monkeypatch, flush_bytes):
    """Gathered weights are copied in chunks as they come; a chunk may end at any weight, the last one included (a
    7B model's LM head alone fills one: the empty copy that followed crashed the engine's start)."""
    monkeypatch.setattr(graph, "_FLUSH_BYTES", flush_bytes)
    model = make_tiny_model(seed=1, init_std=0.3)
    engine = GraphEngine(model, tokenizer, stop_ids=[STOP])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    engine.sync_weights(named_weights(model))
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, model.get_parameter(name).to(p.dtype)), name


def test_sync_weights_refuses_a_partial_or_foreign_set(make_tiny_model, tokenizer):
    """Every engine weight must be given once: a missing one or a name the model lacks is refused naming the fix."""
    model = make_tiny_model(seed=1)
    engine = GraphEngine(model, tokenizer, stop_ids=[STOP])
    weights = list(named_weights(model))
    with pytest.raises(UserError, match="was not given 1 of the engine's weights"):
        engine.sync_weights(weights[1:])
    with pytest.raises(UserError, match="'nope' but the engine's model has no such parameter"):
        engine.sync_weights([*weights, ("nope", weights[0][1])])


def test_low_precision_weights_sample_exactly_like_autocast(make_tiny_model, tokenizer, prompts):
    """Under bf16 autocast the engine's bf16 weight copies give bit-identical tokens and log-probs to casting fp32
    copies at every step, and a synced update of the fp32 weights reaches them."""
    model = make_tiny_model(seed=4, init_std=0.3)
    params = SamplingParams(max_new_tokens=10, temperature=0.9)

    def run(low: bool, seed: int = 0):
        engine = GraphEngine(model, tokenizer, stop_ids=[STOP], autocast_dtype=torch.bfloat16, low_precision_weights=low)
        return engine, engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(seed))

    low_engine, a = run(True)
    _, b = run(False)
    assert low_engine.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert low_engine.model.model.norm.weight.dtype == torch.float32  # autocast leaves norms in fp32, so does the copy
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trainer's masters are untouched
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    low_engine.sync_weights(named_weights(model))
    after = low_engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(0))
    _, fresh = run(False)
    assert torch.equal(after.completion_ids, fresh.completion_ids) and torch.equal(after.logprobs, fresh.logprobs)


def test_unsupported_architecture_names_the_fallback(tokenizer):
    """A model type the graph engine does not handle raises a UserError naming rollout.engine = 'hf'."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UserError, match="rollout.engine = 'hf'"):
        GraphEngine(model, tokenizer)


def test_requests_larger_than_the_batch_cap_are_split(make_tiny_model, tokenizer, prompts):
    """With max_batch 8, a request of 3 prompts x 4 samples runs in two calls and returns the same greedy rows."""
    model = make_tiny_model(seed=2, init_std=0.3)
    params = SamplingParams(max_new_tokens=8, greedy=True)
    whole = GraphEngine(model, tokenizer, stop_ids=[STOP]).generate(prompts, 4, params)
    split = GraphEngine(model, tokenizer, stop_ids=[STOP], max_batch=8).generate(prompts, 4, params)
    assert split.completion_ids.shape[0] == 12
    for a, b, ma, mb in zip(whole.completion_ids, split.completion_ids, whole.completion_mask, split.completion_mask):
        assert a[ma].tolist() == b[mb].tolist()
    assert split.prompt_ids == whole.prompt_ids



@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_moe_families_decode_like_generate(family, tokenizer, prompts):
    """MoE models run in the graph engine on the HF modules' step (routers and experts of the engine's own copy; the
    trainer's routing hooks are not copied into it): greedy decoding equals model.generate token for token."""
    from test_moe import _configs

    cfg = _configs()[family]
    cfg.vocab_size, cfg.pad_token_id = len(tokenizer), STOP
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    from gspo.models.moe import Routing, find_routers

    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    for router in find_routers(model):
        torch.nn.init.normal_(router.weight, std=0.5)
    routing = Routing(model, "off")  # hooks on the trainer's model: the engine's copy must not carry them
    engine = GraphEngine(model, tokenizer, stop_ids=[STOP])
    assert all(not m._forward_hooks for m in engine.model.modules())
    rollout = engine.generate(prompts, 1, SamplingParams(max_new_tokens=8, greedy=True))
    for row, prompt in enumerate(prompts):
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  do_sample=False, max_new_tokens=8, eos_token_id=[STOP], pad_token_id=STOP)[0, len(prompt):]
        assert rollout.completion_ids[row][rollout.completion_mask[row]].tolist() == expected.tolist()
    routing.close()


def _count_compactions(engine, monkeypatch) -> list[int]:
    """The row counts ``engine`` compacts to, appended as it goes."""
    sizes, compact = [], engine._compact

    def spy(b, v, rows, live):
        sizes.append(rows)
        return compact(b, v, rows, live)

    monkeypatch.setattr(engine, "_compact", spy)
    return sizes


@pytest.mark.parametrize("move_bytes", [64 << 20, 1], ids=["one-copy", "row-by-row"])
def test_compacted_steps_decode_like_the_whole_bucket(make_tiny_model, tokenizer, monkeypatch, move_bytes):
    """Greedy rows ending at many steps: once half the rows have ended the live ones move to a step of 8 rows, and
    every row comes back in its place with the tokens, log-probs and finish reasons of the uncompacted engine. The K/V
    rows move in one copy, or (a cache too large for one temporary) a row of a layer at a time, in place."""
    monkeypatch.setattr(graph, "_MOVE_BYTES", move_bytes)
    model = make_tiny_model(seed=6, init_std=0.3)
    prompts = [tokenizer.encode(f"Question {i}: what is {i} + {2 * i}?") for i in range(12)]  # 12 rows: bucket 16
    params = SamplingParams(max_new_tokens=16, greedy=True)
    free = GraphEngine(model, tokenizer, stop_ids=[STOP], compact=False).generate(prompts, 1, params).completion_ids
    stop_ids = sorted({int(free[i, 1 + i % 6]) for i in range(10)})  # ten rows end by their seventh token
    whole = GraphEngine(model, tokenizer, stop_ids=stop_ids, compact=False).generate(prompts, 1, params)
    engine = GraphEngine(model, tokenizer, stop_ids=stop_ids, compact=True)
    sizes = _count_compactions(engine, monkeypatch)
    moved = engine.generate(prompts, 1, params)
    assert sizes == [8] and len(set(whole.lengths.tolist())) > 3
    assert torch.equal(moved.completion_ids, whole.completion_ids)
    assert torch.equal(moved.completion_mask, whole.completion_mask)
    assert (moved.logprobs - whole.logprobs).abs().max() < 1e-5
    assert moved.finish_reasons == whole.finish_reasons and moved.texts == whole.texts
    again = engine.generate(prompts[::-1], 1, params)  # the bucket is reused: its row order starts afresh
    assert torch.equal(again.completion_ids, whole.completion_ids.flip(0)[:, :again.completion_ids.shape[1]])


def test_compacted_samples_keep_their_prompts(make_tiny_model, tokenizer, monkeypatch):
    """Sampled rows with geometric lengths (a likely stop token) through two compactions (32 -> 16 -> 8 rows): each
    row's engine log-probs equal the trainer's recomputation under its own prompt, so no row changed places."""
    from test_rollout import force_token

    model = make_tiny_model(seed=7, init_std=0.3)
    force_token(model, STOP, 11.0)
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story.", "Name a colour.", "7 * 8?",
                                             "Spell cat."]]
    params = SamplingParams(max_new_tokens=24, temperature=0.9)
    engine = GraphEngine(model, tokenizer, stop_ids=[STOP], compact=True)
    sizes = _count_compactions(engine, monkeypatch)
    r = engine.generate(prompts, 5, params, generator=torch.Generator().manual_seed(3))  # 30 rows: bucket 32
    assert sizes[:2] == [16, 8] and r.lengths.min() < 4 and r.lengths.max() > 12
    logp, _ = sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.9, pad_id=r.pad_id)
    assert (logp - r.logprobs)[r.completion_mask].abs().max() < 1e-4
    assert [r.finish_reasons[i] == "stop" for i in range(30)] == (r.completion_ids == STOP).any(-1).tolist()


class _SwapAt:
    """In-flight weight updates as the pipeline gives them (``GraphEngine.swaps``): at the ``at``-th poll between two
    decode steps, ``weights`` are loaded into the engine as version 1."""

    def __init__(self, engine, weights, at: int, recompute: bool):
        self.engine, self.weights, self.at, self.recompute = engine, weights, at, recompute
        self.version, self.polls = 0, 0

    def poll(self) -> bool:
        self.polls += 1
        if self.polls != self.at:
            return False
        self.engine.sync_weights(self.weights)
        self.version = 1
        return True


@pytest.mark.parametrize("compact", [False, True], ids=["whole", "compacted"])
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_an_in_flight_update_samples_the_next_tokens_with_the_new_weights(make_tiny_model, tokenizer, monkeypatch,
                                                                           compact, kv):
    """Weights B replace weights A between two decode steps of a batch (after rows have ended, and been compacted):
    the tokens before the swap are version 0 with A's log-probs, the later ones version 1. With the cache recomputed,
    their engine log-probs are B's own for the same tokens (the trainer's recomputation); with the cache kept they are
    neither A's nor B's (B over A's keys and values), as docs/async.md says."""
    from test_rollout import force_token

    a, b = make_tiny_model(seed=3, init_std=0.3), make_tiny_model(seed=4, init_std=0.3)
    force_token(a, STOP, 11.0)  # rows end at many steps: most before the swap
    force_token(b, STOP, 11.0)
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat and a dog.", "7 * 8?"]]
    params = SamplingParams(max_new_tokens=14, temperature=0.8)
    engine = GraphEngine(a, tokenizer, stop_ids=[STOP], compact=compact)
    swaps = engine.swaps = _SwapAt(engine, named_weights(b), at=5, recompute=kv == "recompute")
    compacted_at, compact_rows = [], engine._compact  # the polls made when the engine compacts
    monkeypatch.setattr(engine, "_compact", lambda *a: compacted_at.append(swaps.polls) or compact_rows(*a))
    r = engine.generate(prompts, 4, params, generator=torch.Generator().manual_seed(1))  # 16 rows
    engine.swaps = None
    assert r.versions.shape == r.completion_ids.shape
    assert torch.equal(r.versions[~r.completion_mask], torch.full_like(r.versions[~r.completion_mask], -1))
    new = r.versions == 1
    # the 5th poll comes before step 5, which samples output column 5 (column 0 is the prefill's)
    assert torch.equal(new.any(0), torch.arange(new.shape[1]) >= 5)
    before = r.completion_mask[:, :5]
    assert torch.equal(r.versions[:, :5][before], torch.zeros(int(before.sum()), dtype=torch.long))
    assert (r.lengths <= 5).sum() >= 8 and new.sum() > 15  # most rows ended before the swap, and some went on
    assert compacted_at == ([3] if compact else [])  # the live rows were moved to a step of their own before the swap
    logp_a, _ = sequence_logprobs(a, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.8, pad_id=r.pad_id)
    logp_b, _ = sequence_logprobs(b, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.8, pad_id=r.pad_id)
    old = r.versions == 0
    assert (r.logprobs - logp_a)[old].abs().max() < 1e-4
    off_b = (r.logprobs - logp_b)[new].abs()
    if kv == "recompute":
        assert off_b.max() < 1e-4
    else:
        assert off_b.median() > 1e-2 and (r.logprobs - logp_a)[new].abs().median() > 1e-2
