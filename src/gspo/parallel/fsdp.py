"""FSDP2: the policy sharded over the processes (one unit per decoder layer, the root unit holding embeddings, final
norm and LM head), and reading its full weights and values back.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from gspo.errors import UserError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (``model.model.layers``) or of PPO's value model (its backbone's)."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UserError(f"{type(model).__name__} has no model.layers to shard across processes; gspo shards decoder "
                        "models of the Llama / Qwen / Mixtral layout.")
    return list(layers)


def shard(model: torch.nn.Module, autocast: torch.dtype | None,
          prepare_forward: Callable[[torch.nn.Module], None] | None = None,
          fp32_units: tuple[torch.nn.Module, ...] = ()) -> None:
    """FSDP2 in place: one unit per decoder layer, and the root unit holding the embeddings, final norm and LM head
    (tied weights stay one parameter). Master weights stay fp32; with bf16 compute the layers gather bf16 weights and
    reduce fp32 gradients. ``prepare_forward(model)``: the caller's log-prob pass readies the sharded model for its
    forward (this package never imports the pass). ``fp32_units``: modules that run in fp32 outside autocast (PPO's
    scalar head), each a unit of its own gathering fp32 weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gspo.parallel import comm

    mp = MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=torch.float32) if autocast is not None else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    if comm.group() is not None:  # the trainers of a job with decode processes: a mesh of theirs alone
        from torch.distributed.device_mesh import DeviceMesh

        device = "cuda" if next(model.parameters()).is_cuda else "cpu"
        kwargs["mesh"] = DeviceMesh.from_group(comm.group(), device)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    for unit in fp32_units:
        fully_shard(unit, **{**kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                          reduce_dtype=torch.float32)})
    fully_shard(model, **kwargs)
    if prepare_forward is not None:
        prepare_forward(model)


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter, tied ones under each of their names, gathered one at a time (a
    collective: every rank iterates all of them in the same order). The weight seam of a sharded policy."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters(remove_duplicate=False):
        p = param.detach()
        yield name, p.full_tensor() if isinstance(p, DTensor) else p


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a plain tensor is returned as it is)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
