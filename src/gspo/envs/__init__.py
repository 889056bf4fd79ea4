"""Multi-turn environments and tools: the conversation is built token by token, never re-tokenised (docs/envs.md).

- :mod:`gspo.envs.turns`: the ids a row gets after each sampled assistant turn (a fixed-base suffix diff of the chat
  template), and the start-up check that the model's template renders a conversation the way the rows do;
- :mod:`gspo.envs.episodes`: the turns between the engine's (tool calls, environment steps, rewards, ``env/*``);
- :mod:`gspo.envs.pool` and :mod:`gspo.envs.worker`: environments and tools in worker processes under time limits;
- :mod:`gspo.envs.tools`: tool-call formats (Hermes, Llama 3, Mistral); :mod:`gspo.envs.builtin`: a calculator tool
  and the GuessNumber game.
"""
