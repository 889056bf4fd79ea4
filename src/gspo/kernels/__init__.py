"""The forward both sides run, in one home: the graph engine samples with it (:mod:`gspo.rollout.graph`) and under
``rollout.exact`` the trainer recomputes and differentiates it (:mod:`gspo.train.exact`).

- ``fused.py``: :class:`~gspo.kernels.fused.FusedDecoder` (a Llama-family decoder as 4 GEMMs over packed copies of each
  layer's weights and 5 Triton kernels; ``forward_tokens`` is the decode step, the engine's prefill and the trainer's
  exact pass), which models it can run (``fused_unsupported``, ``exact_unsupported``) and the exact MoE block.
- ``fused_kernels.py``: the fused step's Triton kernels (residual add + RMSNorm, rotary + K/V write, SiLU-and-multiply).
- ``exact_kernels.py``: the batch-invariant kernels of ``rollout.exact`` (matmul, rotary + K/V write, tile attention,
  token log-probs, MoE routing and grouped matmuls).
- ``exact_grad.py``: autograd Functions over those kernels (``DifferentiableExact``), the dense update's own backward.
- ``grad_kernels.py``: that backward's fused Triton kernels.

Importing a module here that defines kernels needs ``triton`` (``fused_unsupported`` says when it is missing); this
package imports nothing of the trainer, the engines, collection or the feed (``tests/test_layout.py``).
"""
