"""LoRA through peft (``lora.rank > 0``): adapters on the policy's Linear layers, the engine fed merged weights.

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
                             task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # peft's message names the module it could not find
        raise UserError(f"lora.target_modules = {targets} does not fit {type(model).__name__}: {e}") from e
    wrapped.peft_config["default"].base_model_name_or_path = base_name
    return wrapped


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the plain model for every weight of ``model`` (the policy with adapters injected): an
    adapted layer's weight is ``W + delta`` under the plain name, the adapters themselves are left out. Each delta is
    computed as its weight is handed out, so at most one layer's merged copy exists at a time."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, p in model.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            owner, _, leaf = name.partition(".base_layer.")
            value = p.detach()
            layer = layers.get(owner)
            if leaf == "weight" and layer is not None:
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        value = value + layer.get_delta_weight(adapter).to(value.dtype)
            yield f"{owner}.{leaf}", value
        else:
            yield name, p.detach()


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
