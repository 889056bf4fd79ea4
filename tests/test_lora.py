"""LoRA through peft on a tiny random Llama: only the adapters train, the engine samples from the merged weights, the
reference policy is the policy with its adapters off, adapter checkpoints resume exactly and load as a merged model."""
import pytest
import torch

pytest.importorskip("peft")

from gspo.errors import UserError  # noqa: E402
from gspo.runlog.metrics import read_jsonl  # noqa: E402
from gspo.models import load_model  # noqa: E402
from gspo.train import Trainer  # noqa: E402
from gspo.types import SamplingParams  # noqa: E402

from test_moe import moe_dir  # noqa: E402,F401  (a tiny Mixtral, module fixture)
from test_trainer import tiny_config, tiny_dir  # noqa: E402,F401  (the module fixture)
from test_dist import turn_taking_dir  # noqa: E402,F401  (a tiny model that ends turns often, module fixture)

LORA = ("lora.rank=4", "lora.alpha=8", "train.lr=1e-2")


def _lora(tiny_dir, *extra):
    return tiny_config(tiny_dir, *LORA, *extra)


def test_only_the_adapters_train_and_the_engine_samples_the_merged_weights(tiny_dir, tmp_path):  # noqa: F811
    trainer = Trainer(_lora(tiny_dir, "train.steps=4"), tmp_path / "run")
    model = trainer.actor.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)  # the base weights never move
    assert any(".lora_B." in n for n in changed)  # B starts at zero: a trained adapter changes the policy
    trained = [p for group in trainer.actor.holding.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in trained} == {id(p) for p in model.parameters() if p.requires_grad}

    # The engine's own plain copy holds W + (alpha / r) B A once synced (the loop syncs before every rollout batch):
    # its log-probs are the adapted policy's.
    trainer.engine.sync_weights(trainer.actor.weights())
    prompts = [[1, 5, 9, 13], [1, 7, 7]]
    rollout = trainer.engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, temperature=1.0),
                                      generator=torch.Generator().manual_seed(0))
    logp, _ = trainer.actor.logprobs(rollout)
    diff = (logp - rollout.logprobs)[rollout.completion_mask].abs().max()
    assert diff < 1e-4, diff
    engine_params = dict(trainer.engine.model.named_parameters())
    assert not any("lora" in n for n in engine_params)


def test_adapters_on_moe_expert_parameters_train_and_merge_into_the_engine(moe_dir, tmp_path):  # noqa: F811
    """lora.target_parameters puts adapters on a Mixtral's stacked expert weights (3-D parameters, peft's nested
    ParamWrappers): the expert adapters train, the base experts never move, and the engine's plain copy holds the merged
    experts (its log-probs are the adapted policy's)."""
    from gspo.config import build_config

    cfg = build_config({}, [f"model.name='{moe_dir}'", "rollout.prompts_per_batch=2", "rollout.group_size=4",
                            "rollout.max_new_tokens=6", "train.steps=2", "train.minibatches=2", "rewards.workers=0",
                            "log.progress=false", "log.checkpoint_every=0", *LORA, "lora.target_modules=['q_proj']",
                            "lora.target_parameters=['experts.gate_up_proj', 'experts.down_proj']",
                            "rewards.functions=[{path='trainer_rewards:text_length'}]"], device="cpu")
    trainer = Trainer(cfg, tmp_path / "run")
    model = trainer.actor.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)
    assert any("experts" in n and ".lora_B." in n for n in changed)  # the expert adapters trained
    names = dict(trainer.actor.weights())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any("lora" in n or "base_layer" in n for n in names)
    trainer.engine.sync_weights(trainer.actor.weights())
    rollout = trainer.engine.generate([[1, 5, 9, 13], [1, 7, 7]], 2, SamplingParams(max_new_tokens=6),
                                      generator=torch.Generator().manual_seed(0))
    logp, _ = trainer.actor.logprobs(rollout)
    assert (logp - rollout.logprobs)[rollout.completion_mask].abs().max() < 1e-4


def test_the_reference_policy_is_the_policy_with_adapters_off(tiny_dir, tmp_path):  # noqa: F811
    """With a KL term the reference log-probs are the base model's, computed by the adapted policy with its adapters
    disabled (no second copy), also after the adapters have trained."""
    trainer = Trainer(_lora(tiny_dir, "loss.beta=0.1", "train.steps=2"), tmp_path / "run")
    assert trainer.actor.ref_model is None
    with torch.no_grad():  # adapters as training leaves them: B away from its zero start
        for name, p in trainer.actor.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    trainer.engine.sync_weights(trainer.actor.weights())
    batch = trainer.collector.collect()
    plan = trainer.actor.plan(batch.rollout.completion_ids.shape[0])
    trainer.actor.prepare(batch, plan)
    base, _ = load_model(str(tiny_dir))
    from gspo.train.passes import sequence_logprobs

    r = batch.rollout
    expected, _ = sequence_logprobs(base, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=1.0,
                                    pad_id=r.pad_id)
    torch.testing.assert_close(batch.ref_logprobs[r.completion_mask], expected[r.completion_mask], rtol=0, atol=1e-5)
    assert (batch.ref_logprobs - batch.old_logprobs)[r.completion_mask].abs().max() > 1e-4  # the policy has moved
    trainer.rewards.close()


def test_an_adapter_checkpoint_resumes_exactly_and_loads_as_the_merged_model(tiny_dir, tmp_path):  # noqa: F811
    whole = Trainer(_lora(tiny_dir, "train.steps=4"), tmp_path / "whole")
    whole.train()
    half = Trainer(_lora(tiny_dir, "train.steps=2"), tmp_path / "half")
    half.train()
    ckpt = tmp_path / "half" / "checkpoints" / "step-000002"
    assert (ckpt / "adapter_config.json").is_file() and (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()  # the base weights are model.name's, not copied per checkpoint
    for changed in ("lora.rank=8", "lora.rank=0", "lora.alpha=16", "lora.target_modules=['q_proj']"):
        with pytest.raises(UserError, match=f"--resume cannot change {changed.split('=')[0]} "):
            Trainer(_lora(tiny_dir, "train.steps=4", changed), tmp_path / "half", resume=True)
    resumed = Trainer(_lora(tiny_dir, "train.steps=4"), tmp_path / "half", resume=True)
    resumed.train()
    a, b = read_jsonl(tmp_path / "whole" / "metrics.jsonl"), read_jsonl(tmp_path / "half" / "metrics.jsonl")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if not k.startswith(("time/", "throughput/"))} == \
               {k: v for k, v in y.items() if not k.startswith(("time/", "throughput/"))}

    # gspo eval / transformers-style loading: the base model with the adapter merged in, a plain model
    merged, tok = load_model(str(tmp_path / "whole" / "checkpoints" / "step-000004"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, whole.actor.model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides, match", [
    (("lora.dropout=0.1",), "dropout must stay off in RL"),
    (("lora.rank=-1",), "the rank must be >= 0"),
    (("lora.target_modules=[]",), "at least one target module"),
])
def test_bad_lora_settings_are_refused_in_one_line(tiny_dir, overrides, match):  # noqa: F811
    with pytest.raises(UserError, match=match):
        tiny_config(tiny_dir, *LORA, *overrides)


def test_adapters_on_modules_the_model_lacks_and_under_fsdp_are_refused(tiny_dir, tmp_path):  # noqa: F811
    with pytest.raises(UserError, match="does not fit"):
        Trainer(_lora(tiny_dir, "lora.target_modules=['nope_proj']"), tmp_path / "run")
    with pytest.raises(UserError, match="lora.target_parameters = \\['experts.gate_up_proj'\\] does not fit"):
        Trainer(_lora(tiny_dir, "lora.target_parameters=['experts.gate_up_proj']"), tmp_path / "dense")
    with pytest.raises(UserError, match="shares with model.embed_tokens.weight \\(tied weights\\)"):  # as SmolLM2
        Trainer(_lora(tiny_dir, "lora.target_modules=['q_proj', 'lm_head']"), tmp_path / "tied")
    from gspo.parallel.strategy import check_layout

    with pytest.raises(UserError, match="with dist.strategy = 'fsdp'.*set dist.strategy = 'ddp' or 'auto'"):
        check_layout(_lora(tiny_dir, "dist.strategy='fsdp'"), 2)
    check_layout(_lora(tiny_dir), 2)  # auto: replicated


@pytest.mark.parametrize("targets", [
    ("lora.target_modules=['q_proj', 'embed_tokens']",),
    ("lora.target_modules=['q_proj']", "lora.target_parameters=['embed_tokens.weight']"),
])
def test_an_adapter_on_a_weight_the_model_shares_is_refused(tiny_dir, tmp_path, targets):  # noqa: F811
    """The tiny Llama ties lm_head to embed_tokens (as SmolLM2 does). An adapter on embed_tokens used to be taken (only
    the name lm_head was refused): the merged weights reached the engine under one of the two names, so it sampled
    from other weights than the policy trained (logprob/engine_diff_max 0.29) and the run ended with exit 0. The
    check compares the parameters' memory, not names, so either way of naming the embedding is refused."""
    with pytest.raises(UserError, match="model.embed_tokens.weight, which this model shares with lm_head.weight"):
        Trainer(_lora(tiny_dir, *targets), tmp_path / "run")


def test_an_adapter_on_untied_embeddings_trains_what_the_engine_samples(tiny_dir, tmp_path):  # noqa: F811
    """The same targets on a model whose LM head is its own weight are fine: the engine's merged copy is the policy."""
    model, tok = load_model(str(tiny_dir))
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path / "untied")
    tok.save_pretrained(tmp_path / "untied")
    trainer = Trainer(_lora(tmp_path / "untied", "lora.target_modules=['q_proj', 'embed_tokens']"), tmp_path / "run")
    with torch.no_grad():
        for name, p in trainer.actor.model.named_parameters():
            if ".lora_embedding_B." in name or ".lora_B." in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    trainer.engine.sync_weights(trainer.actor.weights())
    rollout = trainer.engine.generate([[1, 5, 9, 13], [1, 7, 7]], 2, SamplingParams(max_new_tokens=6),
                                      generator=torch.Generator().manual_seed(0))
    logp, _ = trainer.actor.logprobs(rollout)
    assert (logp - rollout.logprobs)[rollout.completion_mask].abs().max() < 1e-4
    trainer.rewards.close()


@pytest.mark.parametrize("overrides, match", [
    (("lora.target_modules=['q_proj', 'v_prj']",), "\\['v_prj'\\] names no module"),  # peft took q_proj alone
    (("lora.target_modules=['q_proj', 'all-linear']",), "'all-linear' stands alone"),
    (("lora.target_modules=['input_layernorm']",), "does not fit.*is not supported"),  # a norm
    (("lora.rank=100",), "lora.rank = 100 is above the smaller dimension of model.layers.0.self_attn.k_proj"),
])
def test_lora_targets_that_miss_or_hit_the_wrong_things_are_refused(tiny_dir, tmp_path, overrides, match):  # noqa: F811
    """peft accepts a list of targets when one entry matches: each entry must name a module of the model."""
    with pytest.raises(UserError, match=match):
        Trainer(_lora(tiny_dir, *overrides), tmp_path / "run")


def test_adapters_train_on_multi_turn_rows(turn_taking_dir, tmp_path):
    """LoRA with an environment (env_fixtures:Echo) on a tiny model that ends turns often: rows hold several turns,
    only the adapters move, and the engine's copy of the merged weights gives the adapted policy's log-probs on every
    sampled token of every turn (appended answers out of the comparison, as out of the loss)."""
    from test_envs import Answers

    cfg = tiny_config(turn_taking_dir, *LORA, "train.steps=2", "env.path='env_fixtures:Echo'", "env.workers=0",
                      "env.max_turn_tokens=4", "rollout.max_new_tokens=40", "rewards.functions=[]")
    trainer = Trainer(cfg, tmp_path / "run")
    before = {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows and all(r["env/turns_mean"] > 1 for r in rows)
    changed = {n for n, p in trainer.actor.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)
    trainer.engine.sync_weights(trainer.actor.weights())
    answers = Answers([3] * 4, lambda r: [100, 101])
    rollout = trainer.engine.generate([[1, 5, 9, 13], [1, 7, 7]], 2,
                                      SamplingParams(max_new_tokens=30, temperature=1.0, max_turn_tokens=6),
                                      generator=torch.Generator().manual_seed(0), turns=answers)
    assert (rollout.completion_mask & ~rollout.sampled).any()
    logp, _ = trainer.actor.logprobs(rollout)
    assert (logp - rollout.logprobs)[rollout.sampled].abs().max() < 1e-4
