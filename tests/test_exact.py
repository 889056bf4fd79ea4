"""rollout.exact: the graph engine's log-probs equal the trainer's recomputation bit for bit (torch.equal, not a
tolerance), for each dense family, at any batch composition, with mixed lengths and row compaction; and the check
fails when one kernel's reduction order changes (fault injection). Without a GPU the Triton kernels run in Triton's
interpreter (conftest sets TRITON_INTERPRET); with one, the same tests run the compiled kernels."""
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from conftest import tiny_llama
from gspo.config import build_config
from gspo.errors import UserError
from gspo.models import named_weights
from gspo.models.moe import find_routers
from gspo.runlog.metrics import read_jsonl
from gspo.types import SamplingParams

pytest.importorskip("triton")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _family(name: str, tied: bool = True):
    torch.manual_seed(0)
    small = dict(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=tied)
    if name == "llama":
        return tiny_llama(vocab_size=512, seed=4, init_std=0.1)
    if name == "qwen2":  # biases on q, k, v
        return Qwen2ForCausalLM(Qwen2Config(**small)).eval()
    if name == "qwen3":  # q / k norms, head_dim set apart from the hidden size
        return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **small)).eval()
    return MistralForCausalLM(MistralConfig(sliding_window=None, **small)).eval()  # G = 3 query heads per KV head


def _stop_sooner(model, bias: float):
    """The LM head biased towards the stop token 2 (an LM head bias, which both sides' forward read)."""
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.weight.shape[0]))
    with torch.no_grad():
        model.lm_head.bias[2] = bias
    return model


def _engine(model, tokenizer, dtype, **kw):
    from gspo.rollout.graph import GraphEngine

    # many stop tokens (~8% of a random model's mass): rows end at mixed lengths, and compaction has rows to move
    return GraphEngine(model.to(DEV), tokenizer, stop_ids=[2, *range(100, 140)], device=DEV, autocast_dtype=dtype,
                       exact=True, **kw)


# prompts of 1, 5 and 70 tokens (the last spans two key blocks of the attention)
PROMPTS = [[5, 6, 7, 8, 9], [11], [13 + i % 50 for i in range(70)]]
SHORT = [[5, 6, 7, 8, 9], [11], [13 + i for i in range(20)]]  # the other families (Triton's interpreter is slow)


def _rollout(engine, seed=0, max_new_tokens=10, prompts=PROMPTS, n=2):
    return engine.generate(prompts, n, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9),
                           generator=torch.Generator(DEV).manual_seed(seed))


def _trainer_logprobs(model, dtype, r, rows=None, temperature=0.9):
    from gspo.train.exact import ExactPass

    exact = ExactPass(model, dtype or torch.float32, DEV)
    if rows is not None:
        r = r.select(rows)
    return exact.logprobs(r.prompt_ids, r.completion_ids, r.completion_mask, temperature)[0].cpu()


# (Mistral, the Llama layout with another head grouping: test_a_request_split_over_calls_and_the_padded_trainer_pass)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_logprobs_are_the_trainers_bit_for_bit(family, tokenizer):
    """bf16 as on a GPU: each family's sampled tokens get the same log-prob from the trainer's packed pass, over the
    whole batch and over a reordered part of it (another batch composition and other packed offsets). Llama runs the
    long prompts (two key blocks) and 12 rows; the others 9 short rows (Triton's interpreter is slow)."""
    model = _stop_sooner(_family(family), 3.0)
    # 12 (or 9) rows in a bucket of 16, checked every step: once 8 are left they move to an 8-row step (compaction)
    engine = _engine(model, tokenizer, torch.bfloat16, compact=True, sync_every=1)
    compacted = []
    move = engine._compact
    engine._compact = lambda b, v, rows, live: compacted.append(rows) or move(b, v, rows, live)
    llama = family == "llama"
    r = _rollout(engine, prompts=PROMPTS if llama else SHORT, n=4 if llama else 3)
    m = r.completion_mask
    assert m.sum() > (30 if llama else 15) and len(set(r.lengths.tolist())) > 1 and compacted  # ragged, compacted
    whole = _trainer_logprobs(model, torch.bfloat16, r)
    assert torch.equal(whole[m], r.logprobs[m])
    rows = [5, 2, 3]
    part = _trainer_logprobs(model, torch.bfloat16, r, rows)
    assert torch.equal(part, whole[rows])


class _Turns:
    """A TurnEnds: row r gets ``1 + r % 3`` turns; after each of its turns but the last, ids ``100 + r ..`` (1-4 of them,
    different per row) are appended, as an environment's observation would be."""

    def __init__(self):
        self.left, self.calls = {}, 0

    def __call__(self, rows, turn_ids):
        self.calls += 1
        out = []
        for r in rows:
            self.left[r] = self.left.get(r, 1 + r % 3) - 1
            out.append(list(range(200 + r, 201 + r + r % 4)) if self.left[r] > 0 else None)
        return out


def test_multi_turn_rows_are_exact(tokenizer):
    """Rows of 1-3 turns with appended ids between them: every sampled token of every turn (the first token of a later
    turn comes from the extension's pass over the appended ids) has the trainer's log-prob over the whole row."""
    model = _stop_sooner(_family("qwen2"), 6.0)  # turns end on the stop token 2 after a few tokens
    engine = _engine(model, tokenizer, torch.bfloat16, compact=True, sync_every=1)
    turns = _Turns()
    r = engine.generate(SHORT, 2, SamplingParams(max_new_tokens=20, temperature=0.9, max_turn_tokens=5),
                        generator=torch.Generator(DEV).manual_seed(3), turns=turns)
    appended = r.completion_mask & ~r.sampled
    assert turns.calls >= 2 and appended.any(dim=1).sum() >= 2  # later turns happened, after appended ids
    trainer = _trainer_logprobs(model, torch.bfloat16, r)
    assert torch.equal(trainer[r.sampled], r.logprobs[r.sampled])


def test_fp32_and_greedy_are_exact_too(tokenizer):
    model = _family("llama")
    engine = _engine(model, tokenizer, None)
    r = engine.generate(SHORT, 1, SamplingParams(max_new_tokens=8, greedy=True, temperature=0.9))
    # greedy rows record log pi at temperature 1, as every engine does
    assert torch.equal(_trainer_logprobs(model, None, r, temperature=1.0)[r.completion_mask],
                       r.logprobs[r.completion_mask])


def test_a_request_split_over_calls_and_the_padded_trainer_pass_are_exact(tokenizer):
    """A request larger than ``max_batch`` is generated in several calls (other buckets, other cache lengths); the
    trainer's graphed pass pads the packed row with a dummy sequence and the tile table with empty tiles (here run
    eagerly: the CPU has no graphs): neither changes a real token's numbers."""
    from gspo.kernels.exact_kernels import tile_table
    from gspo.train.exact import ExactPass

    model = _family("mistral")
    engine = _engine(model, tokenizer, torch.bfloat16, max_batch=8)
    r = _rollout(engine, prompts=SHORT, n=4, max_new_tokens=6)  # 12 rows: calls of 2 prompts x 4, then 1 x 4
    assert torch.equal(_trainer_logprobs(model, torch.bfloat16, r)[r.completion_mask], r.logprobs[r.completion_mask])
    exact = ExactPass(model, torch.bfloat16, DEV)
    exact.weights.load(named_weights(model))  # (what logprobs does first)
    lens, starts = [5, 20, 1], [0, 5, 25]
    ids, pos = torch.randint(0, 512, (26,)), torch.cat([torch.arange(n) for n in lens])
    plain = exact._forward(ids.to(DEV), pos.to(DEV), tile_table(lens, starts, 3).to(DEV))
    table = tile_table([*lens, 6], [*starts, 26], 3)
    table = torch.cat([table, table.new_zeros(4, 5)], 1)  # 5 empty tiles
    padded = exact._forward(torch.cat([ids, torch.zeros(6, dtype=torch.long)]).to(DEV),
                            torch.cat([pos, torch.arange(6)]).to(DEV), table.to(DEV))
    assert torch.equal(padded[:26], plain)


def test_the_trainer_copy_is_refreshed_when_the_weights_version_changes(tokenizer):
    """The exact pass copies the policy's weights once per weights_version (the holding's count of optimizer steps and
    loads): the same version reuses the copy (a change made behind the holding's back is not seen), a new one reloads;
    without a version every call reloads. And an optimizer step bumps the holding's version."""
    from gspo.parallel.holding import Holding
    from gspo.train.exact import ExactPass

    model = _family("llama")
    exact = ExactPass(model, torch.bfloat16, DEV)
    args = ([[5, 6, 7]], torch.tensor([[8, 9, 10]]), torch.ones(1, 3, dtype=torch.bool))
    with torch.no_grad():  # the no-grad pass reads the copy only (the update reads the masters' norms too)
        before = exact.logprobs(*args, version=0)[0]
        model.lm_head.weight.mul_(2.0)  # tied to the embeddings: every logit changes
        assert torch.equal(exact.logprobs(*args, version=0)[0], before)
        after = exact.logprobs(*args, version=1)[0]
        assert not torch.equal(after, before) and torch.equal(exact.logprobs(*args)[0], after)
    from gspo.runtime import Runtime

    cfg = build_config({}, ["model.device='cpu'", "model.precision='fp32'"], device="cpu")
    holding = Holding(model, Runtime.from_config(cfg.model), cfg.train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    holding.apply(torch.tensor(False))
    assert holding.weights_version == 1


def _update_batch():
    # token 2 is tiny_llama's pad id: nn.Embedding gives its row no gradient, and neither may the exact update
    prompts = [[5, 2, 7], [9] * 40, [3, 4], [7 + i for i in range(20)]]
    ids = torch.randint(3, 500, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(12)[None] < torch.tensor([[12], [2], [7], [9]])
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask  # d loss / d logp
    return prompts, ids, mask, weights


def _gradients(model, logprobs, weights, to_none: bool = True) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=to_none)
    lp = logprobs()
    (lp.double() * weights.to(lp.device)).sum().backward()
    return {n: p.grad.double().cpu() for n, p in model.named_parameters()}


def _float64_gradients(model, batch) -> dict[str, torch.Tensor]:
    """The ordinary packed pass's gradients in float64 (the reference both bf16 passes are measured against)."""
    import copy

    from gspo.train.passes import sequence_logprobs

    prompts, ids, mask, weights = batch
    ref = copy.deepcopy(model).cpu().double()
    return _gradients(ref, lambda: sequence_logprobs(ref, prompts, ids, mask, pad_id=0, packed=True,
                                                     temperature=0.9)[0], weights.double())


def test_the_backward_kernels_equal_autograd_of_their_forward():
    """The exact update's fused backward kernels (gspo.kernels.grad_kernels) against autograd of a float64 torch
    re-statement of the forward, on random inputs: RMSNorm with and without a gradient reaching its input directly
    (N = 96, not a power of two), rotary embedding of q / k with the values passed through (5 query heads over 2 KV
    heads, scaled), SiLU-and-multiply."""
    from gspo.kernels import grad_kernels as gk

    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    def close(a, b):
        assert (a.double() - b).abs().max() <= 1e-4 * b.abs().max(), (a, b)

    r, g_x, g_r, w = rand(7, 96), rand(7, 96), rand(7, 96), rand(96)
    for direct in (None, g_r):
        ref_r, ref_w = r.double().requires_grad_(), w.double().requires_grad_()
        x = ref_w * ref_r * torch.rsqrt(ref_r.pow(2).mean(-1, keepdim=True) + 1e-5)
        dr, dw = torch.autograd.grad(x, (ref_r, ref_w), g_x.double())
        mine_r, mine_w = gk.rmsnorm_backward(r, g_x, w, 1e-5, direct)
        close(mine_r, dr + (0 if direct is None else direct.double()))
        close(mine_w, dw)

    n, heads, kv_heads, D = 6, 5, 2, 16
    qkv = rand(n, (heads + 2 * kv_heads) * D).double().requires_grad_()
    pos = torch.tensor([0, 3, 1, 7, 30, 2], device=DEV)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    angle = (pos.double()[:, None] * inv_freq.double()[None])[:, None]  # (n, 1, D/2)
    cos, sin = torch.cos(angle) * 1.5, torch.sin(angle) * 1.5
    q, k, v = qkv.view(n, -1, D).split([heads, kv_heads, kv_heads], 1)

    def rotate(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    grads = (rand(n, heads, D), rand(n, kv_heads, D), rand(n, kv_heads, D))
    (want,) = torch.autograd.grad((rotate(q), rotate(k), v), qkv, tuple(t.double() for t in grads))
    close(gk.rope_backward(*grads, pos, inv_freq, 1.5, torch.float32), want)

    x, g_out = rand(5, 2 * 40).double().requires_grad_(), rand(5, 40)
    gate, up = x.chunk(2, -1)
    (want,) = torch.autograd.grad(torch.nn.functional.silu(gate) * up, x, g_out.double())
    close(gk.silu_mul_backward(x.detach().float(), g_out), want)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_update_differentiates_the_exact_pass(family):
    """A dense model's update takes its log-probs from the exact pass itself (gspo.kernels.exact_grad): the same values
    bit for bit, now with a gradient. In fp32 that gradient is the float64 ordinary pass's, to fp32 rounding, for every
    parameter: the norms and biases (moved off their initial values), Qwen2's packed q|k|v bias with k's removed (a
    zero slice), Qwen3's q/k norms and untied LM head, an LM head bias."""
    from gspo.train.exact import ExactPass

    model = _stop_sooner(_family(family, tied=family != "qwen3"), 1.0)
    if family == "qwen2":
        model.model.layers[0].self_attn.k_proj.bias = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    batch = _update_batch()
    prompts, ids, mask, weights = batch
    model.to(DEV)
    exact = ExactPass(model, torch.float32, DEV)
    with torch.no_grad():
        values, entropy = exact.logprobs(prompts, ids, mask, 0.9, with_entropy=True)
    lp, ent = exact.logprobs(prompts, ids, mask, 0.9, with_entropy=True)
    assert exact.differentiable and lp.requires_grad and not ent.requires_grad
    assert torch.equal(lp.detach(), values) and torch.equal(ent, entropy)
    mine = _gradients(model, lambda: exact.logprobs(prompts, ids, mask, 0.9)[0], weights)
    ref = _float64_gradients(model, batch)
    assert mine.keys() == ref.keys()
    for name, g in ref.items():
        assert g.norm() > 0 and (mine[name] - g).norm() <= 1e-5 * g.norm(), name


def test_the_exact_update_gradient_in_bf16_is_as_close_as_the_ordinary_passs():
    """Under bf16 the update's values are the no-grad exact pass's bit for bit (its matmuls read the bf16 copy, its
    embedding and norms the fp32 masters), and its gradient carries bf16 rounding, as the ordinary (autocast) pass's
    does: measured against float64, every parameter's relative error is within 1.5x the ordinary pass's plus 0.5%
    (both are 1-2% on this model; a wrong backward term would be O(1)). Without its own backward (an MoE model, or
    activation checkpointing) the pass gives values only."""
    from gspo.train.exact import ExactPass
    from gspo.train.passes import sequence_logprobs

    model = _family("llama").to(DEV)
    batch = _update_batch()
    prompts, ids, mask, weights = batch
    exact = ExactPass(model, torch.bfloat16, DEV, use_graphs=False)
    with torch.no_grad():
        values = exact.logprobs(prompts, ids, mask, 0.9)[0]
    lp = exact.logprobs(prompts, ids, mask, 0.9)[0]
    assert lp.requires_grad and torch.equal(lp.detach(), values)  # bf16 copies of the matmuls, fp32 masters elsewhere
    mine = _gradients(model, lambda: exact.logprobs(prompts, ids, mask, 0.9)[0], weights)
    theirs = _gradients(model, lambda: sequence_logprobs(model, prompts, ids, mask, pad_id=0, packed=True,
                                                         autocast_dtype=torch.bfloat16, temperature=0.9)[0], weights)
    ref = _float64_gradients(model, batch)
    for name, g in ref.items():
        err_mine, err_theirs = ((x[name] - g).norm() / g.norm() for x in (mine, theirs))
        assert err_mine <= 1.5 * err_theirs + 0.005, (name, err_mine, err_theirs)
    values_only = ExactPass(model, torch.bfloat16, DEV, own_backward=False)
    lp = values_only.logprobs(prompts, ids, mask, 0.9)[0]
    assert not values_only.differentiable and not lp.requires_grad and torch.equal(lp, values)


def test_the_exact_update_accumulates_into_ddp_flat_gradients():
    """Under DDP every parameter's .grad is a view into one flat buffer that the all-reduce sums in place
    (gspo.parallel.ddp.flat_gradients): the exact update's backward must add into those views, not replace them,
    and give the gradient a plain backward gives."""
    from gspo.parallel.ddp import flat_gradients
    from gspo.train.exact import ExactPass

    model = _family("qwen2").to(DEV)
    prompts, ids, mask, weights = _update_batch()
    exact = ExactPass(model, torch.bfloat16, DEV, use_graphs=False)
    want = _gradients(model, lambda: exact.logprobs(prompts, ids, mask, 0.9)[0], weights)
    params = [p for p in model.parameters() if p.requires_grad]
    (flat,) = flat_gradients(params)
    views = [p.grad for p in params]
    for _ in range(2):  # accumulated twice
        lp = exact.logprobs(prompts, ids, mask, 0.9)[0]
        (lp.double() * weights.to(lp.device)).sum().backward()
    assert all(p.grad is v for p, v in zip(params, views)) and flat.abs().sum() > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double().cpu(), 2 * want[name], rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_graphed_exact_update_equals_the_eager_one():
    """On a GPU the exact update is a CUDA graph of forward and backward per bucket: its values are the no-grad exact
    pass's bit for bit (a padded bucket changes no real token's numbers), its gradient the eager one's within bf16
    rounding, twice in a row (the graph's buffers are replayed, not kept as gradients), from gradients set to None
    and from zeroed ones."""
    from gspo.train.exact import ExactPass

    model = _family("qwen3").to(DEV)
    prompts, ids, mask, weights = _update_batch()
    graphed = ExactPass(model, torch.bfloat16, DEV, use_graphs=True)
    eager = ExactPass(model, torch.bfloat16, DEV, use_graphs=False)
    with torch.no_grad():
        values = graphed.logprobs(prompts, ids, mask, 0.9)[0]
    want = _gradients(model, lambda: eager.logprobs(prompts, ids, mask, 0.9)[0], weights)
    for to_none in (True, False):  # None first: the pass allocates .grad before its graphed backward accumulates
        got = _gradients(model, lambda: graphed.logprobs(prompts, ids, mask, 0.9)[0], weights, to_none=to_none)
        assert torch.equal(graphed.logprobs(prompts, ids, mask, 0.9)[0].detach(), values) and graphed.grad_graphs
        for name, g in want.items():
            assert (got[name] - g).norm() <= 0.02 * g.norm(), name


@pytest.mark.parametrize("fault", ["attention key block", "matmul split-K"])
def test_a_changed_reduction_order_shows_a_nonzero_diff(fault, tokenizer, monkeypatch):
    """Fault injection: the engine samples with one kernel's reduction order changed (keys summed in blocks of 32
    instead of 64, or the matmul's two halves of K summed apart, as a split-K GEMM for few rows does); the trainer
    keeps the real ones. The diff must show. (A smaller K step is not a fault: the K loop accumulates into one
    accumulator in the same order whatever its step.)"""
    from gspo.kernels import exact_kernels

    model = _family("llama")
    # fp32 for the matmul: in bf16 a changed K-loop's last-bit differences mostly round away at each output (on the
    # CPU none survived a short decode); the attention's show either way
    dtype = torch.bfloat16 if fault == "attention key block" else None
    engine = _engine(model, tokenizer, dtype)
    with monkeypatch.context() as patch:
        if fault == "attention key block":
            patch.setattr(exact_kernels, "ATTENTION_BLOCK_N", 32)
        else:
            # two accumulators over the halves of K, in steps of 32: a different order on the GPU (whose dot chains
            # its accumulator through every step) and in the CPU's interpreter (which sums each step's dot apart)
            patch.setattr(exact_kernels, "MATMUL_SPLIT_K", 2)
            patch.setattr(exact_kernels, "MATMUL_BLOCK", (64, 64, 32, 4))
        r = _rollout(engine, max_new_tokens=4, prompts=PROMPTS[2:])
    m = r.completion_mask
    assert (_trainer_logprobs(model, dtype, r)[m] - r.logprobs[m]).abs().max() > 0


def test_kernels_are_batch_invariant():
    """Row i of the matmul and the log-prob kernel is the same whatever rows come with it; a decode tile of one token
    over the cache is the packed pass's row for that token."""
    from gspo.kernels import exact_kernels as ek

    torch.manual_seed(0)
    x, w = torch.randn(70, 96, device=DEV).bfloat16(), torch.randn(80, 96, device=DEV).bfloat16()
    full = ek.linear(x, w)
    assert torch.equal(ek.linear(x[33:36], w), full[33:36]) and torch.equal(ek.linear(x[[69, 0]], w), full[[69, 0]])
    logits, targets = torch.randn(5, 3000, device=DEV), torch.tensor([0, 7, 2999, 5, 1], device=DEV)
    lp = ek.token_logprobs(logits, targets, 0.7)
    assert torch.equal(ek.token_logprobs(logits[3:], targets[3:], 0.7), lp[3:])
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None])[:, 0])
    # attention: two sequences of 70 and 9 tokens packed (6 query heads, 2 KV heads), against one decode query each
    H, Hkv, D, lens = 6, 2, 16, [70, 9]
    S = sum(lens)
    q = torch.randn(S, H, D, device=DEV).bfloat16()
    k, v = (torch.randn(S, Hkv, D, device=DEV).bfloat16() for _ in range(2))
    packed = ek.tile_attention(q, k, v, ek.packed_tiles(lens, [0, 70], 3, DEV), 0.25, torch.empty_like(q))
    i32 = dict(dtype=torch.int32, device=DEV)
    for token, start in ((69, 0), (40, 0), (75, 70)):  # a decode query: token t of its sequence, t + 1 keys
        tiles = (torch.tensor([token], **i32), torch.ones(1, **i32), torch.tensor([start], **i32),
                 torch.tensor([token - start + 1], **i32))
        one = ek.tile_attention(q, k, v, tiles, 0.25, torch.zeros_like(q))
        assert torch.equal(one[token], packed[token])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:70].float().transpose(0, 1), k[:70].float().repeat_interleave(3, 1).transpose(0, 1),
        v[:70].float().repeat_interleave(3, 1).transpose(0, 1), is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(packed[:70].float(), ref, atol=2e-2, rtol=2e-2)


def test_a_rows_numbers_do_not_depend_on_its_place_in_the_tile():
    """Every row of a 64-row matmul block computed alone equals its row in the block, with fp32 output (the LM head's
    logits: no bf16 rounding to hide a last-bit difference), and every token of a packed fp32 attention its decode
    query. Under Triton's interpreter ``tl.dot`` is numpy's matmul, whose BLAS sums a row's products in an order set by
    the row's place in the block (OpenBLAS on an AVX-512 CPU: rows 0-5, 6-11 and 12-15 of every 16): the engine's logits
    then differed from the trainer's in the last bit, and a 16-row run logged engine_diff_max 9.5e-7 (2^-20, one ulp
    of a log-prob near -10.8) with minibatch 0's ratio 1.00000095. The kernels' dots must not depend on it."""
    from gspo.kernels import exact_kernels as ek

    torch.manual_seed(0)
    x, w = torch.randn(64, 64, device=DEV).bfloat16(), (torch.randn(256, 64, device=DEV) * 0.02).bfloat16()
    full = ek.linear(x, w, out_dtype=torch.float32)
    moved = [i for i in range(64) if not torch.equal(ek.linear(x[i:i + 1], w, out_dtype=torch.float32)[0], full[i])]
    assert not moved, f"rows {moved} differ alone from their place in the block"
    H, Hkv, D, lens = 6, 2, 64, [40, 9]  # G = 3: a packed tile's rows 0-14, a decode query's 0-2
    S = sum(lens)
    q = torch.randn(S, H, D, device=DEV)
    k, v = (torch.randn(S, Hkv, D, device=DEV) for _ in range(2))
    packed = ek.tile_attention(q, k, v, ek.packed_tiles(lens, [0, 40], 3, DEV), D ** -0.5, torch.empty_like(q))
    i32 = dict(dtype=torch.int32, device=DEV)
    moved = []
    for token in range(S):
        start = 0 if token < 40 else 40
        tiles = (torch.tensor([token], **i32), torch.ones(1, **i32), torch.tensor([start], **i32),
                 torch.tensor([token - start + 1], **i32))
        if not torch.equal(ek.tile_attention(q, k, v, tiles, D ** -0.5, torch.zeros_like(q))[token], packed[token]):
            moved.append(token)
    assert not moved, f"tokens {moved}: the decode query differs from the packed pass"


def test_config_refuses_what_exact_is_not_built_for(tmp_path):
    base = ["rollout.exact=true"]
    for extra, needle in ((["rollout.engine='hf'"], "rollout.engine"), (["lora.rank=8"], "LoRA"),
                          (["rollout.fused_step='off'"], "fused_step"), (["rollout.engine_weight_bits=8"], "bits"),
                          (["rollout.max_staleness=1", "rollout.in_flight='recompute'"], "in_flight")):
        with pytest.raises(UserError, match=needle) as e:
            build_config({}, base + extra, device="cpu")
        assert "\n" not in str(e.value) and "rollout.exact = false" in str(e.value)


def _moe(family: str, top_k: int = 2):
    """A tiny model of each MoE family exact runs: Mixtral, Qwen2-MoE (shared expert; layer 1 dense), Qwen3-MoE."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    small = dict(vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=True, num_experts_per_tok=top_k)
    cfg = {"mixtral": MixtralConfig(**small, num_local_experts=4),
           "qwen2_moe": Qwen2MoeConfig(**small, num_experts=6, moe_intermediate_size=48, decoder_sparse_step=1,
                                       shared_expert_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=False),
           "qwen3_moe": Qwen3MoeConfig(**small, num_experts=4, moe_intermediate_size=48, head_dim=32,
                                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)}[family]
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for router in find_routers(model):  # some families' routers start at zero: give them opinions
        torch.nn.init.normal_(router.weight, std=0.5)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_engine_logprobs_are_the_trainers_bit_for_bit(family, tokenizer):
    """MoE: the engine routes each token, runs its experts and combines them as the trainer's pass does, whatever the
    other tokens (which change how the (token, expert) pairs fall into the grouped matmul's tiles): same log-probs,
    bit for bit, through compaction (9 rows in a bucket of 16, then 8 of them in one of 8)."""
    model = _stop_sooner(_moe(family), 3.0)
    engine = _engine(model, tokenizer, torch.bfloat16, compact=True, sync_every=1)
    compacted = []
    move = engine._compact
    engine._compact = lambda b, v, rows, live: compacted.append(rows) or move(b, v, rows, live)
    r = _rollout(engine, prompts=SHORT, n=3, max_new_tokens=8)
    m = r.completion_mask
    assert m.sum() > 15 and len(set(r.lengths.tolist())) > 1 and compacted
    whole = _trainer_logprobs(model, torch.bfloat16, r)
    assert torch.equal(whole[m], r.logprobs[m])
    assert torch.equal(_trainer_logprobs(model, torch.bfloat16, r, [5, 0, 4]), whole[[5, 0, 4]])


def test_expert_kernels_are_batch_invariant_and_the_family_block():
    """The grouped matmul's row for a (token, expert) pair is the dense kernel's row with that expert's weight; the
    router picks torch's top-k of the softmax; the routed experts of a token do not depend on the other tokens, and are
    the HF block's output up to bf16 rounding."""
    from gspo.kernels import exact_kernels as ek
    from gspo.kernels.fused import exact_sparse

    model = _moe("qwen3_moe")
    block = model.model.layers[0].mlp.to(DEV, torch.bfloat16)
    x = torch.randn(37, 64, device=DEV).bfloat16()
    logits = ek.linear(x, block.gate.weight, out_dtype=torch.float32)
    weights, chosen = ek.route(logits, 2, True)
    top = torch.topk(torch.softmax(logits, -1), 2, -1)
    assert torch.equal(chosen.long(), top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
    order, at, tiles = ek.expert_tiles(chosen, 4)
    assert torch.equal(order[at], torch.arange(74, device=DEV))
    h = ek.grouped_linear(x, order // 2, block.experts.gate_up_proj, tiles)
    pairs = chosen.reshape(-1).long()[order]  # each sorted pair's expert
    assert torch.equal(pairs, pairs.sort().values)
    for i in range(0, 74, 7):
        tok, e = order[i] // 2, pairs[i]
        assert torch.equal(h[i], ek.linear(x[tok][None], block.experts.gate_up_proj[e])[0])
    out, experts = exact_sparse(block, x)
    assert torch.equal(experts, chosen)
    rows = [30, 3, 7, 3]
    assert torch.equal(exact_sparse(block, x[rows])[0], out[rows])
    torch.testing.assert_close(out.float(), block(x[:, None]).reshape(37, -1).float(), atol=3e-2, rtol=3e-2)


def test_the_gradient_pass_forces_the_exact_routes(tokenizer):
    """Under exact the update's values come from the exact pass and its gradient from the ordinary pass, which could
    route a token elsewhere: the exact pass writes its experts as the batch's records (at the batch rows it was given),
    and the ordinary pass, under ``updating``, runs the recorded experts, counting the slots it would have changed.
    (The records are then shifted to other experts, so that forcing shows: this tiny model's ordinary pass would pick
    the exact pass's experts by itself.)"""
    from gspo.models.moe import Routing
    from gspo.train.exact import ExactPass
    from gspo.train.passes import sequence_logprobs

    model = _moe("qwen3_moe")
    routing = Routing(model, "exact")
    prompts = [[5, 6, 7], [9] * 12, [3, 4]]
    ids = torch.randint(3, 500, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(6)[None] < torch.tensor([[6], [2], [4]])
    routing.begin_batch(5, 20, DEV)  # a batch of 5 rows, of which rows 4, 0, 2 are here
    rows = torch.tensor([4, 0, 2])
    exact = ExactPass(model, torch.bfloat16, DEV)
    exact.logprobs(prompts, ids, mask, routing=routing, row_ids=rows)
    lens = [len(p) + int(m.sum()) for p, m in zip(prompts, mask)]
    at_rows = torch.repeat_interleave(rows, torch.tensor(lens))
    at_pos = torch.cat([torch.arange(n) for n in lens])
    for layer, mine in enumerate(exact.decoder.routes):  # (S', k) per layer: the packed tokens in row order, then
        # (with graphs) the padding of the bucket the pass was captured for
        assert torch.equal(routing.records[layer, at_rows, at_pos].long().cpu(), mine[:sum(lens)].long().cpu())
    assert routing.recorded[[4, 0, 2]].sum() == sum(lens) and not routing.recorded[[1, 3]].any()
    routing.records[:, at_rows, at_pos] = ((routing.records[:, at_rows, at_pos].long() + 1) % 4).to(routing.dtype)
    ran = []
    hooks = [r.register_forward_hook(lambda m, a, out: ran.append(out[2])) for r in routing.routers]  # after replay's
    with routing.updating():
        sequence_logprobs(model.to(DEV), prompts, ids, mask, pad_id=0, packed=True, routing=routing, row_ids=rows,
                          autocast_dtype=torch.bfloat16)
    for h in hooks:
        h.remove()
    for layer, theirs in enumerate(ran):  # the packed pass may pad: its first S tokens are the rows' own
        assert torch.equal(theirs[:sum(lens)].long().cpu(), routing.records[layer, at_rows, at_pos].long().cpu())
    assert routing.flip_metrics()["moe/flip_rate"] > 0


def test_moe_faults_show_and_other_routers_are_refused(tokenizer, monkeypatch):
    """Fault injection: the engine combines each token's 3 experts in the reverse order (the same experts and weights,
    another order of the fp32 sum; with 2 the sum commutes): the diff must show. And a router that is not a softmax top-k is refused in one
    line."""
    from gspo.kernels import exact_kernels

    model = _moe("mixtral", top_k=3)
    engine = _engine(model, tokenizer, None)
    route = exact_kernels.route
    with monkeypatch.context() as patch:
        patch.setattr(exact_kernels, "route", lambda *a: tuple(t.flip(-1) for t in route(*a)))
        r = _rollout(engine, max_new_tokens=4, prompts=SHORT)
    m = r.completion_mask
    assert (_trainer_logprobs(model, None, r)[m] - r.logprobs[m]).abs().max() > 0
    odd = _moe("qwen3_moe")
    router = odd.model.layers[0].mlp.gate
    forward = router.forward
    router.forward = lambda h: (lambda lg, w, i: (lg, w * 0.5, i))(*forward(h))  # scores not the softmax's
    with pytest.raises(UserError, match="not a plain softmax top-k router") as e:
        _engine(odd, tokenizer, torch.bfloat16)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_training_run_proves_zero_diff_and_ratio_one(kind, tmp_path, tokenizer):
    """A run with rollout.exact and the engine's log-probs as the old ones, on a dense model (the update differentiates
    the exact pass) and on an MoE (the exact values with the ordinary pass's gradient, routes forced): every batch
    logs engine_diff_max = 0.0 (minibatch 0's update forward against the engine), and minibatch 0's ratios are
    exactly 1."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from gspo.train import Trainer

    d = tmp_path / "tiny"
    torch.manual_seed(0)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if kind == "dense" else
             MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **shape)))
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    cfg = build_config({}, [f"model.name='{d}'", "rollout.prompts_per_batch=2", "rollout.group_size=2",
                            "rollout.max_new_tokens=4", "train.steps=4", "train.minibatches=2", "train.lr=1e-3",
                            "rewards.workers=0", "log.progress=false", "rollout.exact=true",
                            "train.old_logprobs='rollout'",
                            "rewards.functions=[{path='trainer_rewards:text_length'}]",
                            # dense: bf16 as on a GPU (the update's copies of the matmuls differ from the masters)
                            *(["model.precision='bf16-autocast'"] if kind == "dense" else [])], device="cpu")
    Trainer(cfg, tmp_path / "run").train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    first = [r for r in rows if r["minibatch"] == 0]
    assert len(first) == 2
    for r in first:
        assert r["logprob/engine_diff_max"] == 0.0
        assert r["ratio/token_min"] == r["ratio/token_max"] == 1.0
    if kind == "moe":  # the gradient pass's
        assert all(r["moe/flip_rate"] >= 0 for r in rows if r.get("minibatch") is not None)
