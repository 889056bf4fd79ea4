"""Both rollout engines (simple HF and CUDA-graph, eager on CPU): exactness against model.generate, stopping,
sampling and seeding."""
from __future__ import annotations

import functools

import pytest
import torch

from gspo.errors import UserError
from gspo.models import named_weights, pad_prompts
from gspo.rollout import HFEngine, sample_next
from gspo.rollout import graph
from gspo.rollout.graph import GraphEngine
from gspo.types import FINISH_LENGTH, FINISH_STOP, SamplingParams

STOP = 2  # <|im_end|> in the SmolLM2 tokenizer


@pytest.fixture(params=["hf", "graph", "graph-compact"])
def Engine(request, monkeypatch):
    """Each engine class in turn; ``graph-compact``: the graph engine moving live rows to ever smaller steps, down to
    one row (the default stops at 8, more rows than these tests have)."""
    if request.param == "graph-compact":
        monkeypatch.setattr(graph, "_COMPACT_MIN", 1)
        return functools.partial(GraphEngine, compact=True)
    return {"hf": HFEngine, "graph": GraphEngine}[request.param]


@pytest.fixture
def prompts(tokenizer):
    texts = ["Hello there, how are you today?", "Hi", "What is 2 + 3? Answer with one number please."]
    return [tokenizer.encode(t) for t in texts]


def force_token(model, token_id: int, bias: float) -> None:
    """Set an LM-head bias on ``token_id`` (the head is tied to the embeddings, so its weights stay untouched); the bias
    parameter is added the first time, then changed in place (as an optimizer step changes a parameter)."""
    if model.lm_head.bias is None:
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.weight.shape[0]))
    with torch.no_grad():
        model.lm_head.bias[token_id] = bias


def test_pad_prompts_left_pads():
    """Prompts are right-aligned with padding and a zero mask on the left."""
    ids, mask = pad_prompts([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_greedy_matches_model_generate(Engine, tiny_model, tokenizer, prompts):
    """Greedy rollouts of a batch of prompts of different lengths equal model.generate run on each prompt alone."""
    engine = Engine(tiny_model, tokenizer, stop_ids=[STOP])
    rollout = engine.generate(prompts, 1, SamplingParams(max_new_tokens=24, greedy=True))
    for row, prompt in enumerate(prompts):
        expected = tiny_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=24, eos_token_id=[STOP], pad_token_id=engine.pad_id,
        )[0, len(prompt):]
        got = rollout.completion_ids[row][rollout.completion_mask[row]]
        assert got.tolist() == expected.tolist()


def test_greedy_matches_model_generate_when_rows_stop_early(Engine, tiny_model, tokenizer, prompts):
    """When rows stop at different steps, greedy rollouts still equal model.generate, stop token included."""
    params = SamplingParams(max_new_tokens=16, greedy=True)
    free = Engine(tiny_model, tokenizer, stop_ids=[STOP]).generate(prompts, 1, params).completion_ids
    # Tokens greedy decoding reaches at steps 3 and 7 of two rows become stop tokens.
    stop_ids = [int(free[0, 3]), int(free[2, 7])]
    rollout = Engine(tiny_model, tokenizer, stop_ids=stop_ids).generate(prompts, 1, params)
    assert FINISH_STOP in rollout.finish_reasons and len(set(rollout.lengths.tolist())) > 1
    for row, prompt in enumerate(prompts):
        expected = tiny_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=16, eos_token_id=stop_ids, pad_token_id=STOP,
        )[0, len(prompt):]
        got = rollout.completion_ids[row][rollout.completion_mask[row]]
        assert got.tolist() == expected.tolist()


def test_certain_stop_token_gives_stop(Engine, tiny_model, tokenizer, prompts):
    """A model that always emits the stop token yields one-token completions that finish with "stop"."""
    force_token(tiny_model, STOP, 100.0)
    rollout = Engine(tiny_model, tokenizer, stop_ids=[STOP]).generate(prompts, 2, SamplingParams(max_new_tokens=8))
    assert rollout.completion_ids.tolist() == [[STOP]] * 6
    assert rollout.completion_mask.all()
    assert rollout.finish_reasons == [FINISH_STOP] * 6
    assert rollout.texts == [""] * 6  # the stop token is special and is not decoded


def test_stop_token_kept_and_followed_by_padding(Engine, tiny_model, tokenizer, prompts):
    """A row that stops keeps its stop token in the mask, then holds padding with mask False and log-prob 0."""
    params = SamplingParams(max_new_tokens=12, greedy=True)
    free = Engine(tiny_model, tokenizer, stop_ids=[STOP]).generate(prompts[:1], 1, params).completion_ids[0]
    # The first greedy token of prompt 0 not seen before it, declared a stop token, ends that row right there.
    k = next(j for j in range(1, len(free)) if free[j] not in free[:j])
    engine = Engine(tiny_model, tokenizer, stop_ids=[int(free[k])])
    rollout = engine.generate(prompts, 1, params)
    assert rollout.finish_reasons[0] == FINISH_STOP
    assert rollout.completion_mask[0].tolist() == [True] * (k + 1) + [False] * (rollout.completion_ids.shape[1] - k - 1)
    assert rollout.completion_ids[0, : k + 1].tolist() == free[: k + 1].tolist()
    assert rollout.lengths.max() > k + 1  # another row ran on, so row 0 really holds padding
    assert (rollout.completion_ids[0, k + 1:] == engine.pad_id).all()
    assert (rollout.logprobs[0, k + 1:] == 0).all() and (rollout.logprobs[0, : k + 1] < 0).all()


def test_max_new_tokens_gives_length(Engine, tiny_model, tokenizer, prompts):
    """Rows that never sample a stop token run exactly max_new_tokens and finish with "length"."""
    force_token(tiny_model, STOP, -100.0)
    rollout = Engine(tiny_model, tokenizer, stop_ids=[STOP]).generate(prompts, 2, SamplingParams(max_new_tokens=5))
    assert rollout.completion_ids.shape == (6, 5)
    assert rollout.completion_mask.all()
    assert rollout.finish_reasons == [FINISH_LENGTH] * 6


def test_top_k_one_equals_greedy(Engine, tiny_model, tokenizer, prompts):
    """Sampling with top_k=1 picks the same tokens as greedy decoding."""
    engine = Engine(tiny_model, tokenizer)
    greedy = engine.generate(prompts, 1, SamplingParams(max_new_tokens=10, greedy=True))
    top1 = engine.generate(prompts, 1, SamplingParams(max_new_tokens=10, top_k=1, temperature=0.8),
                           generator=torch.Generator().manual_seed(0))
    assert torch.equal(top1.completion_ids, greedy.completion_ids)


@pytest.mark.slow
def test_seeded_generator_reproduces_rollout(Engine, tiny_model, tokenizer, prompts):
    """Two rollouts with generators seeded alike are identical; another seed gives other completions."""
    engine = Engine(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
    a = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(7))
    b = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(7))
    c = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_rows_grouped_by_prompt(Engine, tiny_model, tokenizer, prompts):
    """Row i belongs to prompt i // n, and the n samples of a prompt differ when sampled."""
    n = 4
    rollout = Engine(tiny_model, tokenizer).generate(
        prompts, n, SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(0)
    )
    assert len(rollout.prompt_ids) == len(prompts) * n
    for i, ids in enumerate(rollout.prompt_ids):
        assert ids == prompts[i // n]
    group = rollout.completion_ids[:n]
    assert len({tuple(row.tolist()) for row in group}) > 1


def test_shared_prefill_matches_repeated_prompts(Engine, tiny_model, tokenizer, prompts):
    """Sampling n per prompt from a shared prefill gives the same rollout as listing each prompt n times."""
    engine = Engine(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=8)
    shared = engine.generate(prompts, 2, params, generator=torch.Generator().manual_seed(1))
    repeated = engine.generate([p for p in prompts for _ in range(2)], 1, params,
                               generator=torch.Generator().manual_seed(1))
    assert torch.equal(shared.completion_ids, repeated.completion_ids)
    assert torch.allclose(shared.logprobs, repeated.logprobs, atol=1e-5)


def test_logprobs_are_tempered_and_untruncated():
    """The recorded log-prob is log softmax(logits / T) at the token, whatever top-k/top-p removed."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=1)
    token, logp = sample_next(logits, params, torch.Generator().manual_seed(0))
    assert token.item() == 0
    # log softmax([4, 2, 0, -2])[0] = -log(1 + e^-2 + e^-4 + e^-6)
    expected = -torch.log(1 + torch.exp(torch.tensor(-2.0)) + torch.exp(torch.tensor(-4.0)) + torch.exp(torch.tensor(-6.0)))
    assert logp.item() == pytest.approx(expected.item(), abs=1e-6)


def test_top_p_keeps_smallest_sufficient_set():
    """With probabilities (0.5, 0.3, 0.2) and top_p=0.7 only the first two tokens are ever sampled."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(2000, 1)
    token, _ = sample_next(logits, SamplingParams(top_p=0.7), torch.Generator().manual_seed(0))
    assert set(token.tolist()) == {0, 1}


def test_model_mode_restored_and_weights_synced(Engine, tiny_model, tokenizer, prompts):
    """Generation leaves every module's train/eval mode as it was, and an update is sampled after sync_weights."""
    force_token(tiny_model, STOP, 0.0)  # the parameter the "update" below changes
    engine = Engine(tiny_model, tokenizer, stop_ids=[STOP])
    tiny_model.train()
    tiny_model.model.layers[0].eval()  # a mixed state must come back as it was
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=3, greedy=True))
    assert tiny_model.training and tiny_model.model.layers[1].training
    assert not tiny_model.model.layers[0].training and not tiny_model.model.layers[0].mlp.training
    force_token(tiny_model, STOP, 100.0)  # an "update" made after the engine was built
    engine.sync_weights(named_weights(tiny_model))
    rollout = engine.generate(prompts, 1, SamplingParams(max_new_tokens=3, greedy=True))
    assert rollout.completion_ids.tolist() == [[STOP]] * 3


@pytest.mark.parametrize(
    "prompts_, n, params",
    [([], 1, SamplingParams()), ([[]], 1, SamplingParams()), ([[5]], 0, SamplingParams()),
     ([[5]], 1, SamplingParams(temperature=0.0)), ([[5]], 1, SamplingParams(top_p=0.0)),
     ([[5]], 1, SamplingParams(max_new_tokens=10_000))],
)
def test_bad_requests_raise_user_error(Engine, tiny_model, tokenizer, prompts_, n, params):
    """Empty prompts, n < 1, non-positive temperature or top_p, and too long requests raise UserError."""
    with pytest.raises(UserError):
        Engine(tiny_model, tokenizer).generate(prompts_, n, params)


def test_the_vllm_engine_without_vllm_is_one_line_naming_the_extra(tokenizer):
    """Where vLLM is not installed (the main CI venv), choosing it ends in one line naming the extra and the way back."""
    import importlib.util

    from conftest import tiny_llama
    from gspo.rollout import make_engine

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/test_vllm.py covers the engine")
    with pytest.raises(UserError, match=r"needs vLLM.*pip install 'gspo\[vllm\]'.*rollout.engine = 'auto'"):
        make_engine("vllm", tiny_llama(vocab_size=len(tokenizer)), tokenizer, stop_ids=[2], device=torch.device("cpu"))


def test_an_engine_that_cannot_take_weights_in_flight_is_refused_before_it_is_built(tiny_model, tokenizer):
    """rollout.in_flight: make_engine refuses, in one line naming the fix, an engine that declares it cannot load
    newer weights between decode steps (hf, vLLM: before vLLM would take its share of the GPU); the graph engine
    declares it can, and is built with no source of weights yet (the pipeline sets ``swaps``)."""
    from gspo.rollout import make_engine
    from gspo.rollout.vllm_engine import VLLMEngine

    assert GraphEngine.takes_weights_in_flight and not HFEngine.takes_weights_in_flight
    assert not VLLMEngine.takes_weights_in_flight
    cpu = torch.device("cpu")
    for kind, name in (("hf", "HFEngine"), ("auto", "HFEngine"), ("vllm", "VLLMEngine")):
        with pytest.raises(UserError, match=f"^rollout.in_flight needs .* the {name} does not; set rollout.engine = "
                                            "'graph'.*or rollout.in_flight = 'off'.$"):
            make_engine(kind, tiny_model, tokenizer, stop_ids=[2], device=cpu, in_flight=True)
    engine = make_engine("graph", tiny_model, tokenizer, stop_ids=[2], device=cpu, in_flight=True)
    assert isinstance(engine, GraphEngine) and engine.swaps is None


def test_rounded_weights_hand_worked():
    """3 bits: qmax 3; the row (1, -2, 0.5) has scale 2/3, so W/s = (1.5, -3, 0.75) rounds (half to even) to (2, -3, 1)
    and comes back as (4/3, -2, 2/3); a vector passes as it is; the given tensors are not written."""
    from gspo.rollout import rounded_weights

    w, b = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]), torch.tensor([0.3, 0.7])
    before = w.clone()
    out = dict(rounded_weights([("w", w), ("b", b)], bits=3))
    torch.testing.assert_close(out["w"], torch.tensor([[4 / 3, -2.0, 2 / 3], [0.0, 0.0, 0.0]]))
    assert out["b"] is b and torch.equal(w, before)
    x = torch.randn(16, 64)
    for bits in (4, 8):
        err = (dict(rounded_weights([("x", x)], bits))["x"] - x).abs().max(dim=-1).values
        assert (err <= x.abs().amax(-1) / (2 ** (bits - 1) - 1) / 2 + 1e-6).all()  # at most half a step per row
