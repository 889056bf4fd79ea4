"""algorithm = "ppo": the value model trains beside the policy, its metrics are logged, a resumed run continues
bit for bit (the critic and its optimizer are in the checkpoint), and what is not built is refused in one line."""
import pytest
import torch

from gspo.errors import UserError
from gspo.runlog.metrics import read_jsonl
from gspo.train import Trainer

from test_trainer import tiny_config, tiny_dir  # noqa: F401 (a fixture)

CRITIC_KEYS = ["critic/value_loss", "critic/grad_norm", "critic/value_clip_frac", "critic/explained_variance",
               "critic/value_mean", "critic/return_mean", "critic/skipped"]


def _critic_params(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.critic.model.named_parameters()}


def test_ppo_trains_the_policy_and_the_value_model(tiny_dir, tmp_path):
    """Both models change; the first rollout batch's values are 0 (a zero head), so its returns are the rewards and
    the explained variance is 0; the critic's metrics are on every line."""
    trainer = Trainer(tiny_config(tiny_dir, "algorithm='ppo'", "train.steps=4", "ppo.critic_lr=1e-2"),
                      tmp_path / "run")
    policy = {k: v.detach().clone() for k, v in trainer.actor.model.named_parameters()}
    critic = _critic_params(trainer)
    assert not critic["head.weight"].any()
    trainer.train()
    assert any(not torch.equal(policy[k], v) for k, v in trainer.actor.model.named_parameters())
    assert any(not torch.equal(critic[k], v) for k, v in trainer.actor.critic.model.named_parameters())
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 4 and all(k in r for r in rows for k in CRITIC_KEYS)
    assert rows[0]["critic/value_mean"] == 0.0 and rows[0]["critic/explained_variance"] == pytest.approx(0.0, abs=1e-9)
    assert rows[2]["critic/value_mean"] != 0.0  # the second batch's values come from the trained head
    assert all(r["critic/value_loss"] > 0 for r in rows)


def test_critic_warmup_trains_only_the_value_model(tiny_dir, tmp_path):
    """(With activation checkpointing, which the value model takes too.)"""
    trainer = Trainer(tiny_config(tiny_dir, "algorithm='ppo'", "ppo.critic_warmup=1", "model.gradient_checkpointing=true"),
                      tmp_path / "run")
    backbone = trainer.actor.critic.model.backbone
    assert getattr(backbone, "is_activation_checkpointing", None) or backbone.is_gradient_checkpointing
    policy = {k: v.detach().clone() for k, v in trainer.actor.model.named_parameters()}
    critic = _critic_params(trainer)
    trainer.train()
    assert all(torch.equal(policy[k], v) for k, v in trainer.actor.model.named_parameters())
    assert any(not torch.equal(critic[k], v) for k, v in trainer.actor.critic.model.named_parameters())


def test_ppo_resumes_bit_for_bit(tiny_dir, tmp_path):
    """Four steps in one go, and two then two more from the checkpoint, write the same metrics and end with the same
    policy and value model."""
    extra = ("algorithm='ppo'", "ppo.critic_lr=1e-2")
    whole = Trainer(tiny_config(tiny_dir, *extra, "train.steps=4"), tmp_path / "whole")
    whole.train()
    half = Trainer(tiny_config(tiny_dir, *extra), tmp_path / "half")
    half.train()
    resumed = Trainer(tiny_config(tiny_dir, *extra, "train.steps=4"), tmp_path / "half", resume=True)
    resumed.train()
    a, b = read_jsonl(tmp_path / "whole" / "metrics.jsonl"), read_jsonl(tmp_path / "half" / "metrics.jsonl")
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "mem/"))}  # noqa: E731
    assert [drop(r) for r in a] == [drop(r) for r in b]
    for m1, m2 in ((whole.actor.model, resumed.actor.model), (whole.actor.critic.model, resumed.actor.critic.model)):
        assert all(torch.equal(x, y) for x, y in zip(m1.parameters(), m2.parameters()))


def test_ppo_refusals(tiny_dir):
    from gspo.config import build_config

    with pytest.raises(UserError, match="loss.advantage_baseline = 'critic' \\(PPO's GAE\\) gives per-token advantages"):
        build_config({"algorithm": "ppo", "loss": {"advantage_scale": "group"}})
    with pytest.raises(UserError, match="per-token advantages, which a sequence-level ratio cannot take"):
        build_config({"algorithm": "gspo", "loss": {"advantage_baseline": "critic", "advantage_scale": "tokens"}})
    with pytest.raises(UserError, match="per-token advantages, which GMPO cannot take"):
        build_config({"algorithm": "gmpo", "loss": {"advantage_baseline": "critic", "advantage_scale": "tokens"}})
    with pytest.raises(UserError, match="ppo.lam = 1.5 is invalid; use a lambda in \\[0, 1\\]"):
        build_config({"algorithm": "ppo", "ppo": {"lam": 1.5}})
    with pytest.raises(UserError, match="loss.step_credit adds process credit.*RLOO, REINFORCE"):
        build_config({"algorithm": "rloo", "loss": {"step_credit": "task"}, "data": {"task": "running_sum"}})
    build_config({"algorithm": "ppo", "loss": {"step_credit": "task"}, "data": {"task": "running_sum"}})  # GAE takes it
    from gspo.algorithms import group_advantages

    with pytest.raises(UserError, match="Unknown group advantage baseline 'critic'"):
        group_advantages(torch.zeros(4), 2, baseline="critic")  # GAE is the value model's, not a group statistic
    c = build_config({"algorithm": "ppo"}).loss
    assert (c.advantage_baseline, c.advantage_scale, c.level, c.eps_low, c.eps_high) == ("critic", "tokens", "token",
                                                                                         0.2, 0.2)


def test_ppo_with_lora_and_asynchronous_rollouts(tiny_dir, tmp_path):
    """The value model beside a LoRA policy (the critic trains in full), with rollouts one version ahead."""
    pytest.importorskip("peft")
    trainer = Trainer(tiny_config(tiny_dir, "algorithm='ppo'", "train.steps=4", "lora.rank=4", "lora.alpha=8",
                                  "rollout.max_staleness=1"), tmp_path / "run")
    critic = _critic_params(trainer)
    trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 4 and all(k in r for r in rows for k in CRITIC_KEYS)
    assert any(not torch.equal(critic[k], v) for k, v in trainer.actor.critic.model.named_parameters())


def test_what_ppo_cannot_do_is_refused_in_one_line(tiny_dir, tmp_path, capsys):
    """A value model of another tokenizer, and `gspo probe` (one advantage per response) end in one line naming the
    key and the fix."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo.cli import main

    other = tmp_path / "other"  # the same model with one token more in its tokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.add_tokens(["<extra_token_for_the_test>"])
    AutoModelForCausalLM.from_pretrained(tiny_dir).save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(UserError, match="ppo.critic_model = .* has another tokenizer than the policy's"):
        Trainer(tiny_config(tiny_dir, "algorithm='ppo'", f"ppo.critic_model='{other}'"), tmp_path / "run")
    args = ["probe", "noise", "--out", str(tmp_path / "probe"), f"model.name='{tiny_dir}'", "algorithm='ppo'",
            "rollout.prompts_per_batch=2", "rollout.group_size=4", "rewards.workers=0", "log.progress=false",
            "rewards.functions=[{path='trainer_rewards:text_length'}]"]
    capsys.readouterr()  # the model saves' progress bars above
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PPO's value model gives one per token" in err[0]


def test_step_credit_feeds_gae(tiny_dir, tmp_path):
    """loss.step_credit with PPO: each step's credit is a token reward at the step's last token. On the first batch
    the value model's estimates are 0 (a zero head) and gamma = lam = 1, so every token's return is the outcome plus
    the credit of the steps that end at or after it: the mean return moves by the credit, the outcome stays."""
    runs = {}
    for name, extra in (("outcome", ()), ("credit", ("loss.step_credit='trainer_rewards:every_third_char'",
                                                     "loss.step_credit_weight=0.5"))):
        Trainer(tiny_config(tiny_dir, "algorithm='ppo'", *extra), tmp_path / name).train()
        runs[name] = read_jsonl(tmp_path / name / "metrics.jsonl")[0]
    assert runs["credit"]["reward/mean"] == runs["outcome"]["reward/mean"]  # the same samples (same seed)
    assert runs["credit"]["critic/return_mean"] > runs["outcome"]["critic/return_mean"]


@pytest.mark.parametrize("critic", ["copy", "smaller"])
def test_the_value_model_exports_as_a_token_classification_model(critic, tiny_dir, tmp_path, capsys):
    """``gspo export --critic``: the value model as <Arch>ForTokenClassification with one label (transformers loads it
    without gspo, as verl loads critics); its outputs are the trained value model's values. The copy of the policy,
    and a smaller model of the same tokenizer (``ppo.critic_model``: its shape comes from that model's config, not the
    policy's). A run without a value model and flags for the policy are refused in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    from gspo.cli import main

    extra = []
    if critic == "smaller":  # one layer, a narrower hidden size
        config = AutoConfig.from_pretrained(tiny_dir)
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 1, 32, 48
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "small")
        AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "small")
        extra = [f"ppo.critic_model='{tmp_path / 'small'}'"]
    trainer = Trainer(tiny_config(tiny_dir, "algorithm='ppo'", "ppo.critic_lr=1e-2", *extra), tmp_path / "run")
    trainer.train()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "critic"), "--critic", "--dtype", "fp32"]) == 0
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    critic = trainer.actor.critic.model.eval()
    assert exported.config.hidden_size == (32 if extra else AutoConfig.from_pretrained(tiny_dir).hidden_size)
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.no_grad():
        ours = critic.head(critic.backbone(input_ids=ids).last_hidden_state.float())[..., 0]
        theirs = exported(input_ids=ids).logits[..., 0]
    assert ours.abs().sum() > 0  # the head trained away from zero
    torch.testing.assert_close(theirs, ours)
    if extra:
        return
    Trainer(tiny_config(tiny_dir), tmp_path / "grpo").train()
    capsys.readouterr()
    for argv, says in (([str(tmp_path / "grpo"), "--out", str(tmp_path / "x"), "--critic"], "has no value model"),
                       ([str(tmp_path / "run"), "--out", str(tmp_path / "y"), "--critic", "--gguf"], "drop --merge-lora")):
        assert main(["export", *argv]) != 0
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err


def test_what_a_value_model_changes_in_the_config_checks(tiny_dir, caplog):  # noqa: F811
    """With a value model, DAPO's dynamic sampling is refused (groups of equal rewards still carry signal under GAE and
    train the value model), and a group of one is refused for gspo's own reason, not a missing baseline; ppo.* settings
    without one are named in a warning (they do nothing; a shared gspo compare config may set them for a PPO arm)."""
    import logging

    with pytest.raises(UserError, match="dapo.dynamic_sampling drops the groups") as e:
        tiny_config(tiny_dir, "algorithm='ppo'", "dapo.dynamic_sampling=true")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not supported with a value model \\(PPO\\) yet"):
        tiny_config(tiny_dir, "algorithm='ppo'", "rollout.group_size=1")
    with pytest.raises(UserError, match="leaves no group to compare against"):
        tiny_config(tiny_dir, "rollout.group_size=1")
    with caplog.at_level(logging.WARNING, logger="gspo"):
        tiny_config(tiny_dir, "algorithm='grpo'", "ppo.critic_lr=1e-3")
    assert "ppo.critic_lr is set but loss.advantage_baseline = 'group_mean' trains no value model" in caplog.text
