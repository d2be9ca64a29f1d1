"""This rank's sub-batches for a run: one loader per epoch, the next one started before the boundary,
read ahead, bad input counted."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Iterator

from ...data import TrainData
from ...data.gpu_decode import GpuDecoder, decode_ahead
from ...data.read_ahead import ReadAhead
from ...data.samples import SubBatch
from ...data.token_groups import TokenGroups
from ..step.plan import BatchPlan

log = logging.getLogger("megabatch")


def read_ahead_budget(prefetch_gb, offload: bool, gpu_decode: bool = False) -> float:
    """Bytes the loader may be read ahead into (``trainer.prefetch_gb``, checked at start-up).
    ``auto``: 8 GB; with data offload only where the images decode on the GPU (``data.decode=gpu``).
    There the next step's reading moves off the critical path (the 1M ViT-B/32 step on 4 H200s: 37.4 s
    against 44.3 s, ``docs/bench/multi_gpu_vit_b32_1m_readahead_pair_4xh200.json``); with the replay
    re-decoding on the CPU its workers already use the cores, and reading ahead added host memory and
    no speed (docs/performance.md)."""
    if prefetch_gb == "auto":
        return 8e9 if not offload or gpu_decode else 0.0
    return float(prefetch_gb) * 1e9


# steps before an epoch's end at which the next epoch's loader starts: worker start-up and the first
# sub-batches (about two steps of ViT-B/32 at 32k on 4 GPUs, where the boundary step took 3x the others).
# Forked from this large process, its workers cost the step that starts them 0.41-0.61 s (12-14 workers,
# ViT-B/32 at 32k on H200s), and a loader forked from another thread lost its workers (exit status 1, no
# traceback), so it starts in the consumer's thread; from the fork server (data.worker_start), from a thread
# of its own (RunInputs._start_loader)
EPOCH_LEAD_STEPS = 2
# from a thread of its own the start takes longer (it shares the interpreter with the step: ViT-B/32 at 32k on
# 4 H200s, the boundary waited 0.9-1.1 s with a lead of 2), so it begins a step earlier
THREADED_LEAD_STEPS = 3


class RunInputs:
    """``rank``'s sub-batches from a given step to the end of the run (``plan.sub_batches`` per
    step), across epochs. ``keep_raw``: the loader keeps each image's encoded bytes (offload);
    ``pin_memory``: page-locked tensors (CUDA); ``read_ahead_bytes``: a thread keeps taking
    sub-batches from the loader during the loss and the replay (``data/read_ahead.py``);
    ``gpu_decoder`` (``data.decode=gpu``): the workers leave JPEGs encoded and a thread decodes them
    on the GPU ahead of the step, within ``decode_ahead_bytes`` of GPU memory (``data/gpu_decode.py``):
    the images come out on the device. ``read_ahead_auto``: the read-ahead budget is
    ``trainer.prefetch_gb=auto``'s (for the log's reason where it is none)."""

    def __init__(self, data: TrainData, plan: BatchPlan, rank: int, *, keep_raw: bool = False,
                 pin_memory: bool = False, read_ahead_bytes: float = 0.0, gpu_decoder: GpuDecoder | None = None,
                 decode_ahead_bytes: float = 0.0, read_ahead_auto: bool = False):
        self.data, self.plan, self.rank = data, plan, rank
        self.keep_raw, self.pin_memory, self.read_ahead_bytes = keep_raw, pin_memory, read_ahead_bytes
        self.read_ahead_auto = read_ahead_auto  # the budget is trainer.prefetch_gb=auto's
        self.gpu_decoder, self.decode_ahead_bytes = gpu_decoder, decode_ahead_bytes
        self.worker_stats: dict = {}  # (epoch, worker) -> that loader worker's cumulative counts
        self.loaders_started: list[tuple[int, int]] = []  # (epoch, first step) of each loader, in order
        self._loaders: list[weakref.ref] = []  # the loaders started, for close (an error's traceback holds them)

    @property
    def reads_ahead(self) -> bool:
        """Whether a thread reads the loader ahead through the loss and the replay: with a budget,
        loader workers and steps that have a replay."""
        return self.read_ahead_bytes > 0 and int(self.data.cfg.num_workers) > 0 and self.plan.sub_batches > 1

    def describe_read_ahead(self) -> str:
        """The host memory the loader may be read ahead into, for the log."""
        if self.reads_ahead:
            return (f"the loader is read ahead through the loss and the replay into up to "
                    f"{self.read_ahead_bytes / 1e9:.1f} GB of host memory per rank (trainer.prefetch_gb)")
        why = (("trainer.prefetch_gb=auto: none with trainer.offload and CPU decoding" if self.read_ahead_auto
                else "trainer.prefetch_gb is 0")
               if self.read_ahead_bytes <= 0 else "no loader workers" if int(self.data.cfg.num_workers) <= 0
               else "one-pass steps: no replay to read behind")
        return f"the loader is not read ahead ({why})"

    def __call__(self, start_step: int) -> Iterator[SubBatch]:
        """The sub-batches from step ``start_step`` on. The first epoch's reading starts now (the
        loader's workers forked, the read-ahead and GPU decoding threads running), so that what the
        caller does before taking the first sub-batch (compiling the towers) overlaps it. With a token
        budget (``trainer.sub_batch_tokens``) a step of shorter images has its sub-batches joined (``TokenGroups``)."""
        sub_batches = self._sub_batches(start_step)
        next(sub_batches, None)  # up to the first epoch's start: its reading begins
        if self.plan.token_budget is not None and self.plan.sub_batches > 1:  # a step of shorter images: joined
            return TokenGroups(sub_batches, self.plan.sub_batches, self.plan.joined)
        return sub_batches

    def _loader(self, epoch: int, start: int):
        """Epoch ``epoch``'s loader from its step ``start``, started: its workers forked and reading."""
        plan = self.plan
        loader = iter(self.data.loader(epoch, start, plan.rank_batch, self.rank, plan.world_size,
                                       plan.steps_per_epoch, sub_batch=plan.sub_batch,
                                       keep_raw=self.keep_raw, pin_memory=self.pin_memory,
                                       gpu_decode=self.gpu_decoder is not None))
        self.loaders_started.append((epoch, start))
        self._loaders.append(weakref.ref(loader))
        return loader

    def close(self) -> None:
        """Stop every loader's workers now (a run that failed or stopped: the traceback of an error keeps
        the loaders alive, and their workers, which ignore the stop signals, with them)."""
        loaders, self._loaders = self._loaders, []
        for ref in loaders:
            loader = ref()
            shutdown = getattr(loader, "_shutdown_workers", None)  # torch's multi-process loader iterator
            if shutdown is not None:
                shutdown()

    def _sub_batches(self, start_step: int) -> Iterator[SubBatch]:
        """The sub-batches from ``start_step`` on, after a ``None`` once the first epoch is reading.
        The epochs come from one chain (``_epochs``), decoded ahead across the boundaries: the GPU
        decodes the next epoch's first sub-batches during this epoch's last step. Loaders start here,
        in the calling thread (a loader forked from another thread lost its workers), or from a thread
        of their own when their workers come from the fork server (``_start_loader``; the first one too,
        so that its start overlaps what the caller does before the first sub-batch: the towers' compile or
        compiled-graph load), and are handed to the chain, which may run in the decoding thread."""
        plan = self.plan
        epoch, start = divmod(start_step, plan.steps_per_epoch)
        if epoch * plan.steps_per_epoch + start >= plan.total_steps:
            return
        handoff: queue.Queue = queue.Queue()
        stop = threading.Event()
        starters: list[threading.Thread] = []
        if self.data.worker_start == "forkserver":  # handed to the chain when started
            first = None
            starters.append(self._start_loader(epoch, handoff, start))
        else:
            first = self._loader(epoch, start)
        chain = self._epochs(epoch, start, first, handoff, stop)
        source = chain
        if self.gpu_decoder is not None:
            gpu = self.gpu_decoder
            source = decode_ahead(chain, gpu.sub_batch, gpu.pool, depth=max(2, plan.sub_batches),
                                  budget_bytes=self.decode_ahead_bytes)
        # the next epoch's loader starts when this epoch's last EPOCH_LEAD_STEPS steps begin: its
        # workers fork and read while those steps run, and the first step of the next epoch does not
        # wait for them (a loader per epoch: the order is an epoch's own)
        lead = (THREADED_LEAD_STEPS if self.data.worker_start == "forkserver" else EPOCH_LEAD_STEPS) * plan.sub_batches
        left, handed = (plan.steps_per_epoch - start) * plan.sub_batches, False
        try:
            yield None  # __call__ takes this: the first epoch is reading
            for sub in source:
                left -= 1
                if not handed and left < lead and (epoch + 1) * plan.steps_per_epoch < plan.total_steps:
                    starter = self._start_loader(epoch + 1, handoff)
                    if starter is not None:
                        starters.append(starter)
                    handed = True
                yield sub
                if left == 0:
                    epoch, left, handed = epoch + 1, plan.steps_per_epoch * plan.sub_batches, False
        finally:
            stop.set()
            for starter in starters:
                starter.join()
            if source is not chain:
                source.close()  # stops the decoding thread
            else:
                chain.close()
            while not handoff.empty():  # a run stopped before the boundary: that loader's workers end with it
                handoff.get_nowait()

    def _start_loader(self, epoch: int, handoff: queue.Queue, start: int = 0) -> threading.Thread | None:
        """Start epoch ``epoch``'s loader (from its step ``start``) and hand it to the chain. Workers from the fork
        server (``data.worker_start``) start from a thread of their own, so that the step goes on meanwhile
        (12 workers: 0.31-0.34 s on a GPU rank); forked workers start in this thread (started from
        another one, they died). A loader that fails to start hands its error over: the chain raises it."""
        if self.data.worker_start != "forkserver":
            handoff.put(self._loader(epoch, start))
            return None

        def started() -> None:
            try:
                handoff.put(self._loader(epoch, start))
            except BaseException as error:  # raised where the sub-batches are taken, not lost with this thread
                handoff.put(error)

        starter = threading.Thread(target=started, daemon=True, name=f"loader-start-epoch-{epoch}")
        starter.start()
        return starter

    def _epochs(self, epoch: int, start: int, loader, handoff: queue.Queue,
                stop: threading.Event) -> Iterator[SubBatch]:
        """Each epoch's sub-batches in turn, from ``start`` of ``epoch`` to the run's end, each loader
        read ahead (``reads_ahead``); the next epoch's loader is taken from ``handoff`` once this one
        is drained (the first one too where ``loader`` is None). Runs in the consumer's thread or in the GPU
        decoding's feeding thread."""
        plan = self.plan
        while True:
            loader = self._handed(loader, handoff, stop)
            if loader is None:  # stopped while waiting
                return
            # workers keep decoding through the loss and the replay; only steps with a replay: a
            # one-sub-batch step has nothing to hide the reading behind, and the reading thread
            # then competes with the step for the host (docs/performance.md)
            ahead = ReadAhead(loader, self.read_ahead_bytes) if self.reads_ahead else None
            expected, taken = (plan.steps_per_epoch - start) * plan.sub_batches, 0
            try:
                for sub in ahead if ahead is not None else loader:
                    if sub.stats:
                        self.worker_stats[(epoch, sub.stats["worker"])] = sub.stats
                    taken += 1
                    if taken == expected:  # the epoch's last sub-batch: its counts are complete
                        self.log_epoch_bad_input(epoch)
                    yield sub
            finally:
                if ahead is not None:
                    ahead.close()
            epoch, start, loader = epoch + 1, 0, None  # the drained loader's workers end
            if epoch * plan.steps_per_epoch >= plan.total_steps:
                return
            if taken < expected:
                raise RuntimeError(f"the loader of epoch {epoch - 1} ended after {taken} of its {expected} "
                                   "sub-batches: the data changed while the run read it?")

    @staticmethod
    def _handed(loader, handoff: queue.Queue, stop: threading.Event):
        """``loader``, or the one ``handoff`` holds once it does (None if ``stop`` comes first); a loader's start
        that failed in its thread (``_start_loader``) is raised here."""
        while loader is None and not stop.is_set():
            try:
                loader = handoff.get(timeout=0.1)
            except queue.Empty:
                continue
        if isinstance(loader, BaseException):
            raise loader
        return loader

    def state_dict(self) -> dict:
        """What the data order of a run depends on beyond its step: the global batch and the loader
        slots (the sub-batches of a step are found from the step itself)."""
        return {"global_batch": self.plan.global_batch, "loader_slots": self.data.slots(self.plan.world_size),
                "world_size": self.plan.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Say (rank 0) whether the resumed run reads what the uninterrupted one would have."""
        if self.rank != 0:
            return
        batch, slots, ranks = state["global_batch"], state.get("loader_slots"), state.get("world_size")
        train, split, now = self.data.cfg.train, self.data.split, self.data.slots(self.plan.world_size)
        if int(batch) != self.plan.global_batch:
            log.warning("checkpoint trained with batch=%s, resuming with %s: the data order within the epoch "
                        "changes", batch, self.plan.global_batch)
        if split == "shard" and (train.mode == "resampled" or slots not in (None, now)):
            log.warning("data.train.split=shard deals the shards to ranks x loader workers = %d slots (%s before "
                        "this resume): the rest of the run reads %s. data.train.split=indexed reads the same "
                        "samples in the same order on any number of GPUs and workers", now,
                        slots or "unknown", "other shard draws" if train.mode == "resampled" else
                        "this epoch in another order, some samples twice and some not at all")
        elif ranks is not None and ranks != self.plan.world_size:
            log.info("resumed on %d ranks (%d before): the same samples in the same steps, each augmented as "
                     "before (data.train.split=%s); only the towers' random draws (dropout, patch dropout), "
                     "per rank, start from new seeds", self.plan.world_size, ranks, split)

    def bad_input_counts(self, epoch: int | None = None) -> dict[str, int]:
        """This rank's bad-input counts so far (summed over loader workers and epochs, or of ``epoch`` alone;
        a broken shard once per epoch however many workers met it; with ``data.decode=gpu`` also the images
        only the GPU found corrupt)."""
        totals: dict[str, int] = {}
        if self.gpu_decoder is not None and self.gpu_decoder.corrupt_image and epoch is None:
            totals["corrupt_image"] = self.gpu_decoder.corrupt_image
        broken: dict[int, set] = {}
        for (stats_epoch, _), stats in list(self.worker_stats.items()):  # written by the chain's thread
            if epoch is not None and stats_epoch != epoch:
                continue
            for kind, count in stats.items():
                if kind == "broken_urls":
                    broken.setdefault(stats_epoch, set()).update(count)
                elif kind != "worker":
                    totals[kind] = totals.get(kind, 0) + count
        if broken:  # each worker that met a broken shard counted it: the distinct shards of each epoch
            totals["broken_shard"] = sum(len(urls) for urls in broken.values())
        return totals

    def log_epoch_bad_input(self, epoch: int) -> None:
        """One line at an epoch's end with its bad-input counts on this rank (where there were any): the
        loader workers log only the first few of each kind."""
        bad = {kind: count for kind, count in self.bad_input_counts(epoch).items() if count}
        if bad:
            log.warning("epoch %d: bad input on rank %d: %s (docs/data.md)", epoch, self.rank,
                        ", ".join(f"{kind} {count}" for kind, count in bad.items()))
