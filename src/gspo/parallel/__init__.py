"""Data parallelism across the processes of a ``torchrun`` job: torch's FSDP2 (``fully_shard``) shards the policy
(``dist.strategy = "fsdp"``) or every process keeps a whole copy and the gradients are summed before each optimizer
step (``"ddp"``); the loop adds a few collectives. One process (no ``torchrun``, or ``WORLD_SIZE`` 1) calls none of
them.

How a rollout batch is split (``W`` ranks, ``P`` prompts, ``G`` completions):

* every rank reads the same data stream and draws the same prompts (each encodes 1/W of them and they exchange the
  ids, so that all agree on which fit ``data.max_prompt_tokens``); rank ``r`` generates and scores its ``P / W``
  prompts, each group on one rank, with its own engine and reward workers (DAPO refill rounds are taken together:
  each round every rank says how many groups it still needs, all draw that many prompts from the stream and each
  takes its share, so the stream stays one and the same on every rank);
* the scored groups are gathered (token ids, masks, rewards: kilobytes), so every rank holds the whole batch; the
  advantages, the metrics and the minibatch shuffle are the single-process ones;
* in every minibatch rank ``r`` trains the ``r``-th contiguous slice of its rows. The loss denominators (tokens,
  sequences) are those of the whole minibatch, which every rank knows; FSDP averages the gradients over ranks, so
  each rank's loss is scaled by ``W`` (DDP sums them: no scale): the gradient is the single-process one (verl #5625
  is what happens otherwise);
* each rank's new log-probs are gathered, so the diagnostics and the metrics are computed over the whole minibatch
  as one process would, and reduced once a step.

The package, from the bottom up: :mod:`~gspo.parallel.comm` (the collectives; one process calls none of them, every
function there is the identity then), :mod:`~gspo.parallel.plan` (which rows process ``r`` trains),
:mod:`~gspo.parallel.ddp` and :mod:`~gspo.parallel.fsdp` (the two ways to hold a policy over processes),
:mod:`~gspo.parallel.holding` (a :class:`Holding`: how this process holds the policy, whatever the way) and
:mod:`~gspo.parallel.strategy` (which holding a run gets, and the layouts the processes cannot share).
"""
