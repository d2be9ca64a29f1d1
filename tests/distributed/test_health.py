"""Which rank went: heartbeats in a store (``distributed/health.py``), with an in-process store
standing in for torchrun's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch.distributed as dist

from megabatch.distributed.health import FAILED, PeerWatch


def test_a_silent_rank_and_a_failed_one_are_named_a_finished_one_is_not():
    store = dist.HashStore()
    watch = PeerWatch(store, rank=0, world_size=4, silence_s=60, beat_s=0.1).start()
    store.add("beat/1", 1)  # rank 1 beat once, then nothing (killed)
    store.set("ended/2", f"{FAILED}: OutOfMemoryError: CUDA out of memory")  # rank 2 failed
    store.set("ended/3", "finished")
    try:
        assert watch.lost_peers() == {2: f"{FAILED}: OutOfMemoryError: CUDA out of memory"}  # a failure first
        store.delete_key("ended/2")
        for _ in range(10):  # rank 2 alive and beating from here on
            store.add("beat/2", 1)
            lost = watch.lost_peers(wait_s=0.05)
        deadline = time.monotonic() + 2
        while 1 not in lost and time.monotonic() < deadline:
            store.add("beat/2", 1)
            lost = watch.lost_peers(wait_s=0.3)
        assert set(lost) == {1} and "no heartbeat" in lost[1]
    finally:
        watch.end()
    assert store.get("ended/0") == b"finished"


def test_a_rank_blocked_behind_a_silent_peer_ends_itself_naming_it():
    """NCCL would wait for the collective's timeout: the watch ends the process first."""
    script = textwrap.dedent("""
        import logging, sys, time
        import torch.distributed as dist
        from megabatch.distributed.health import PeerWatch
        logging.basicConfig(stream=sys.stdout, level=logging.INFO)
        PeerWatch(dist.HashStore(), rank=0, world_size=2, silence_s=1.0, beat_s=0.2).start()
        time.sleep(60)  # blocked in a collective that never returns
        print("not stopped")
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1 is gone: no heartbeat" in result.stdout + result.stderr
    assert time.monotonic() - started < 30 and "not stopped" not in result.stdout
