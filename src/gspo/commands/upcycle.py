"""``gspo upcycle``: a real Mixture-of-Experts model without a download, from a dense Llama-family model.

1. **Upcycle** (Komatsuzaki et al. 2023): a Mixtral-architecture model whose attention, embeddings and norms are the
   dense model's and whose ``E`` experts per layer start as copies of the dense MLP. With copies, any router gives
   ``sum_j w_j MLP(x) = MLP(x)`` (Mixtral renormalises the top-k weights to sum to 1): the MoE computes the dense
   function exactly, and every routing decision is meaningless (all experts are the same).
2. **Drop-Upcycling** (Nakamura et al. 2025): in each expert a random fraction ``drop`` of the intermediate channels
   (rows of ``gate`` / ``up``, columns of ``down``) is re-drawn from a normal distribution with the mean and standard
   deviation of the dense matrix; each expert drops other channels, so experts differ and routing starts to matter.
3. **Self-distillation**: the MoE learns the dense model's next-token distributions, ``KL(p_dense || p_moe)`` on
   completions the dense model samples for the task's prompts, until it recovers the dense model's accuracy.

Transformers has no upcycling helper and peft / accelerate none either; the weight copy is a few lines, written here.
Shapes: ``E`` experts, ``I`` intermediate size, ``H`` hidden size, ``V`` vocabulary.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from gspo.errors import UserError

log = logging.getLogger("gspo")


def mixtral_config(dense_config, experts: int, top_k: int):
    """The Mixtral config with the dense model's shapes, ``experts`` experts per layer and ``top_k`` per token."""
    from transformers import MixtralConfig

    c = dense_config
    check_shape(experts, top_k)
    # Families whose decoder layer is Mixtral's with a dense MLP: others have weights Mixtral lacks (Qwen3's q/k norms),
    # scalars it ignores, or an MLP of another shape, and would upcycle into a model of another function.
    if c.model_type not in ("llama", "mistral") or getattr(c, "sliding_window", None):
        window = " with a sliding window" if c.model_type == "mistral" else ""
        raise UserError(f"upcycle makes a Mixtral from a dense Llama-family model (llama, or mistral without a sliding "
                        f"window); model.name is a {c.model_type!r} model{window}: upcycle a Llama-family model.")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise UserError(f"{c.model_type} model with biases in attention or MLP: Mixtral has none, so the upcycled model "
                        "would not compute the same function; upcycle a bias-free Llama-family model.")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act {c.hidden_act!r}: Mixtral experts use silu; upcycle a silu model.")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": c.rope_theta}),
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None), num_local_experts=experts, num_experts_per_tok=top_k,
        sliding_window=None, router_jitter_noise=0.0, output_router_logits=False, router_aux_loss_coef=0.0,
        attention_dropout=0.0, initializer_range=c.initializer_range,
    )


def check_shape(experts: int, top_k: int, drop: float = 0.0) -> None:
    """The MoE asked for: at least two experts (one is the dense model), 1 <= top-k <= experts, drop a fraction."""
    if experts < 2:
        raise UserError(f"--experts {experts} must be at least 2 (one expert is the dense model itself).")
    if not 1 <= top_k <= experts:
        raise UserError(f"--top-k {top_k} must be between 1 and --experts {experts}.")
    if not 0.0 <= drop <= 1.0:
        raise UserError(f"--drop {drop} must be a fraction in [0, 1].")


@torch.no_grad()
def upcycle(dense: torch.nn.Module, experts: int = 8, top_k: int = 2, drop: float = 0.5, seed: int = 0,
            router_std: float | None = None) -> torch.nn.Module:
    """A Mixtral model from ``dense`` (see the module docstring); ``drop = 0`` gives the exact dense function."""
    from transformers import MixtralForCausalLM

    check_shape(experts, top_k, drop)
    config = mixtral_config(dense.config, experts, top_k)
    moe = MixtralForCausalLM(config).to(next(dense.parameters()).dtype)
    own = moe.state_dict()
    dense_state = dense.state_dict()
    shared = {k: v for k, v in dense_state.items() if ".mlp." not in k and k in own}
    # Both ways: a dense weight left behind would silently change the function as surely as one missing.
    missing = [k for k in own if ".mlp." not in k and k not in shared and not k.endswith("lm_head.weight")]
    left = [k for k in dense_state if ".mlp." not in k and k not in own]
    if missing or left:
        raise UserError(f"{dense.config.model_type} weights do not map onto Mixtral ({(missing or left)[:3]} "
                        f"{'missing' if missing else 'left over'}); upcycle a Llama-family model.")
    moe.load_state_dict(shared, strict=False)
    g = torch.Generator().manual_seed(seed)
    std = router_std if router_std is not None else config.initializer_range
    for dense_layer, layer in zip(dense.model.layers, moe.model.layers):
        gate, up, down = (getattr(dense_layer.mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj"))  # (I,H) (I,H) (H,I)
        n_drop = round(drop * gate.shape[0])
        for e in range(experts):
            g_e, u_e, d_e = gate.clone(), up.clone(), down.clone()
            if n_drop:  # the same channels of gate, up (rows) and down (columns): whole intermediate units
                channels = torch.randperm(gate.shape[0], generator=g)[:n_drop]
                for w, src, dim in ((g_e, gate, 0), (u_e, up, 0), (d_e, down, 1)):
                    shape = w.index_select(dim, channels).shape
                    fresh = torch.randn(shape, generator=g) * src.float().std() + src.float().mean()
                    w.index_copy_(dim, channels, fresh.to(w.dtype))
            layer.mlp.experts.gate_up_proj[e].copy_(torch.cat([g_e, u_e], 0))  # (2I, H): gate rows first
            layer.mlp.experts.down_proj[e].copy_(d_e)
        layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * std)
    if config.tie_word_embeddings:
        moe.tie_weights()
    moe.generation_config = dense.generation_config
    return moe.eval()


def distill(moe: torch.nn.Module, dense: torch.nn.Module, batches, *, steps: int, lr: float, pad_id: int,
            autocast_dtype: torch.dtype | None = None, log_every: int = 10) -> list[float]:
    """Train ``moe`` for ``steps`` AdamW steps on ``KL(p_dense || p_moe)`` over the completion tokens of the batches
    ``batches()`` yields (``(prompt_ids, completion_ids (N, T), completion_mask (N, T))``); returns the loss per step."""
    from gspo.models import autocast_context, pad_sequences, positions_from_mask
    from gspo.runtime import to_device

    device = next(moe.parameters()).device
    opt = torch.optim.AdamW(moe.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    moe.train()
    for step in range(steps):
        prompts, ids, mask = next(batches)
        input_ids, attention, prompt_len = pad_sequences(prompts, ids, mask, pad_id)  # (N, P+T)
        input_ids, attention = to_device(input_ids, device), to_device(attention, device)
        positions = positions_from_mask(attention)
        at = to_device(F.pad(mask, (prompt_len - 1, 1)), device)  # (N, P+T): positions predicting a completion
        with autocast_context(device, autocast_dtype):
            with torch.no_grad():
                teacher = dense(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits[at]
            student = moe(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits[at]
        loss = F.kl_div(F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1), log_target=True,
                        reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(moe.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            log.info("distill step %d/%d: KL %.4f", step + 1, steps, losses[-1])
    moe.eval()
    return losses


@torch.no_grad()
def expert_report(moe: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
    """Expert diversity: mean pairwise relative distance of the experts' weights ``||W_a - W_b|| / ||W_a||`` per layer,
    mean routing entropy (nats; uniform over E is ln E), and the share of top-k slots each expert gets per layer
    (from the tokens of ``input_ids``)."""
    from gspo.models.moe import find_routers
    from gspo.models import positions_from_mask

    routers = find_routers(moe)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append((out[0].float(), out[2]))) for r in routers]
    try:
        moe(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask))
    finally:
        for h in handles:
            h.remove()
    real = attention_mask.reshape(-1).bool()
    distances, entropies, loads = [], [], []
    for layer, (logits, idx) in zip(moe.model.layers, seen):
        w = layer.mlp.experts.gate_up_proj.float().flatten(1)  # (E, 2I*H)
        d = torch.cdist(w, w) / w.norm(dim=1, keepdim=True)
        e = w.shape[0]
        distances.append((d.sum() / (e * (e - 1))).item())
        p = torch.softmax(logits[real], -1)
        entropies.append((-(p * p.clamp_min(1e-30).log()).sum(-1)).mean().item())
        counts = torch.bincount(idx[real].flatten(), minlength=e).float()
        loads.append((counts / counts.sum()).tolist())
    return {"pairwise_distance": sum(distances) / len(distances), "pairwise_distance_per_layer": distances,
            "routing_entropy": sum(entropies) / len(entropies), "routing_entropy_uniform": math.log(len(loads[0])),
            "load_per_expert": loads, "max_load": max(max(x) for x in loads), "min_load": min(min(x) for x in loads)}


def run_upcycle(cfg, out: str, *, experts: int, top_k: int, drop: float, steps: int, lr: float, batch: int,
                eval_n: int) -> dict[str, Any]:
    """The command: upcycle ``model.name``, distil on the task's prompts, save to the new directory ``out``, report
    (upcycle.json). ``out`` appears whole or not at all (an existing one is refused before any work: pointed at the
    dense model's own directory it would replace the model being upcycled); a run killed midway leaves a marked
    ``OUT.tmp`` that the same command run again clears."""
    from pathlib import Path

    from gspo.commands.export import new_directory

    check_shape(experts, top_k, drop)
    with new_directory(Path(out)) as tmp:
        result = _upcycle_into(cfg, tmp, experts=experts, top_k=top_k, drop=drop, steps=steps, lr=lr, batch=batch,
                               eval_n=eval_n)
    if "moe_eval" in result:
        result["moe_eval"]["model"] = out  # evaluated in OUT.tmp, before it took its name
    return result


def _upcycle_into(cfg, out_dir, *, experts: int, top_k: int, drop: float, steps: int, lr: float, batch: int,
                  eval_n: int) -> dict[str, Any]:
    import json

    from gspo.data import build_dataset, dataset_args
    from gspo.commands.evaluate import evaluate
    from gspo.models import load_model, stop_token_ids
    from gspo.prompts import encode_prompts
    from gspo.rollout import make_engine
    from gspo.runtime import Runtime
    from gspo.types import SamplingParams

    t0 = time.time()
    runtime = Runtime.from_config(cfg.model)
    device = runtime.device
    dense, tok = load_model(cfg.model.name, tokenizer=cfg.model.tokenizer, device=str(device))
    dense.eval().requires_grad_(False)
    moe = upcycle(dense.cpu(), experts=experts, top_k=top_k, drop=drop, seed=cfg.seed).to(device)
    dense.to(device)
    engine = make_engine(cfg.rollout.engine, dense, tok, stop_ids=stop_token_ids(tok, dense), device=device,
                         autocast_dtype=runtime.autocast, fused_step=cfg.rollout.fused_step)
    dataset = build_dataset(dataset_args(cfg.data, cfg.seed))
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0)

    def batches():
        i = 0
        while True:
            examples = [dataset[(i + j) % len(dataset)] for j in range(batch)]
            i += batch
            prompts = encode_prompts(tok, examples, cfg.data.system_prompt)
            r = engine.generate(prompts, 1, params, generator=gen)
            yield r.prompt_ids, r.completion_ids.cpu(), r.completion_mask.cpu().bool()

    stream = batches()
    probe_prompts, probe_ids, probe_mask = next(stream)
    from gspo.models import pad_sequences
    from gspo.runtime import to_device

    probe_ids, probe_attention, _ = pad_sequences(probe_prompts, probe_ids, probe_mask, tok.pad_token_id)
    probe = (to_device(probe_ids, device), to_device(probe_attention, device))
    before = expert_report(moe, *probe)
    losses = distill(moe, dense, stream, steps=steps, lr=lr, pad_id=tok.pad_token_id, autocast_dtype=runtime.autocast)
    after = expert_report(moe, *probe)
    moe.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    result: dict[str, Any] = {
        "dense": cfg.model.name, "experts": experts, "top_k": top_k, "drop": drop, "distill_steps": steps,
        "distill_lr": lr, "distill_batch": batch, "kl_first": losses[0] if losses else None,
        "kl_last": losses[-1] if losses else None, "kl_curve": losses, "experts_before_distill": before,
        "experts_after_distill": after, "parameters": sum(p.numel() for p in moe.parameters()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    stream.close()
    moe = engine = None  # free the GPU for the evaluations
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if eval_n:
        result["dense_eval"] = evaluate(cfg, n=eval_n, samples=0)
        result["moe_eval"] = evaluate(cfg, model_name=str(out_dir), n=eval_n, samples=0)
    result["wall_s"] = round(time.time() - t0, 1)
    (out_dir / "upcycle.json").write_text(json.dumps(result, indent=1))
    return result
