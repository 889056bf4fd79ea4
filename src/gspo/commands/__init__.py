"""What the subcommands do beyond parsing their arguments: ``gspo compare`` (arms, scheduling), ``eval``, ``probe``,
``report``, ``export``, ``upcycle`` and the summary / eval tables. Only :mod:`gspo.cli` (and these modules among
themselves) import them: the training library never depends on a command.

Nothing is imported here, so ``gspo --help`` and a command that needs one module load only that one.
"""
