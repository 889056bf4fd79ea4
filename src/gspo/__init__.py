"""gspo: RL fine-tuning of language models with sequence-level importance sampling (GSPO), GSPO-token, GRPO, DAPO."""
from gspo.algorithms import group_advantages, overlong_penalty, policy_loss
from gspo.errors import UserError

__version__ = "0.1.0"
__all__ = ["group_advantages", "overlong_penalty", "policy_loss", "UserError", "__version__"]
