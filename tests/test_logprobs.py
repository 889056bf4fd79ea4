"""Chunked per-token log-probs: equal to the full-logits computation, in value and gradient, and to the engine's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gspo.errors import UserError
from gspo.train.passes import sequence_logprobs
from gspo.models import final_logits
from gspo.rollout import HFEngine
from gspo.types import SamplingParams

PAD = 0
PROMPTS = [[5, 17, 33, 90], [7], [400, 401, 402, 403, 404, 405]]
COMPLETIONS = [[11, 12, 13, PAD], [21, PAD, PAD, PAD], [31, 32, 33, 34]]
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def naive_logprobs(model, prompts, completions, mask, temperature=1.0):
    """Each row alone, unpadded, through the full forward: log_softmax(logits / T) gathered at the completion."""
    rows = []
    for prompt, ids, m in zip(prompts, completions.tolist(), mask.tolist()):
        length = sum(m)
        seq = torch.tensor([prompt + ids[:length]])  # (1, L)
        logits = model(seq).logits[0, len(prompt) - 1: len(prompt) - 1 + length].float()  # (length, V)
        logp = F.log_softmax(logits / temperature, -1).gather(-1, seq[0, len(prompt):, None]).squeeze(-1)
        rows.append(torch.cat([logp, logp.new_zeros(len(ids) - length)]))
    return torch.stack(rows)  # (N, T)


@pytest.fixture
def batch():
    return PROMPTS, torch.tensor(COMPLETIONS), torch.tensor(MASK, dtype=torch.bool)


@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_logits(make_tiny_model, batch, chunk_size, temperature):
    """Chunked log-probs equal the naive full-vocabulary computation to 1e-5, with 0 on padding."""
    model = make_tiny_model(vocab_size=512)
    prompts, ids, mask = batch
    with torch.no_grad():
        got, _ = sequence_logprobs(model, prompts, ids, mask, temperature=temperature, pad_id=PAD,
                                   chunk_size=chunk_size)
        expected = naive_logprobs(model, prompts, ids, mask, temperature)
    assert got.dtype == torch.float32 and got.shape == ids.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got[~mask] == 0).all()


def test_gradients_match_full_logits(make_tiny_model, batch):
    """The parameter gradients of sum(logp) through checkpointed chunks equal those of the naive computation."""
    prompts, ids, mask = batch
    model = make_tiny_model(vocab_size=512)
    sequence_logprobs(model, prompts, ids, mask, temperature=0.8, pad_id=PAD, chunk_size=2)[0].sum().backward()
    chunked = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    naive_logprobs(model, prompts, ids, mask, temperature=0.8).sum().backward()
    for name, p in model.named_parameters():
        # float32 sums in another order: agreement to 1e-5 of each gradient's scale
        assert (chunked[name] - p.grad).abs().max() <= 1e-5 * p.grad.abs().max(), name


def test_no_vocabulary_sized_tensor_saved_for_backward(make_tiny_model, batch):
    """Under grad, the chunked logits are recomputed in backward, never kept: no saved tensor has a V-sized axis."""
    prompts, ids, mask = batch
    vocab = 512
    model = make_tiny_model(vocab_size=vocab)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = sequence_logprobs(model, prompts, ids, mask, pad_id=PAD, chunk_size=2)
    assert shapes and not [s for s in shapes if s and s[-1] == vocab]
    logp.sum().backward()
    assert model.model.norm.weight.grad is not None


def test_left_padding_changes_nothing(make_tiny_model, batch):
    """A row's log-probs are the same alone as inside a left-padded batch with longer prompts."""
    prompts, ids, mask = batch
    model = make_tiny_model(vocab_size=512)
    with torch.no_grad():
        together, _ = sequence_logprobs(model, prompts, ids, mask, pad_id=PAD)
        alone, _ = sequence_logprobs(model, prompts[1:2], ids[1:2, :1], mask[1:2, :1], pad_id=PAD)
    torch.testing.assert_close(together[1, :1], alone[0], atol=1e-5, rtol=0)


def test_entropy_of_tempered_distribution(make_tiny_model, batch):
    """The entropy equals -sum p log p of softmax(logits / T) at each completion position, 0 on padding."""
    prompts, ids, mask = batch
    model = make_tiny_model(vocab_size=512)
    _, entropy = sequence_logprobs(model, prompts, ids, mask, temperature=0.7, pad_id=PAD, chunk_size=2,
                                   with_entropy=True)
    with torch.no_grad():
        seq = torch.tensor([PROMPTS[0] + COMPLETIONS[0][:3]])
        logp = F.log_softmax(model(seq).logits[0, 3:6] / 0.7, -1)  # (3, V)
        expected = -(logp.exp() * logp).sum(-1)
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy[0, :3], expected, atol=1e-5, rtol=0)
    assert (entropy[~mask] == 0).all()
    assert sequence_logprobs(model, prompts, ids, mask, pad_id=PAD)[1] is None


def test_engine_logprobs_match_recomputation(tiny_model, tokenizer):
    """The log-probs the engine records while sampling equal the trainer-side recomputation (mean |diff| < 1e-4)."""
    prompts = [tokenizer.encode(t) for t in ["Count: one, two,", "Hi", "Name three colours of the rainbow:"]]
    engine = HFEngine(tiny_model, tokenizer)
    for params in [SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9),
                   SamplingParams(max_new_tokens=12, temperature=1.3, top_k=20)]:
        rollout = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logp, _ = sequence_logprobs(tiny_model, rollout.prompt_ids, rollout.completion_ids,
                                        rollout.completion_mask, temperature=params.temperature,
                                        pad_id=rollout.pad_id, chunk_size=5)
        diff = (logp - rollout.logprobs).abs()[rollout.completion_mask]
        assert diff.mean() < 1e-4 and diff.max() < 1e-3


def test_final_logits_softcap():
    """Gemma-style soft-capping maps logits x to cap * tanh(x / cap), which the chunked path must reproduce."""
    config = type("Config", (), {"final_logit_softcapping": 10.0})()
    x = torch.tensor([0.0, 10.0, -30.0])
    torch.testing.assert_close(final_logits(config, x), 10.0 * torch.tanh(x / 10.0))


def test_prompt_count_must_match_rows(make_tiny_model, batch):
    """One prompt per completion row is required; a missing or empty prompt raises UserError."""
    prompts, ids, mask = batch
    model = make_tiny_model(vocab_size=512)
    with pytest.raises(UserError):
        sequence_logprobs(model, prompts[:2], ids, mask, pad_id=PAD)
    with pytest.raises(UserError):
        sequence_logprobs(model, [[], *prompts[1:]], ids, mask, pad_id=PAD)


@pytest.mark.parametrize("model_kind", ["llama", "qwen2"])
def test_packed_matches_padded(make_tiny_model, batch, model_kind):
    """Packed sequences (one row, positions restarting, attention within each sequence) give the padded layout's
    log-probs, entropies and gradients (fp32, CPU reference attention), on Llama and on Qwen2 (attention bias)."""
    if model_kind == "llama":
        model = make_tiny_model(vocab_size=512)
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3))
    prompts, ids, mask = batch
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = sequence_logprobs(model, prompts, ids, mask, pad_id=PAD, chunk_size=2, with_entropy=True, packed=packed)
        (logp * torch.arange(1.0, 5.0)).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    (a, ea, ga), (b, eb, gb) = results
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    torch.testing.assert_close(eb, ea, atol=1e-5, rtol=0)
    for x, y in zip(ga, gb):  # float32 sums in another order: agreement to 1e-5 of each gradient's scale
        assert (y - x).abs().max() <= 1e-5 * x.abs().max()
    assert (b[~mask] == 0).all()


def test_packed_needs_completion_prefix_masks(make_tiny_model, batch):
    """A mask with a hole (not a prefix) cannot be packed: a UserError names train.packing."""
    prompts, ids, _ = batch
    holes = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    with pytest.raises(UserError, match="train.packing"):
        sequence_logprobs(make_tiny_model(vocab_size=512), prompts, ids, holes, pad_id=PAD, packed=True)


def test_packing_refuses_sliding_window_models():
    """The packed attention is causal over whole sequences: sliding-window models are reported as unsupported."""
    from transformers import MistralConfig, Qwen2Config

    from gspo.train.passes import packing_unsupported

    assert packing_unsupported(Qwen2Config(use_sliding_window=False)) is None
    assert "sliding" in packing_unsupported(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0))
    assert "sliding" in packing_unsupported(MistralConfig(sliding_window=4096))


def test_graph_budget_refuses_what_would_not_fit():
    """A packed CUDA graph keeps its activations for the run: one more is captured only under the shape and token caps
    and with twice its estimated memory (measured bytes per token x bucket) free; before any measurement, only the
    caps apply."""
    from gspo.train.passes import graph_fits

    GiB = 1 << 30
    assert graph_fits(8192, 0, 8, 65536, 0.0, 1 * GiB)  # first capture: nothing measured yet
    assert not graph_fits(98304, 0, 8, 65536, 0.0, 100 * GiB)  # past the token cap: eager
    assert not graph_fits(1024, 8, 8, 65536, 0.0, 100 * GiB)  # past the shape cap: eager
    per_token = 200e3  # ~200 KB per token, as measured for SmolLM2-135M
    assert graph_fits(16384, 1, 8, 65536, per_token, 7 * GiB)  # needs 3.3 GB, twice that is 6.6 GB: fits in 7
    assert not graph_fits(16384, 1, 8, 65536, per_token, 6 * GiB)


@pytest.mark.parametrize("model_kind", ["llama", "qwen3"])
def test_fused_norms_compute_hf_rmsnorm(make_tiny_model, model_kind):
    """Inside fused_norms the decoder's fp32 RMSNorms run as torch's rms_norm: the same hidden states and gradients
    (fp32, 1e-5), every norm restored afterwards; Qwen3's per-head norms on other dtypes keep HF's code."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo.train.passes import fused_norms

    if model_kind == "llama":
        model = make_tiny_model(seed=0, vocab_size=128)
    else:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=32)).eval()
    ids = torch.randint(0, 128, (2, 9))
    decoder = model.get_decoder()
    out = {}
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        with fused_norms(decoder, fused):
            hidden = decoder(input_ids=ids).last_hidden_state
        hidden.pow(2).sum().backward()
        out[fused] = (hidden.detach(), [p.grad.clone() for p in decoder.parameters()])
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert not any("forward" in vars(m) for m in decoder.modules())


def test_capture_graphed_returns_the_graph_or_warns_and_gives_none(monkeypatch, caplog):
    """The capture both graphed update passes share (PackedGraphs, the exact update): the graphed module, built in
    training mode under grad, with the memory it kept per input token; a capture that fails gives None after one
    warning naming the pass and the error (the pass then runs eager). make_graphed_callables and the memory counter
    are stand-ins here: capturing needs a GPU, which the GPU tests give."""
    import logging

    from gspo.train import passes

    reserved = iter([1000, 1000 + 64 * 10])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: next(reserved))
    seen = []

    def graphed(module, inputs, pool=None):
        seen.append((module.training, torch.is_grad_enabled(), pool))
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", graphed)
    with torch.no_grad():
        module, per_token, seconds = passes.capture_graphed(lambda: torch.nn.Linear(2, 2).eval(),
                                                            (torch.zeros(64, dtype=torch.long),), "pool", "for a test")
    assert isinstance(module, torch.nn.Linear) and seen == [(True, True, "pool")]
    assert per_token == 10.0 and seconds >= 0

    def fails(module, inputs, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fails)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    with caplog.at_level(logging.WARNING, logger="gspo"):
        module, per_token, _ = passes.capture_graphed(lambda: torch.nn.Linear(2, 2), (torch.zeros(4),), None,
                                                      "of the exact update")
    assert module is None and per_token == 0.0
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graphs of the exact update are off for this run (RuntimeError: operation not permitted when stream is "
        "capturing); it runs eager."]
