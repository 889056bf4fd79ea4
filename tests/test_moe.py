"""Mixture-of-Experts on tiny random models of every HF family with a top-k router module: routers are found and their
gate weights reproduced, recording changes nothing, replaying the native choices changes nothing, replay forces the
recorded experts after the router moved (and the router still gets gradients), in padded and packed layouts and under
gradient checkpointing, and a whole training run with replay logs the flip rate, checkpoints and resumes."""
from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers import AutoModelForCausalLM

from gspo.train.passes import sequence_logprobs
from gspo.models.moe import Routing, check_router, find_routers, gate_weights

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2, initializer_range=0.3,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def sharp_moe(family: str, vocab_size: int):
    """A fp32 model of ``family`` (from :func:`_configs`) over ``vocab_size`` ids with routers sharp enough that a
    misplaced record shows (std 0.5), seed 0, in eval mode, on the CPU."""
    cfg = _configs()[family]
    cfg.vocab_size, cfg.pad_token_id = vocab_size, 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    for router in find_routers(model):
        torch.nn.init.normal_(router.weight, std=0.5)
    return model


def _configs():
    return {
        "mixtral": MixtralConfig(**COMMON, num_local_experts=4),
        "qwen2_moe": Qwen2MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=32,
                                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False),
        "qwen3_moe": Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=48, decoder_sparse_step=1,
                                    mlp_only_layers=[], norm_topk_prob=True, head_dim=16),
        "olmoe": OlmoeConfig(**COMMON, num_experts=4, norm_topk_prob=False),
    }


FAMILIES = list(_configs())


def tiny_moe(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[family]).float().eval()
    for router in find_routers(model):  # routers start at zero in some families: give them opinions
        torch.nn.init.normal_(router.weight, std=0.5)
    return model


def _batch(n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    lengths = torch.randint(1, 9, (n,), generator=g)
    ids = torch.randint(3, 256, (n, 8), generator=g)
    mask = torch.arange(8)[None] < lengths[:, None]
    return prompts, ids, mask


def _logp(model, batch, routing=None, rows=None, packed=False):
    prompts, ids, mask = batch
    sel = list(range(len(prompts))) if rows is None else rows.tolist()
    return sequence_logprobs(model, [prompts[i] for i in sel], ids[sel], mask[sel], pad_id=0, packed=packed,
                             routing=routing, row_ids=None if rows is None else rows)[0]


def _begin(routing, batch):
    prompts, _, mask = batch
    routing.begin_batch(len(prompts), max(len(p) + int(m) for p, m in zip(prompts, mask.sum(-1))), torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_routers_are_found_and_their_gate_weights_reproduced(family):
    """One router per MoE layer; gate_weights at the router's own choices equals its weights bit for bit."""
    model = tiny_moe(family)
    routers = find_routers(model)
    assert len(routers) == 2
    for router in routers:
        check_router(router)
    assert find_routers(AutoModelForCausalLM.from_config(MixtralConfig(**COMMON, num_local_experts=4)).model.embed_tokens) == []


def test_gate_weights_hand_worked():
    """logits (0, ln 2, ln 4) -> softmax (1/7, 2/7, 4/7); experts (2, 0) -> (4/7, 1/7), renormalised (0.8, 0.2)."""
    logits = torch.log(torch.tensor([[1.0, 2.0, 4.0]]))
    idx = torch.tensor([[2, 0]])
    like = torch.zeros(1, 2)
    torch.testing.assert_close(gate_weights(logits, idx, like, False), torch.tensor([[4 / 7, 1 / 7]]))
    torch.testing.assert_close(gate_weights(logits, idx, like, True), torch.tensor([[0.8, 0.2]]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True])
def test_recording_and_replaying_the_native_choices_change_nothing(family, packed):
    """Recording is invisible (bit-identical log-probs); replaying what was recorded, in another layout and other
    micro-batches, gives the same log-probs and a flip rate of 0."""
    model, batch = tiny_moe(family), _batch()
    plain = _logp(model, batch)
    routing = Routing(model, "old")
    _begin(routing, batch)
    with routing.recording(), torch.no_grad():
        recorded = _logp(model, batch, routing, rows=torch.arange(6), packed=False)
    assert torch.equal(recorded, plain)
    with routing.updating(), torch.no_grad():
        for rows in (torch.tensor([4, 1]), torch.tensor([0, 5, 2, 3])):
            replayed = _logp(model, batch, routing, rows=rows, packed=packed)
            routing._mode, mode = None, routing._mode  # the same forward with the hooks idle
            native = _logp(model, batch, rows=rows, packed=packed)
            routing._mode = mode
            assert torch.equal(replayed, native)
    metrics = routing.flip_metrics()
    assert metrics["moe/flip_rate"].item() == 0.0 and routing._slots.sum() > 0
    routing.close()


def _used_experts(model):
    """Capture the expert indices each MoE block's experts module receives (after any replay)."""
    seen = []
    handles = [m.register_forward_hook(lambda mod, args, out: seen.append(args[1].clone()))
               for m in model.modules() if type(m).__name__.endswith("Experts")]
    return seen, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_forces_the_recorded_experts_after_the_router_moved(family):
    """With the routers perturbed, the experts modules receive exactly the recorded experts under replay (and other
    ones without it); the flip rate counts the difference; the router still gets a gradient. Packed layout: every
    token has a record (padding routes natively, with no record to force)."""
    model, batch = tiny_moe(family), _batch()
    routing = Routing(model, "old")
    _begin(routing, batch)
    seen, handles = _used_experts(model)
    with routing.recording(), torch.no_grad():
        _logp(model, batch, routing, rows=torch.arange(6), packed=True)
    recorded = [s.clone() for s in seen]
    with torch.no_grad():
        for router in routing.routers:
            router.weight.add_(torch.randn_like(router.weight) * 2.0)
    seen.clear()
    with torch.no_grad():
        _logp(model, batch, packed=True)  # native routing of the moved routers
    assert any(not torch.equal(a, b) for a, b in zip(seen, recorded))
    seen.clear()
    with routing.updating():
        logp = _logp(model, batch, routing, rows=torch.arange(6), packed=True)
        logp.sum().backward()
    for h in handles:
        h.remove()
    assert all(torch.equal(a, b) for a, b in zip(seen, recorded))
    assert routing.flip_metrics()["moe/flip_rate"].item() > 0
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routing.routers)
    routing.close()


def test_flip_rate_hand_worked():
    """Recorded experts (0, 1) at every token; the current router prefers (1, 2) whatever the input: one of two slots
    flipped at every token and layer, 0.5; replay then hands the experts (0, 1) on."""
    model, batch = tiny_moe("mixtral"), _batch(n=2)
    routing = Routing(model, "old")
    _begin(routing, batch)
    routing.records.zero_()
    routing.records[..., 1] = 1
    routing.recorded.fill_(True)

    def prefers_1_then_2(self, hidden):
        logits = torch.zeros(hidden.reshape(-1, self.hidden_dim).shape[0], self.num_experts)
        logits[:, 1], logits[:, 2] = 2.0, 1.0
        top, idx = torch.topk(torch.softmax(logits, -1), 2, -1)
        return logits, top / top.sum(-1, keepdim=True), idx

    for r in routing.routers:
        r.forward = prefers_1_then_2.__get__(r)
    seen, handles = _used_experts(model)
    with routing.updating(), torch.no_grad():
        _logp(model, batch, routing, rows=torch.arange(2), packed=True)  # packed: no padding token (routes natively)
    for h in handles:
        h.remove()
    assert routing.flip_metrics()["moe/flip_rate"].item() == 0.5
    assert all(set(s.flatten().tolist()) == {0, 1} for s in seen)
    routing.close()


def test_replay_under_gradient_checkpointing_counts_once_and_matches():
    """Checkpointed layers recompute their forward in the backward: the replay applies there too (same gradients as
    without checkpointing) and flips are not counted twice."""
    batch = _batch()
    grads, slots = [], []
    for checkpointing in (False, True):
        model = tiny_moe("qwen3_moe")
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.2x; 5.17 has the old name
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        routing = Routing(model, "old")
        _begin(routing, batch)
        with routing.recording(), torch.no_grad():
            _logp(model, batch, routing, rows=torch.arange(6))
        with torch.no_grad():
            for router in routing.routers:
                router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)))
        with routing.updating():
            _logp(model, batch, routing, rows=torch.arange(6)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        slots.append(routing._slots.sum().item())
        routing.close()
    torch.testing.assert_close(grads[0], grads[1])
    assert slots[0] == slots[1] > 0


def test_aux_loss_is_transformers_load_balancing_loss():
    """With a coefficient, the collected router logits give coef x transformers' Switch loss (>= 1 x coef for any
    routing: it is E * sum_e f_e P_e, minimised at 1 by a uniform router)."""
    model, batch = tiny_moe("mixtral"), _batch()
    routing = Routing(model, "off", aux_loss_coef=0.1)
    _begin(routing, batch)
    with routing.updating():
        _logp(model, batch, routing, rows=torch.arange(6))
        aux = routing.aux_loss()
    assert aux is not None and aux.item() >= 0.1 * 2 - 1e-6  # top-2: the minimum is k x coef
    assert routing.aux_loss() is None  # consumed
    routing.close()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("moe")
    cfg = MixtralConfig(**{**COMMON, "vocab_size": len(tokenizer), "pad_token_id": 2}, num_local_experts=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["old", "rollout"])
def test_training_an_moe_with_replay_logs_flips_and_resumes_exactly(moe_dir, tmp_path, replay):
    """A Mixtral trained with R2 or R3: the off-policy minibatches (R3: every one) log moe/flip_rate per layer, the
    checkpoint is the MoE, and 2 + --resume 2 steps equal 4 straight (replay state lives in the batch, rebuilt on
    resume from the same rollouts); a --resume with another replay mode is refused in one line naming the key."""
    from gspo.config import build_config
    from gspo.errors import UserError
    from gspo.runlog.metrics import read_jsonl
    from gspo.train import Trainer

    def cfg(*extra):
        return build_config({}, [f"model.name='{moe_dir}'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
                                 "rollout.max_new_tokens=6", "train.minibatches=2", "train.lr=1e-2",
                                 "rewards.workers=0", "log.progress=false", f"moe.routing_replay={replay!r}",
                                 "rewards.functions=[{path='trainer_rewards:dyadic_length'}]", "log.checkpoint_every=1",
                                 *extra], device="cpu")

    Trainer(cfg("train.steps=4"), tmp_path / "straight").train()
    rows = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    assert [("moe/flip_rate" in r) for r in rows] == ([False, True] * 2 if replay == "old" else [True] * 4)
    assert all("moe/flip_rate/layer_1" in r for r in rows[1::2]) and all(r["moe/record_mb"] > 0 for r in rows)
    Trainer(cfg("train.steps=2"), tmp_path / "resumed").train()
    # Another replay mode would train the rest of the run through other experts than the first part: refused, as
    # every key that defines the update is (gspo.config.resume.RESUMABLE leaves moe.* out).
    other = "off" if replay == "old" else "old"
    with pytest.raises(UserError, match=f"--resume cannot change moe.routing_replay \\(moe.routing_replay: "
                                        f"'{replay}' -> '{other}'\\)"):
        Trainer(cfg("train.steps=4", f"moe.routing_replay={other!r}"), tmp_path / "resumed", resume=True)
    Trainer(cfg("train.steps=4"), tmp_path / "resumed", resume=True).train()
    again = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    drop = ("time/", "throughput/")
    assert [{k: v for k, v in r.items() if not k.startswith(drop)} for r in again] == \
           [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def test_moe_settings_on_a_dense_model_are_refused():
    from conftest import tiny_llama
    from gspo.config import build_config
    from gspo.errors import UserError
    from gspo.runtime import Runtime
    from gspo.train.actor import build_actor

    cfg = build_config({}, ["moe.routing_replay='old'", "model.device='cpu'"], device="cpu")
    with pytest.raises(UserError, match="dense model"):
        build_actor(cfg, Runtime.from_config(cfg.model), tiny_llama())


def test_the_hf_engine_records_every_fed_token_and_agrees_with_the_trainer():
    """R3 recording in the hf engine (fp32, CPU): every position of prompt and completion except the last sampled token
    is recorded (the samples of a prompt share its prefill's records), and the trainer's old-policy pass, replaying
    those records, routes the same way (engine-vs-trainer flip rate ~0: the same weights in the same precision)."""
    from gspo.rollout import HFEngine
    from gspo.types import SamplingParams

    class Tok:  # ids only: the tiny model's vocabulary is not a real tokenizer's
        pad_token_id = 0

        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in rows]

    model = tiny_moe("qwen3_moe")
    routing = Routing(model, "rollout")
    engine = HFEngine(model, Tok(), stop_ids=[2], device="cpu", routing=routing)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    r = engine.generate(prompts, 3, SamplingParams(max_new_tokens=7), generator=torch.Generator().manual_seed(0))
    assert r.routes.shape[:2] == r.routes_mask.shape and r.routes.dtype == torch.uint8
    _check_engine_routes(model, routing, r)
    assert torch.equal(r.routes[0, :3], r.routes[2, :3]) and torch.equal(r.routes[3, :5], r.routes[5, :5])
    routing.close()


def _check_engine_routes(model, routing, r) -> None:
    """Every fed position of each row (prompt and completion but the last sampled token) is recorded, and the
    trainer's old-policy pass replaying the records routes the same way (flip rate ~0: same weights and precision)."""
    for i, prompt in enumerate(r.prompt_ids):
        fed = len(prompt) + int(r.completion_mask[i].sum()) - 1
        assert r.routes_mask[i].nonzero().flatten().tolist() == list(range(fed)), i
    n = len(r.prompt_ids)
    routing.begin_batch(n, int(r.routes_mask.sum(-1).max()) + 1, torch.device("cpu"))
    routing.load_rollout_routes(r.routes, r.routes_mask)
    with routing.updating(), torch.no_grad():
        sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, pad_id=0, routing=routing,
                          row_ids=torch.arange(n))
    assert routing._slots.sum() > 0 and routing.flip_metrics()["moe/flip_rate"].item() <= 0.01


@pytest.mark.parametrize("engine", ["hf", "graph"])
def test_engines_record_the_routes_of_multi_turn_rows_appended_tokens_included(engine):
    """R3 over multi-turn rows (fp32, CPU), on the simple engine and the graph engine's module step: every fed
    position of prompt and completion -- sampled turns and the appended answers alike, the trainer feeds both -- is
    recorded, except the last sampled token; the trainer's old-policy pass replaying the records routes the same
    way."""
    from gspo.rollout import HFEngine
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams
    from test_envs import Answers

    class Tok:  # ids only: the tiny model's vocabulary is not a real tokenizer's
        pad_token_id = 0

        def batch_decode(self, rows, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in rows]

    model = tiny_moe("qwen3_moe")
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.weight.shape[0]))
    with torch.no_grad():
        model.lm_head.bias[2] = 4.0  # turns that end on the stop token after a few tokens
    routing = Routing(model, "rollout")
    make = {"hf": HFEngine, "graph": GraphEngine}[engine]
    built = make(model, Tok(), stop_ids=[2], device="cpu", routing=routing)
    answers = Answers([3] * 6, lambda r: [20, 21, 22][: 1 + r % 3])
    r = built.generate([[5, 6, 7], [9, 10, 11, 12, 13]], 3, SamplingParams(max_new_tokens=30, max_turn_tokens=8),
                       generator=torch.Generator().manual_seed(0), turns=answers)
    assert len(answers.calls) >= 2 and (r.completion_mask & ~r.sampled).any()
    _check_engine_routes(model, routing, r)
    routing.close()


def test_engines_that_record_routes_get_the_routing_as_they_are_built_and_the_others_are_refused(tokenizer):
    """R3 through make_engine: the hf and graph engines take the routing as they are built; the vLLM engine (which
    declares it cannot record) and the hf engine's own copy (no routing hooks) are refused in one line before anything
    is built, so no vLLM is needed here."""
    from gspo.errors import UserError
    from gspo.rollout import make_engine
    from gspo.rollout.vllm_engine import VLLMEngine

    model = tiny_moe("qwen3_moe")
    routing = Routing(model, "rollout")
    build = dict(stop_ids=[2], device=torch.device("cpu"), routing=routing)
    try:
        for kind in ("hf", "graph"):
            assert make_engine(kind, model, tokenizer, **build).routing is routing
        assert not VLLMEngine.records_routing
        with pytest.raises(UserError, match=r"needs an MoE model and an engine that records routing \(VLLMEngine does "
                                            r"not\); set rollout.engine = 'hf' or 'graph'\.$"):
            make_engine("vllm", model, tokenizer, **build)
        with pytest.raises(UserError, match="hf engine's own copy of the model has no routing hooks"):
            make_engine("hf", model, tokenizer, replica=True, **build)
    finally:
        routing.close()


@pytest.mark.slow
def test_training_with_r3_and_dapo_refill_logs_engine_and_update_flips(moe_dir, tmp_path):
    """moe.routing_replay = 'rollout' with DAPO's dynamic sampling (rounds of rollouts concatenated, routes padded by
    position): every step logs moe/flip_rate (minibatch 0 too: it compares with the engine), the batch logs
    moe/engine_flip_rate."""
    from gspo.config import build_config
    from gspo.runlog.metrics import read_jsonl
    from gspo.train import Trainer

    base = [f"model.name='{moe_dir}'", "rollout.prompts_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "train.minibatches=2", "train.steps=4", "train.lr=1e-2", "rewards.workers=0", "log.progress=false",
            "moe.routing_replay='rollout'", "rewards.functions=[{path='trainer_rewards:even_a_dyadic'}]",
            "algorithm='dapo'", "dapo.overlong_cache=2", "log.checkpoint_every=0"]
    Trainer(build_config({}, base, device="cpu"), tmp_path / "run").train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert any(r["dynamic/rounds"] > 1 for r in rows)  # zero-variance groups (even a) were refilled
    assert all(r.get("moe/flip_rate") is not None for r in rows)
    assert all(r.get("moe/engine_flip_rate") is not None for r in rows)
    Trainer(build_config({}, [*base, "rollout.engine='graph'", "train.steps=2"], device="cpu"), tmp_path / "run2").train()
    rows = read_jsonl(tmp_path / "run2" / "metrics.jsonl")
    assert all(r.get("moe/engine_flip_rate") is not None for r in rows)


def test_the_graph_engine_records_the_same_routes_as_the_hf_engine(tokenizer):
    """R3 from the graph engine (its own weight copy, static cache; eager on a CPU, the same step it captures on a GPU)
    equals the hf engine's records, position for position, on the same greedy completions."""
    from gspo.rollout import HFEngine
    from gspo.rollout.graph import GraphEngine
    from gspo.types import SamplingParams

    model = sharp_moe("qwen2_moe", len(tokenizer))
    routing = Routing(model, "rollout")
    prompts = [tokenizer.encode(t) for t in ["What is 2 + 3?", "Hi", "Tell me a story about a cat."]]
    params = SamplingParams(max_new_tokens=9, greedy=True)
    out = []
    for Engine in (HFEngine, GraphEngine):
        out.append(Engine(model, tokenizer, stop_ids=[2], routing=routing).generate(prompts, 2, params))
    hf, graph = out
    assert torch.equal(hf.completion_ids, graph.completion_ids)
    width = min(hf.routes_mask.shape[1], graph.routes_mask.shape[1])
    assert torch.equal(hf.routes_mask[:, :width], graph.routes_mask[:, :width])
    assert not hf.routes_mask[:, width:].any() and not graph.routes_mask[:, width:].any()
    m = hf.routes_mask[:, :width]
    assert torch.equal(hf.routes[:, :width][m], graph.routes[:, :width][m])
    routing.close()


@pytest.mark.parametrize("overrides,match", [
    (["moe.routing_replay='old'", "train.old_logprobs='rollout'"], "old-policy pass"),
    (["moe.routing_replay='sometimes'"], "moe.routing_replay"),
    (["moe.router_aux_loss_coef=-1"], "router_aux_loss_coef"),
    (["moe.router_aux_loss_coef=nan"], "router_aux_loss_coef"),
])
def test_bad_moe_settings_end_in_one_line(overrides, match):
    from gspo.config import build_config
    from gspo.errors import UserError

    with pytest.raises(UserError, match=match):
        build_config({}, overrides, device="cpu")


def test_the_aux_loss_knob_trains_with_transformers_loss(moe_dir, tmp_path):
    """moe.router_aux_loss_coef > 0: a training run adds it, and every step logs moe/aux_loss (>= k x coef, the
    minimum of transformers' Switch loss for top-k routing)."""
    from gspo.config import build_config
    from gspo.runlog.metrics import read_jsonl
    from gspo.train import Trainer

    cfg = build_config({}, [f"model.name='{moe_dir}'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
                            "rollout.max_new_tokens=6", "train.minibatches=2", "train.steps=2", "rewards.workers=0",
                            "log.progress=false", "moe.router_aux_loss_coef=0.01", "log.checkpoint_every=0",
                            "rewards.functions=[{path='trainer_rewards:dyadic_length'}]"], device="cpu")
    Trainer(cfg, tmp_path / "run").train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["moe/aux_loss"] >= 0.02 - 1e-6 for r in rows)
