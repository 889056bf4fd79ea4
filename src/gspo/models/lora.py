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
    if getattr(model.config, "tie_word_embeddings", False) and any("lm_head" in m for m in targets):
        raise UserError(f"lora.target_modules = {targets} puts an adapter on the LM head, which this model ties to its "
                        "input embeddings (the merged head would overwrite both); leave lm_head out.")
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
                             target_modules="all-linear" if targets == ["all-linear"] else list(targets),
                             target_parameters=list(lora.target_parameters) or None, task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # peft's message names the module or parameter it could not find
        raise UserError(f"lora.target_modules = {targets} / lora.target_parameters = {lora.target_parameters} does not "
                        f"fit {type(model).__name__}: {e}") from e
    _check_parameter_targets(model, lora.target_parameters)
    wrapped.peft_config["default"].base_model_name_or_path = base_name
    return wrapped


def _check_parameter_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """peft skips a ``target_parameters`` entry that matches nothing without a word: refuse it instead (a dense model
    given MoE expert targets would otherwise train no adapter where the user asked for one)."""
    adapted = [f"{owner}.{m.parameter_name}" for owner, layers in _layers_by_owner(model).items() for m in layers
               if hasattr(m, "parameter_name")]
    missing = [t for t in targets if not any(a == t or a.endswith("." + t) for a in adapted)]
    if missing:
        raise UserError(f"lora.target_parameters = {targets} does not fit {type(model).__name__}: {missing} names no "
                        "parameter of it (write a module path suffix and the parameter, e.g. 'experts.gate_up_proj'); "
                        "fix the names or leave lora.target_parameters empty.")


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


def load_adapter(wrapped, folder: Path) -> None:
    """The adapter weights of checkpoint ``folder`` into ``wrapped``, in place."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(wrapped, load_file(str(folder / ADAPTER_WEIGHTS)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise RuntimeError(f"checkpoint {folder} does not match the adapters: unexpected {unexpected[:5]}")


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def base_name(folder: Path) -> str:
    """The base model an adapter checkpoint was trained on (``model.name`` of its run)."""
    return json.loads((folder / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]


def load_merged(folder: Path, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with the adapter of ``folder`` merged in: a plain model."""
    peft = _peft()
    return peft.PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
