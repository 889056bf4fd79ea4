"""Worker processes that run user code (reward functions, environments, tools), each call under a hard time limit.

- :mod:`gspo.workers.pool`: the parent's side: handles to the workers, process-group kill, sending chunks of calls,
  waiting for answers until the next deadline, replacing a worker that died or overran, shutting them down;
- :mod:`gspo.workers.child`: the worker's side: signals, process group, import path, then answer each call with the
  function the client's ``load`` gave;
- :mod:`gspo.workers.forkserver`: what the fork server that starts the workers imports first.

The clients (:mod:`gspo.rewards.runner`, :mod:`gspo.envs.pool`) name their worker code to this package as strings and
functions; this package imports none of them.
"""
