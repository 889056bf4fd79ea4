"""LoRA through peft (``lora.rank > 0``): adapters on the policy's Linear layers (and, with ``lora.target_parameters``,
on parameters such as an MoE's stacked expert weights), the engine fed merged weights.

- :func:`apply` injects the adapters (peft's ``LoraConfig`` / ``get_peft_model``) into the policy in place: its
  Linear modules become peft's LoRA layers, the base weights freeze, and only the adapters train.
- :func:`merged_weights` is the weight seam's view of the policy: every weight under the plain model's name, with
  ``W + (alpha / rank) B A`` for the adapted ones (peft's own ``get_delta_weight``), so the rollout engines keep their
  own plain bf16 copy, their CUDA graphs and the fused decode step.
- A checkpoint holds the adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``), which
  ``PeftModel.from_pretrained`` and :func:`gspo.models.load_model` read back on top of the base model. Its
  ``base_model_name_or_path`` is the run's ``model.name`` (a hub id, a directory, a GGUF file or gspo's alias: the
  latter two load through gspo, or export with ``--merge-lora``).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from gspo.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft():
    try:
        import peft
    except ImportError as e:
        raise UserError("lora.rank > 0 needs peft; install it with pip install 'gspo[lora]' (or pip install peft).") from e
    return peft


def apply(model: torch.nn.Module, lora, base_name: str):
    """Adapters on ``model`` (in place) as ``lora`` (the ``[lora]`` config) says; returns the ``PeftModel`` around it.
    ``base_name`` (the config's ``model.name``) is recorded in the adapter's config, for loading it back."""
    peft = _peft()
    targets = lora.target_modules
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
                             target_modules="all-linear" if targets == ["all-linear"] else list(targets),
                             target_parameters=list(lora.target_parameters) or None, task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # peft's message names the module or parameter it could not find
        raise UserError(f"lora.target_modules = {targets} / lora.target_parameters = {lora.target_parameters} does not "
                        f"fit {type(model).__name__}: {e}") from e
    _check_adapted(model, lora)
    wrapped.peft_config["default"].base_model_name_or_path = base_name
    return wrapped


def _check_adapted(model: torch.nn.Module, lora) -> None:
    """What peft adapted is what was asked for, and trains what the engine samples from. peft accepts a list of
    targets as soon as one entry matches (a typo silently drops the others) and skips a ``target_parameters`` entry
    that matches nothing; an adapted weight that another name shares (tied embeddings: ``embed_tokens`` is
    ``lm_head``) is merged under one name only, so the engine would sample from other weights than the policy trains;
    a rank above a weight's smaller dimension adds parameters and no expressiveness."""
    by_owner = _layers_by_owner(model)
    adapted, modules = {}, set()  # plain name of each adapted parameter -> it; the modules adapted as modules
    for owner, layers in by_owner.items():
        for layer in layers:
            leaf = getattr(layer, "parameter_name", None)
            if leaf is None:
                modules.add(owner)
            adapted[f"{owner}.{leaf or 'weight'}"] = getattr(layer.get_base_layer(), leaf or "weight")
    for key, entries, names, what in (("target_modules", lora.target_modules, modules, "module"),
                                      ("target_parameters", lora.target_parameters, set(adapted), "parameter")):
        if entries == ["all-linear"]:
            continue
        missing = [t for t in entries if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            hint = " ('all-linear' stands alone)" if "all-linear" in missing else ""
            raise UserError(f"lora.{key} = {entries} does not fit {type(model).__name__}: {missing} names no {what} of "
                            f"it{hint}; fix the names (a module path suffix, e.g. 'q_proj' or 'experts.gate_up_proj') "
                            "or leave them out.")
    storage: dict = {}  # where each parameter's memory is -> every name the model gives it
    for name, p in model.named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            storage.setdefault(_address(p), set()).add(name.replace(".base_layer", ""))
    for name, p in adapted.items():
        shared = sorted(storage.get(_address(p), set()) - {name})
        if shared:
            raise UserError(f"lora.target_modules / lora.target_parameters put an adapter on {name}, which this model "
                            f"shares with {', '.join(shared)} (tied weights): the merged weight would stand for both "
                            "in the engine while the policy adapts one; leave it out of the LoRA targets.")
    if not adapted:
        return
    name, p = min(adapted.items(), key=lambda item: min(item[1].shape[-2:]))  # the tightest bound on the rank
    smaller = min(p.shape[-2:])
    if lora.rank > smaller:
        raise UserError(f"lora.rank = {lora.rank} is above the smaller dimension of {name} "
                        f"({' x '.join(map(str, p.shape))}): a rank above {smaller} adds parameters and no "
                        f"expressiveness; use lora.rank <= {smaller} or full fine-tuning (lora.rank = 0).")


def _address(p: torch.Tensor):
    """Where a tensor's memory is: tied parameters (and views of one storage) share it."""
    ptr = p.untyped_storage().data_ptr()
    return (p.device, ptr) if ptr else id(p)


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the plain model for every weight of ``model`` (the policy with adapters injected): an
    adapted weight is ``W + delta`` under the plain name, the adapters themselves are left out. A Linear's LoRA layer
    adapts its ``weight``; a parameter adapter (peft's ``ParamWrapper``, e.g. an MoE's stacked expert weights) adapts
    its ``parameter_name``, and several of them on one module nest (``experts.base_layer.base_layer.gate_up_proj``).
    Each delta is computed as its weight is handed out, so at most one merged tensor exists at a time."""
    by_owner = _layers_by_owner(model)
    for name, p in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer", "")
        value = p.detach()
        if plain != name:
            owner, leaf = plain.rsplit(".", 1)
            for layer in by_owner.get(owner, []):
                if getattr(layer, "parameter_name", "weight") != leaf:
                    continue
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        value = value + layer.get_delta_weight(adapter).to(value.dtype)
        yield plain, value


def _layers_by_owner(model: torch.nn.Module) -> dict[str, list]:
    """The plain name of each adapted module (peft's ``.base_layer`` wrappers removed) -> the LoRA layers around it:
    one for a Linear, one per adapted parameter for parameter targets (peft nests those wrappers)."""
    from peft.tuners.lora import LoraLayer

    by_owner: dict[str, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            by_owner.setdefault(name.replace(".base_layer", ""), []).append(m)
    return by_owner


def read_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter config and weights of checkpoint ``folder``, each file checked where it is read: a missing,
    truncated or foreign file is one line naming it (safetensors raises its own ``SafetensorError``, not an
    ``OSError``). Every reader of an adapter (export, merge, eval, resume) goes through here."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def damaged(name: str, why: str) -> UserError:
        return UserError(f"The LoRA adapter in {str(folder)!r} is damaged: {name} {why}; use another checkpoint of "
                         "the run (runs/NAME/checkpoints/step-N) or train again.")

    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise damaged(ADAPTER_CONFIG, "is missing") from None
    except (OSError, ValueError) as e:
        raise damaged(ADAPTER_CONFIG, f"cannot be read ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" or not config.get("base_model_name_or_path"):
        raise damaged(ADAPTER_CONFIG, "is not the config of a LoRA adapter with its base model")
    try:
        weights = load_file(str(folder / ADAPTER_WEIGHTS))
    except FileNotFoundError:
        raise damaged(ADAPTER_WEIGHTS, "is missing") from None
    except (OSError, ValueError, SafetensorError) as e:
        raise damaged(ADAPTER_WEIGHTS, f"cannot be read ({e})") from None
    if not weights or not all(".lora_" in k for k in weights):
        raise damaged(ADAPTER_WEIGHTS, "holds no LoRA weights")
    return config, weights


def load_adapter(wrapped, folder: Path) -> None:
    """The adapter weights of checkpoint ``folder`` into ``wrapped``, in place; every adapter weight ``wrapped`` has
    must be in the file, and nothing else."""
    from peft import set_peft_model_state_dict

    _, weights = read_adapter(folder)
    try:
        result = set_peft_model_state_dict(wrapped, weights)
    except RuntimeError as e:  # a shape that does not fit: another rank or another model
        raise UserError(f"The LoRA adapter in {str(folder)!r} does not fit the model ({str(e).splitlines()[0]}); use "
                        "the base model and LoRA settings it was trained with.") from e
    own = {n for n, _ in wrapped.named_parameters() if ".lora_" in n}
    missing = sorted(k for k in getattr(result, "missing_keys", []) if k in own)
    unexpected = getattr(result, "unexpected_keys", [])
    if missing or unexpected:
        raise UserError(f"The LoRA adapter in {str(folder)!r} does not fit the model (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}); use the base model and LoRA settings it was trained with.")


def is_adapter(folder: Path) -> bool:
    """A checkpoint holding an adapter (either of its files: a missing other one is named by :func:`read_adapter`)."""
    return (folder / ADAPTER_CONFIG).is_file() or (folder / ADAPTER_WEIGHTS).is_file()


def base_name(folder: Path) -> str:
    """The base model an adapter checkpoint was trained on (``model.name`` of its run)."""
    return read_adapter(folder)[0]["base_model_name_or_path"]


def load_merged(folder: Path, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with the adapter of ``folder`` merged in: a plain model. Built as training built it (the adapter's
    config) and loaded through :func:`load_adapter`, which checks that the file fits (peft's ``from_pretrained``
    only warns about adapter weights it did not find)."""
    peft = _peft()
    config = peft.LoraConfig.from_pretrained(str(folder))
    wrapped = peft.get_peft_model(base, config)
    load_adapter(wrapped, folder)
    return wrapped.merge_and_unload()
