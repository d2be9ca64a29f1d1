"""A run's sub-batches across epoch boundaries (``train/build/inputs.py``): the next epoch's loader starts
before the current one drains, and the samples, their order and their augmentation are what a
loader per epoch, each started at its boundary, gives (indexed, position and shard splits); a
resume mid-epoch continues the same sequence."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
from multiprocessing import forkserver

import numpy as np
import pytest
import torch

from megabatch.data import TrainData
from megabatch.data.gpu_decode import DecodePool
from megabatch.data.shard_writer import Sample, encode_png, write_shards
from megabatch.data.worker_start import PickledOnce
from megabatch.runtime.signals import process_alive
from megabatch.train.build.inputs import EPOCH_LEAD_STEPS, RunInputs
from megabatch.train.step.plan import BatchPlan

from ..helpers import compose, preprocess

SHARDS, PER_SHARD, BATCH, SUB_BATCH = 6, 10, 12, 4


@pytest.fixture(scope="module")
def shard_urls(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    samples = [Sample(encode_png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)), "png", f"sample {i}")
               for i in range(SHARDS * PER_SHARD)]
    write_shards(samples, folder, "s", per_shard=PER_SHARD)
    return [str(folder / f"s-{{000000..{SHARDS - 1:06d}}}.tar")]


def make_data(urls, tmp_path, split: str) -> TrainData:
    cfg = compose("data=webdataset", f"data.train.split={split}", "data.num_workers=2",
                  "data.train.shuffle_buffer=7")
    cfg.data.train.urls, cfg.data.cache_dir = urls, str(tmp_path / "cache")
    ids = lambda captions: torch.tensor([int(c.split()[-1]) for c in captions])  # noqa: E731
    return TrainData(cfg.data, ids, preprocess(8), seed=cfg.seed)


def make_plan(data: TrainData, epochs: int, extra_steps: int) -> BatchPlan:
    steps = data.steps_per_epoch(BATCH, 1, SUB_BATCH)
    return BatchPlan(BATCH, 1, BATCH, SUB_BATCH, steps, epochs * steps + extra_steps)


def per_epoch_loaders(data: TrainData, plan: BatchPlan, start_step: int) -> list:
    """What a loader per epoch, each started when the one before has drained, gives from ``start_step``."""
    subs, epoch, start = [], *divmod(start_step, plan.steps_per_epoch)
    while epoch * plan.steps_per_epoch + start < plan.total_steps:
        steps = min(plan.steps_per_epoch - start, plan.total_steps - epoch * plan.steps_per_epoch - start)
        loader = iter(data.loader(epoch, start, BATCH, 0, 1, plan.steps_per_epoch, sub_batch=SUB_BATCH))
        subs += [next(loader) for _ in range(steps * plan.sub_batches)]
        del loader
        epoch, start = epoch + 1, 0
    return subs


@pytest.mark.parametrize("split", ["indexed", "position", "shard"])
def test_the_next_epochs_loader_starts_before_the_boundary_and_the_order_is_unchanged(shard_urls, tmp_path, split):
    data = make_data(shard_urls, tmp_path, split)
    plan = make_plan(data, epochs=2, extra_steps=1)  # three epochs begun, the last one step long
    assert plan.steps_per_epoch >= EPOCH_LEAD_STEPS + 1
    inputs = RunInputs(data, plan, rank=0)
    started_after = {}  # (epoch, step) -> sub-batches taken when that loader started
    taken, stream = [], inputs(0)
    for _ in range(plan.total_steps * plan.sub_batches):
        taken.append(next(stream))
        for key in inputs.loaders_started:
            started_after.setdefault(key, len(taken))
    stream.close()  # the run ends: the last epoch's loader stops with it
    epoch_subs = plan.steps_per_epoch * plan.sub_batches
    # each later epoch's loader started when the last EPOCH_LEAD_STEPS steps of the one before began
    assert started_after == {(0, 0): 1, (1, 0): epoch_subs - EPOCH_LEAD_STEPS * plan.sub_batches + 1,
                             (2, 0): 2 * epoch_subs - EPOCH_LEAD_STEPS * plan.sub_batches + 1}
    expected = per_epoch_loaders(data, plan, 0)
    assert [sub.texts.tolist() for sub in taken] == [sub.texts.tolist() for sub in expected]
    assert all(torch.equal(a.images, b.images) for a, b in zip(taken, expected, strict=True))
    # every sample once per epoch (the shard split: per loader worker's shards, within its quota)
    first = torch.cat([sub.texts for sub in taken[:epoch_subs]]).tolist()
    assert len(set(first)) == len(first)


@pytest.mark.parametrize("split", ["indexed", "shard"])
def test_a_resume_mid_epoch_continues_across_the_boundary(shard_urls, tmp_path, split):
    data = make_data(shard_urls, tmp_path, split)
    plan = make_plan(data, epochs=1, extra_steps=2)
    start = plan.steps_per_epoch - 1  # the last step of the first epoch
    inputs = RunInputs(data, plan, rank=0)
    stream = inputs(start)
    taken = [next(stream) for _ in range((plan.total_steps - start) * plan.sub_batches)]
    stream.close()
    assert inputs.loaders_started == [(0, start), (1, 0)]
    expected = per_epoch_loaders(data, plan, start)
    assert [sub.texts.tolist() for sub in taken] == [sub.texts.tolist() for sub in expected]
    assert all(torch.equal(a.images, b.images) for a, b in zip(taken, expected, strict=True))


def test_starting_a_loader_leaves_the_training_randomness_alone(shard_urls, tmp_path):
    """The towers draw dropout from the global generator; a loader started earlier or later must not
    move it (the loader's workers take their base seed from its own generator)."""
    data = make_data(shard_urls, tmp_path, "indexed")
    torch.manual_seed(7)
    before = torch.get_rng_state()
    loader = iter(data.loader(0, 0, BATCH, 0, 1, 2, sub_batch=SUB_BATCH))
    next(loader)
    assert torch.equal(torch.get_rng_state(), before)


class RecordingDecoder:
    """``data.decode=gpu``'s decoder as ``RunInputs`` uses it, on the CPU: its pool's threads run
    ``sub_batch``, which records what it decoded and returns the sub-batch as it came."""

    def __init__(self):
        self.pool, self.decoded, self.corrupt_image = DecodePool(torch.device("cpu")), [], 0

    def sub_batch(self, sub):
        self.decoded.append(sub.texts.tolist())
        return sub


def test_decoding_ahead_crosses_the_boundary_and_loaders_start_in_the_consumers_thread(shard_urls, tmp_path):
    """The next epoch's first sub-batch is decoded before the step at the boundary asks for it (one
    decoding stream across epochs, fed by a thread), the loaders still start in the consumer's thread,
    and the order is a loader per epoch's."""
    data = make_data(shard_urls, tmp_path, "indexed")
    plan = make_plan(data, epochs=1, extra_steps=2)
    started_in = []
    make_loader = data.loader

    def loader(*args, **kwargs):
        started_in.append(threading.current_thread())
        return make_loader(*args, **kwargs)

    data.loader = loader
    decoder = RecordingDecoder()
    inputs = RunInputs(data, plan, rank=0, gpu_decoder=decoder, decode_ahead_bytes=float("inf"))
    epoch_subs = plan.steps_per_epoch * plan.sub_batches
    stream = inputs(0)
    taken = [next(stream) for _ in range(epoch_subs)]  # the first epoch, to its last sub-batch
    deadline = time.monotonic() + 20
    while len(decoder.decoded) <= epoch_subs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(decoder.decoded) > epoch_subs, "the next epoch's first sub-batch was not decoded ahead"
    taken += [next(stream) for _ in range((plan.total_steps - plan.steps_per_epoch) * plan.sub_batches)]
    stream.close()
    assert started_in == [threading.main_thread()] * 2 and inputs.loaders_started == [(0, 0), (1, 0)]
    expected = per_epoch_loaders(data, plan, 0)
    assert [sub.texts.tolist() for sub in taken] == [sub.texts.tolist() for sub in expected]
    assert decoder.decoded[:len(taken)] == [sub.texts.tolist() for sub in expected]


def caption_ids(captions) -> torch.Tensor:
    """The shards' captions ("sample 7") as ids: a module's function, which a fork server's worker unpickles."""
    return torch.tensor([int(c.split()[-1]) for c in captions])


@pytest.mark.parametrize("split", ["position", "shard"])
def test_every_splits_loader_pickled_once_as_a_fork_server_sends_it_gives_the_same_sub_batches(shard_urls, tmp_path,
                                                                                               split):
    """A fork server's worker gets its dataset pickled, the tokenizer's part pickled once for all
    (``PickledOnce``): unpickled, each split's dataset reads what the original does (the indexed
    split through the fork server itself, below)."""
    data = make_data(shard_urls, tmp_path, split)
    data.tokenize = PickledOnce(caption_ids)
    dataset = data.loader(1, 0, BATCH, 0, 1, data.steps_per_epoch(BATCH, 1, SUB_BATCH), sub_batch=SUB_BATCH).dataset
    copies = [pickle.loads(pickle.dumps(dataset)) for _ in range(2)]
    assert data.tokenize._pickled is not None and copies[0].tokenize is not data.tokenize
    original, *copied = ([(sub.texts.tolist(), sub.images) for sub in ds] for ds in [dataset, *copies])
    for again in copied:
        assert [texts for texts, _ in again] == [texts for texts, _ in original]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(again, original, strict=True))


@pytest.mark.slow  # 34 s on 2 cores: make test-all
def test_workers_from_the_fork_server_give_the_forked_workers_samples_through_a_stop_signal(shard_urls, tmp_path):
    """data.worker_start=forkserver (worker_start.py): across two boundaries the same sub-batches as
    forked workers; a SIGTERM to the server and the workers (a job's signal reaches every process)
    ends neither, since the training process is the one that stops the run."""
    data = make_data(shard_urls, tmp_path, "indexed")
    data.tokenize = caption_ids
    plan = make_plan(data, epochs=2, extra_steps=1)
    expected = per_epoch_loaders(data, plan, 0)  # forked workers
    # this process's fork server is the loaders' own (the multi-rank helpers start one with other modules)
    forkserver._forkserver._stop()
    try:
        loaders_from_the_fork_server(data, plan, expected)
    finally:
        forkserver._forkserver._stop()  # the next test's helpers start theirs


def loaders_from_the_fork_server(data: TrainData, plan: BatchPlan, expected: list) -> None:
    data.worker_start = "forkserver"
    inputs = RunInputs(data, plan, rank=0)
    threads = []
    start = inputs._loader
    inputs._loader = lambda *args: threads.append(threading.current_thread()) or start(*args)
    stream = inputs(0)
    taken = [next(stream)]
    server = forkserver._forkserver._forkserver_pid  # started by the first loader
    workers = [child.pid for child in multiprocessing.active_children()]
    assert server is not None and process_alive(server)
    for pid in [server, *workers]:
        if process_alive(pid):
            os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    assert process_alive(server)
    taken += [next(stream) for _ in range(plan.total_steps * plan.sub_batches - 1)]
    stream.close()
    assert [sub.texts.tolist() for sub in taken] == [sub.texts.tolist() for sub in expected]
    assert all(torch.equal(a.images, b.images) for a, b in zip(taken, expected, strict=True))
    # every loader from a thread of its own: the first beside the compile, the next epochs' beside the steps
    assert inputs.loaders_started == [(0, 0), (1, 0), (2, 0)]
    assert all(t is not threading.main_thread() for t in threads)


class Sub:
    """A loader's sub-batch as ``RunInputs`` reads it (no worker counts)."""

    stats = None

    def __init__(self, step: int):
        self.step = step


@pytest.mark.parametrize("resume_at", [0, 1])
def test_with_the_fork_server_the_first_loader_starts_beside_the_callers_work(shard_urls, tmp_path, resume_at):
    """data.worker_start=forkserver: the first epoch's loader starts from a thread of its own, so the caller's work
    before its first sub-batch (the towers' compile or compiled-graph load) overlaps the workers' start; the
    sub-batches and the loaders' (epoch, step) are what they were, from the start and from a resumed step."""
    data = make_data(shard_urls, tmp_path, "indexed")
    data.worker_start = "forkserver"
    plan = make_plan(data, epochs=1, extra_steps=1)
    inputs = RunInputs(data, plan, rank=0)
    started_in, release = [], threading.Event()

    def loader(epoch, start):  # stands in for the workers' start (no processes here)
        started_in.append(threading.current_thread())
        release.wait(10)
        inputs.loaders_started.append((epoch, start))
        return iter([Sub(epoch * plan.steps_per_epoch + step) for step in range(start, plan.steps_per_epoch)
                     for _ in range(plan.sub_batches)])

    inputs._loader = loader
    stream = inputs(resume_at)  # returns while the loader is still starting
    assert inputs.loaders_started == []
    release.set()
    taken = [next(stream).step for _ in range((plan.total_steps - resume_at) * plan.sub_batches)]
    stream.close()
    assert taken == [step for step in range(resume_at, plan.total_steps) for _ in range(plan.sub_batches)]
    assert inputs.loaders_started == [(0, resume_at), (1, 0)]
    assert all(thread is not threading.main_thread() for thread in started_in)


def test_a_loader_that_fails_to_start_in_its_thread_raises_where_the_sub_batches_are_taken(shard_urls, tmp_path):
    """The error of a loader started from a thread (a shard list gone, a worker that cannot start) reaches the
    step that takes the sub-batches, with its own message, instead of the step waiting for a loader forever."""
    data = make_data(shard_urls, tmp_path, "indexed")
    data.worker_start = "forkserver"
    inputs = RunInputs(data, make_plan(data, epochs=1, extra_steps=1), rank=0)

    def loader(epoch, start):
        raise OSError(f"epoch {epoch}'s shards cannot be opened")

    inputs._loader = loader
    stream = inputs(0)
    with pytest.raises(OSError, match="epoch 0's shards cannot be opened"):
        next(stream)
