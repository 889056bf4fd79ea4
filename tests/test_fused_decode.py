"""The fused decode step (``gspo.kernels.fused`` + ``gspo.kernels.fused_kernels``): each Triton kernel against the HF
operation it replaces, and the engine's fused path against its module path. Without a GPU the kernels run in Triton's
interpreter (conftest sets TRITON_INTERPRET); with one, these same tests run the compiled kernels on it."""
import pytest
import torch
import torch.nn.functional as F
from transformers import (AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from conftest import tiny_llama
from gspo.errors import UserError
from gspo.models import named_weights
from gspo.rollout.graph import GraphEngine
from gspo.types import SamplingParams

pytest.importorskip("triton")


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def kernels():
    """The Triton kernels: compiled on a GPU, run by Triton's interpreter on a CPU (conftest sets TRITON_INTERPRET)."""
    from gspo.kernels import fused_kernels as module

    return module


def test_add_rmsnorm_is_hf_residual_add_then_rmsnorm(kernels):
    torch.manual_seed(0)
    res, delta, weight = torch.randn(5, 96, device=DEV), torch.randn(5, 96, device=DEV).bfloat16(), torch.randn(96, device=DEV)
    norm = LlamaRMSNorm(96, eps=1e-5).to(DEV)
    norm.weight.data.copy_(weight)
    out = torch.empty(5, 96, dtype=torch.bfloat16, device=DEV)
    summed = res.clone()
    kernels.add_rmsnorm(summed, delta, weight, 1e-5, out)
    assert torch.equal(summed, res + delta)
    expected = norm(res + delta).detach().bfloat16()
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2 ** -7)  # at most one bf16 rounding step
    plain = torch.empty_like(out)
    kernels.add_rmsnorm(res.clone(), None, weight, 1e-5, plain)
    torch.testing.assert_close(plain.float(), norm(res).detach().bfloat16().float(), atol=0, rtol=2 ** -7)


def test_rope_cache_rotates_like_hf_and_writes_each_rows_slot(kernels):
    """Row b's key and value go to flat slot slot[b] of the cache's rows * L: its own row's slot 7, another slot, or
    a slot of another row's storage (the graph engine moves row state, not K/V); nothing else is written."""
    torch.manual_seed(1)
    B, H, Hkv, D, L = 3, 4, 2, 16, 12
    qkv = torch.randn(B, (H + 2 * Hkv) * D, device=DEV).bfloat16()
    cos, sin = torch.randn(B, D, device=DEV), torch.randn(B, D, device=DEV)
    q = torch.empty(B, H, D, dtype=torch.bfloat16, device=DEV)
    k_cache, v_cache = (torch.zeros(B, L, Hkv, D, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    where = [(0, 7), (1, 3), (0, 11)]  # (storage row, slot) of rows 0, 1, 2
    slot = torch.tensor([r * L + s for r, s in where], device=DEV)
    kernels.rope_cache(qkv, cos, sin, q, k_cache, v_cache, slot, H, Hkv, D)
    q_ref, k_ref = apply_rotary_pos_emb(qkv[:, : H * D].view(B, 1, H, D).transpose(1, 2),
                                        qkv[:, H * D:(H + Hkv) * D].view(B, 1, Hkv, D).transpose(1, 2),
                                        cos[:, None], sin[:, None])
    torch.testing.assert_close(q.float(), q_ref[:, :, 0].bfloat16().float(), atol=0, rtol=2 ** -7)
    written = torch.zeros(B, L, dtype=torch.bool)
    for b, (r, s) in enumerate(where):
        torch.testing.assert_close(k_cache[r, s].float(), k_ref[b, :, 0].bfloat16().float(), atol=0, rtol=2 ** -7)
        assert torch.equal(v_cache[r, s], qkv[b, (H + Hkv) * D:].view(Hkv, D))
        written[r, s] = True
    assert k_cache[~written].abs().sum() == 0 and v_cache[~written].abs().sum() == 0


def test_decode_attention_reads_each_rows_live_slots_only(kernels):
    """Grouped-query attention of one query per head over slots first[b] .. first[b] + used[b] - 1, equal to SDPA
    over exactly those slots; garbage in the other slots is never read; a row with used = 0 gets zeros."""
    torch.manual_seed(2)
    B, H, Hkv, D, L = 6, 6, 2, 16, 80
    k_cache, v_cache = (torch.randn(B, L, Hkv, D, device=DEV).bfloat16() for _ in range(2))
    first, used = torch.tensor([3, 0, 10, 7, 0, 4]), torch.tensor([1, 5, 20, 70, 80, 0], dtype=torch.int32)
    for b in range(B):  # NaN outside the live slots would poison any read of them
        k_cache[b, : int(first[b])] = float("nan")
        k_cache[b, int(first[b] + used[b]):] = float("nan")
    starts = torch.zeros(B + 1, dtype=torch.int32)
    starts[:B] = torch.arange(B) * L + first
    q = torch.randn(B, H, D, device=DEV).bfloat16()
    from gspo.kernels.exact_kernels import tile_attention

    i32 = dict(dtype=torch.int32, device=DEV)
    tiles = (torch.arange(B, **i32), torch.ones(B, **i32), starts[:-1].to(DEV), used.to(DEV))  # a decode step's
    out = tile_attention(q, k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D), tiles, D ** -0.5, torch.empty_like(q))
    assert out[B - 1].abs().sum() == 0  # used = 0, an ended row: nothing read, zeros written
    for b in range(B - 1):
        s, u = int(first[b]), int(used[b])
        k = k_cache[b, s:s + u].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)  # (H, u, D)
        v = v_cache[b, s:s + u].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[b].float()[:, None], k, v)[:, 0]
        torch.testing.assert_close(out[b].float(), ref, atol=2e-2, rtol=2e-2)  # p is rounded to bf16, as in flash


def test_silu_mul_rounds_like_the_hf_mlp(kernels):
    x = torch.randn(4, 2 * 50, device=DEV).bfloat16()
    out = kernels.silu_mul(x, torch.empty(4, 50, dtype=torch.bfloat16, device=DEV))
    torch.testing.assert_close(out.float(), (F.silu(x[:, :50]) * x[:, 50:]).float(), atol=0, rtol=2 ** -7)


def _models(vocab):
    torch.manual_seed(0)
    small = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=True)
    moe = dict(small, intermediate_size=48, num_experts_per_tok=2)
    return {"llama": tiny_llama(vocab_size=vocab, seed=4, init_std=0.1),
            "qwen2 (qkv bias)": Qwen2ForCausalLM(Qwen2Config(**small)).eval(),
            "qwen3 (q/k norms)": Qwen3ForCausalLM(Qwen3Config(head_dim=32, **small)).eval(),
            "mixtral (MoE)": _moe(MixtralConfig(**moe, num_local_experts=4)),
            "qwen2_moe (shared expert, a dense layer)": _moe(Qwen2MoeConfig(
                **moe, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                mlp_only_layers=[1], norm_topk_prob=False)),
            "qwen3_moe (q/k norms)": _moe(Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=48, head_dim=32,
                                                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True))}


def _graphs(arch: str, dtype) -> bool:
    """Whether the engine captures CUDA graphs for this case: on a GPU, but not for an fp32 MoE (transformers' grouped
    GEMMs copy to the host in fp32: the engine refuses to capture them, and the compiled kernels run eagerly)."""
    return DEV.type == "cuda" and not ("moe" in arch.lower() and dtype is None)


def _moe(config):
    """A tiny MoE whose routers have opinions (some families start them at zero)."""
    from gspo.models.moe import find_routers

    model = AutoModelForCausalLM.from_config(config).float().eval()
    for router in find_routers(model):
        torch.nn.init.normal_(router.weight, std=0.5)
    return model


ARCHS = ["llama", "qwen2 (qkv bias)", "qwen3 (q/k norms)", "mixtral (MoE)", "qwen2_moe (shared expert, a dense layer)",
         "qwen3_moe (q/k norms)"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_step_samples_like_the_module_step(kernels, tokenizer, arch):
    """fp32: the fused engine's tokens and log-probs equal the module path's (1e-4). bf16 autocast: the same tokens up to
    a near-tie draw, and log-probs within bf16 rounding of the module path's."""
    model = _models(len(tokenizer))[arch].to(DEV)
    # prompts of unlike lengths, two samples each: ragged rows; 4 tokens: cached and fresh positions both read
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat and a dog."]]
    params = SamplingParams(max_new_tokens=4, temperature=0.8)
    # MoE on a CPU: fp32 only (the exact check; the sparse block is the family's own module in both paths, and the
    # bf16 attention kernels are the dense archs' cases) -- each case costs ~5 s in Triton's interpreter
    cases = ((None, 1e-4), (torch.bfloat16, 0.05))
    if "moe" in arch.lower() and DEV.type == "cpu":
        cases = cases[:1]
    for dtype, tol in cases:
        out = {}
        for fused in (True, False):
            engine = GraphEngine(model, tokenizer, stop_ids=[2], autocast_dtype=dtype, fused=fused, device=DEV,
                                 use_graphs=_graphs(arch, dtype))
            assert (engine.fused is not None) == fused
            out[fused] = engine.generate(prompts, 2, params, generator=torch.Generator(device=DEV).manual_seed(1))
        a, b = out[True], out[False]
        if dtype is None:
            assert torch.equal(a.completion_ids, b.completion_ids)
            assert (a.logprobs - b.logprobs)[a.completion_mask].abs().max() < tol
            continue
        # bf16: the two paths round differently, so a near-tie of two tokens can go either way once in a while
        # (a draw whose log-probs differ by 1e-3 in 5e-3 of noise); the rows agree up to such a draw, token for token
        # and in log-probs, and most rows all the way (a broken kernel parts at the first decoded token).
        same = (a.completion_ids == b.completion_ids).long().cumprod(-1).bool()  # (N, T): the common prefix
        assert same[:, :2].all() and same.all(-1).float().mean() >= 0.75
        assert (a.logprobs - b.logprobs)[same & a.completion_mask].abs().max() < tol
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trainer's masters are untouched


def test_fused_step_sees_synced_weight_updates(kernels, tokenizer):
    """sync_weights refreshes the packed weights: after an update and a sync the fused engine samples what a fresh
    engine samples."""
    model = tiny_llama(vocab_size=len(tokenizer), seed=5, init_std=0.1).to(DEV)
    prompts = [tokenizer.encode("What is 2 + 3?")]
    params = SamplingParams(max_new_tokens=4, greedy=True)
    engine = GraphEngine(model, tokenizer, stop_ids=[2], fused=True, device=DEV)
    engine.generate(prompts, 2, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    engine.sync_weights(named_weights(model))
    after = engine.generate(prompts, 2, params)
    fresh = GraphEngine(model, tokenizer, stop_ids=[2], fused=False, device=DEV).generate(prompts, 2, params)
    assert torch.equal(after.completion_ids, fresh.completion_ids)


def test_fused_step_refuses_what_it_does_not_cover(tokenizer):
    model = tiny_llama(vocab_size=len(tokenizer))
    model.config.hidden_act = "gelu"
    with pytest.raises(UserError, match="hidden_act 'gelu' is not silu; leave fused unset"):  # asked for explicitly
        GraphEngine(model, tokenizer, fused=True)
    assert GraphEngine(model, tokenizer).fused is None  # by default: the module path
    olmoe = _moe(OlmoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2))
    with pytest.raises(UserError, match="model_type 'olmoe' is not one of"):  # its q/k norms span all heads
        GraphEngine(olmoe, tokenizer, fused=True)


def test_fused_step_records_the_module_steps_routes(kernels, tokenizer):
    """R3 in the fused step: the router hooks fire inside the fused layers (on a GPU as kernels of its graph), and the
    records equal the module step's, position for position, on the same greedy completions."""
    from gspo.models.moe import Routing

    model = _models(len(tokenizer))["qwen2_moe (shared expert, a dense layer)"].to(DEV)
    routing = Routing(model, "rollout")
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat."]]
    params = SamplingParams(max_new_tokens=5, greedy=True)
    out = {}
    for fused in (True, False):
        engine = GraphEngine(model, tokenizer, stop_ids=[2], fused=fused, device=DEV, use_graphs=_graphs("moe", None))
        engine.routing = routing
        out[fused] = engine.generate(prompts, 2, params)
    a, b = out[True], out[False]
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.routes_mask, b.routes_mask)
    assert a.routes_mask[:, max(map(len, prompts)):].any()  # decode positions were recorded, not only the prompts
    assert torch.equal(a.routes[a.routes_mask], b.routes[b.routes_mask])
    routing.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe (shared expert, a dense layer)"])
def test_fused_step_compacts_rows_like_the_whole_bucket(kernels, tokenizer, monkeypatch, arch):
    """The fused step on compacted rows (8 -> 4 -> 2 -> 1 here): the attention kernels find each moved row's live
    slots, and greedy tokens, log-probs (1e-5) and, under MoE, R3's route records equal the uncompacted step's."""
    from gspo.models.moe import Routing
    from gspo.rollout import graph

    monkeypatch.setattr(graph, "_COMPACT_MIN", 1)
    model = _models(len(tokenizer))[arch].to(DEV)
    routing = Routing(model, "rollout") if "moe" in arch else None
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat.", "Name a colour."]]
    params = SamplingParams(max_new_tokens=8, greedy=True)

    moves = []

    def run(stop_ids, compact):
        engine = GraphEngine(model, tokenizer, stop_ids=stop_ids, fused=True, device=DEV, compact=compact,
                             use_graphs=_graphs(arch, None))
        engine.routing = routing
        move = engine._compact

        def spy(b, v, rows, live):  # which rows moved: the step's rows in their new order
            out = move(b, v, rows, live)
            moves.append(v.order.tolist())
            return out

        engine._compact = spy
        return engine.generate(prompts, 1, params)

    free = run([2], False).completion_ids
    stop_ids = sorted({int(free[0, 1]), int(free[1, 3]), int(free[2, 5])})  # rows end at unlike steps
    a, b = run(stop_ids, True), run(stop_ids, False)
    assert len(set(b.lengths.tolist())) > 2
    assert any(order != sorted(order) for order in moves)  # some compaction moved a live row to another place
    assert torch.equal(a.completion_ids, b.completion_ids) and (a.logprobs - b.logprobs).abs().max() < 1e-5
    if routing is not None:
        assert torch.equal(a.routes_mask, b.routes_mask) and torch.equal(a.routes[a.routes_mask], b.routes[b.routes_mask])
        routing.close()


def test_sliding_window_keeps_the_module_step_only_past_the_window(tokenizer):
    """The fused attention has no sliding window: a bucket whose cache is longer than an active window uses the module
    step, a shorter one the fused step."""
    from gspo.kernels.fused import fused_unsupported

    model = tiny_llama(vocab_size=len(tokenizer))
    model.config.sliding_window = 128
    assert fused_unsupported(model) is None and fused_unsupported(model, 128) is None
    assert "sliding_window 128" in fused_unsupported(model, 192)


def test_config_can_turn_the_fused_step_and_compaction_off(tokenizer):
    """rollout.fused_step and rollout.compact_rows = "off" reach the graph engine (compaction is on by default where
    the engine captures graphs); a misspelt value is refused naming the field."""
    from gspo.config import build_config
    from gspo.rollout import make_engine

    model = tiny_llama(vocab_size=len(tokenizer))
    engine = make_engine("graph", model, tokenizer, stop_ids=[2], device=DEV, fused_step="off")
    assert engine.fused is None and engine.compact == engine.use_graphs == (DEV.type == "cuda")
    assert not make_engine("graph", model, tokenizer, stop_ids=[2], device=DEV, compact_rows="off").compact
    for key in ("fused_step", "compact_rows"):
        with pytest.raises(UserError, match=f"rollout.{key} = 'no' is not one of auto, off"):
            build_config(None, [f"rollout.{key}=no"])
