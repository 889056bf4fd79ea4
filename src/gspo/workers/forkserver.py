"""Imported by the user-code workers' fork server, as its first preload, and by nothing else.

A SIGTERM sent to the whole process group (how Slurm and systemd stop a job) would kill the fork server, and the
workers exit with their parent: the rewards of the batch being scored would become NaN and the batch the trainer
finishes before it checkpoints would be trained on those holes. Stopping is the trainer's decision, so the server
ignores SIGTERM (multiprocessing already makes it ignore SIGINT); it still exits when the trainer goes away.
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

from gspo.workers import child  # noqa: E402,F401  (what every worker runs, imported once here)
