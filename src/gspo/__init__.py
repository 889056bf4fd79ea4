"""gspo: RL fine-tuning of language models with sequence-level importance sampling (GSPO), GSPO-token, GRPO, DAPO."""
from gspo.errors import UserError

__version__ = "0.1.0"
__all__ = ["Trainer", "group_advantages", "overlong_penalty", "policy_loss", "UserError", "__version__"]


def __getattr__(name: str):
    # Lazy: `import gspo.<torch-free module>` (reward workers, `gspo config`) must not import torch on the way.
    if name in ("group_advantages", "overlong_penalty", "policy_loss"):
        from gspo import algorithms

        return getattr(algorithms, name)
    if name == "Trainer":
        from gspo.train import Trainer

        return Trainer
    raise AttributeError(f"module 'gspo' has no attribute {name!r}")
