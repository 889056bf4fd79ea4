"""A decode process (``rollout.decode_processes = k``, under torchrun): one of the job's last ``k`` processes, which
only samples. It builds the sampling side of a run (:func:`gspo.collect.sampler.build_sampler`), then follows trainer
0's orders (:mod:`gspo.feed.remote` has the conversation): a ``reset`` points it at a timeline, each ``weights`` order
loads a policy version (broadcast, or from a shared slot: :mod:`gspo.feed.transport`), and it collects every batch
that version samples under the fixed lag (:class:`gspo.feed.lag.Lag`) and sends it, until ``stop``.
"""
from __future__ import annotations

import dataclasses
import os
import time

import torch

from gspo.collect.sampler import build_sampler
from gspo.errors import UserError
from gspo.feed.lag import Lag
from gspo.feed.transport import map_shared, sizes, unpack
from gspo.parallel import comm
from gspo.parallel.roles import Roles, join


class Decoder:
    """A decode process: collects every batch whose version it has, in order, sends it (process 0 of them) and waits
    for the next order (see the module docstring)."""

    def __init__(self, cfg, roles: Roles, runtime):
        self.cfg, self.roles, self.runtime = cfg, roles, runtime
        self.engine, self.collector = build_sampler(cfg, runtime, roles.index)
        self.first = roles.index == 0
        self.slots: dict[int, list[torch.Tensor]] = {}  # rollout.decode_gpu = 'shared': the slots mapped so far

    def run(self) -> None:
        """Until trainer 0 says stop."""
        roles, c = self.roles, self.collector
        lag, j = Lag(0, 0, 0), 0
        engine_version: int | None = None
        try:
            while True:
                t0 = time.perf_counter()
                order = comm.send_from(None, 0, roles.link)
                waited, sync = time.perf_counter() - t0, 0.0
                if order[0] == "stop":
                    self.slots.clear()  # (unmapped before trainer 0, which owns them, frees them)
                    if self.first:
                        comm.send_from(("end",), roles.first_decoder, roles.batches)
                    return
                if order[0] == "reset":
                    _, v0, j, total, eta, saved = order
                    lag = Lag(eta, v0, total)
                    engine_version = None
                    if saved is not None:
                        self._restore(saved)
                    continue
                _, engine_version, meta, *where = order
                t1 = time.perf_counter()
                if where:
                    self._load_shared(engine_version, meta, *where)
                else:
                    flats = [torch.empty(n, dtype=d, device=self._weights_device()) for d, n in sizes(meta)]
                    for flat in flats:
                        torch.distributed.broadcast(flat, src=0, group=roles.weights)
                    self.engine.sync_weights(unpack(meta, flats))
                    del flats
                sync = time.perf_counter() - t1
                while j < lag.total and lag.version_of(j) == engine_version:
                    batch = c.collect()
                    own = c.state_dict()
                    generators = comm.gather_objects(own["generator"])  # every decode process's, in order
                    if self.first:
                        state = {"generators": generators, "data": own["data"],
                                 "skipped_prompts": own["skipped_prompts"]}
                        comm.send_from(("batch", j, engine_version, batch, state, waited, sync), roles.first_decoder,
                                       roles.batches)
                    waited = sync = 0.0
                    j += 1
        except BaseException as e:
            if self.first and not isinstance(e, comm.PeerLost):
                try:
                    comm.send_from(("error", str(e), isinstance(e, UserError)), roles.first_decoder, roles.batches)
                except Exception:  # noqa: BLE001 -- the trainers are gone too; the launcher names the cause
                    pass
            raise
        finally:
            c.close()

    def _load_shared(self, version: int, meta, slot: int, handles: list | None) -> None:
        """Version ``version`` from :class:`SharedWeights`' slot ``slot`` into the engine (mapping the slot first when
        ``handles`` come with it: this process's set), its stamp checked before and after."""
        if handles is not None:
            self.slots[slot] = map_shared(handles[self.roles.index])
        *flats, stamp = self.slots[slot]
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        before = int(stamp.item())
        self.engine.sync_weights(unpack(meta, flats))
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        after = int(stamp.item())
        if before != version or after != version:
            raise RuntimeError(f"shared weights slot {slot} held version {before} then {after} while this decode "
                               f"process loaded version {version}: trainer 0 wrote it too soon")

    def _weights_device(self) -> torch.device:
        return self.runtime.device if self.runtime.device.type == "cuda" else torch.device("cpu")

    def _restore(self, saved: dict) -> None:
        """The collect stage's state from the trainers' checkpoint (:meth:`RemoteCollector.load_state_dict`): this
        process's sampling stream when the same number of decode processes wrote it, else one seeded from (seed, step,
        index)."""
        c, index = self.collector, self.roles.index
        c.stream.load_state_dict(saved["data"])
        c.skipped_prompts = saved["skipped_prompts"]
        c.generator.set_state(saved["generators"][index])


def is_decoder(cfg) -> bool:
    """Whether this process of the job is one of ``rollout.decode_processes`` (the job's last processes)."""
    world, rank = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0)))
    return bool(cfg.rollout.decode_processes) and world > 1 and rank >= world - cfg.rollout.decode_processes


def run_decoder(cfg) -> None:
    """Run this process as a decode process until the trainers stop (the command line holds the stop signals: the
    first one is the trainers' to act on, which finish the batch, checkpoint and send stop)."""
    runtime, mine = join(cfg)
    runtime = dataclasses.replace(runtime, rank=mine.index, world_size=mine.decoders)
    Decoder(cfg, mine, runtime).run()
