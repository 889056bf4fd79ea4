"""PPO's value model (``algorithm = "ppo"``): a causal LM's decoder with a scalar head in place of its LM head.

By default it is a second copy of the policy's starting weights (``ppo.critic_model`` unset), as verl and OpenRLHF
initialise their critics; a path there loads another model, e.g. a smaller one of the same tokenizer. The head starts
at zero, so the first values are 0 and the first advantages are the returns themselves (GAE with gamma = lam = 1:
the outcome reward), rather than a random head's noise.
"""
from __future__ import annotations

import torch

from gspo.errors import UserError


class ValueModel(torch.nn.Module):
    """``backbone``: the decoder (the causal LM's ``get_decoder()``); ``head``: Linear(hidden, 1), zero-initialised."""

    def __init__(self, causal_lm: torch.nn.Module):
        from gspo.models import disable_dropout
        from gspo.models.moe import disable_router_noise

        super().__init__()
        disable_dropout(causal_lm)  # the update must see the values the pre-update pass saw
        disable_router_noise(causal_lm)
        self.backbone = causal_lm.get_decoder()
        self.config = causal_lm.config
        hidden = getattr(self.config, "hidden_size", None)
        if hidden is None:
            raise UserError(f"The value model ({type(causal_lm).__name__}) has no hidden_size in its config; use a "
                            "decoder-only causal LM for ppo.critic_model.")
        param = next(self.backbone.parameters())
        self.head = torch.nn.Linear(hidden, 1, dtype=torch.float32, device=param.device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def get_decoder(self) -> torch.nn.Module:
        return self.backbone


def load_value_model(name: str, device: str | torch.device, policy_tokenizer, *,
                     tokenizer_name: str | None = None) -> ValueModel:
    """The value model for ``ppo.critic_model`` (or the policy's ``model.name``): its decoder with a zero head. Its
    tokenizer must be the policy's (it reads the policy's token ids): refused in one line otherwise."""
    from gspo.models import load_model

    causal_lm, tokenizer = load_model(name, device=str(device), tokenizer=tokenizer_name)
    if tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        raise UserError(f"ppo.critic_model = {name!r} has another tokenizer than the policy's; the critic reads the "
                        "policy's token ids, so pick a model of the same tokenizer (or leave ppo.critic_model unset: "
                        "a copy of the policy).")
    return ValueModel(causal_lm)
