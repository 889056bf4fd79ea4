"""Multi-turn environments and tools: the conversation is built token by token, never re-tokenised.

- :mod:`gspo.envs.turns`: the tokens a row gets after each sampled assistant turn (a fixed-base suffix diff of the
  chat template), and the start-up check that the model's template renders a conversation the way the rows do.
"""
