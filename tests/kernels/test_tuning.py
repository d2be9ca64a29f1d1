"""Kernel tuning once per host: the ranks of a run ask for the same untuned tile config at once; one
process tunes (a counted call), the others wait for it and read its result from the cache file."""

from __future__ import annotations

import json
import multiprocessing
import time

from megabatch.kernels.triton_tiles import tuned_once

CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def rank(cache, calls, go, results, index) -> None:
    def tune_now():
        with open(calls, "a") as out:
            out.write("tuned\n")
        time.sleep(0.5)  # the others arrive while it tunes
        return CONFIG

    go.wait()
    results.put((index, tuned_once("Some GPU", "grad/bfloat16/native/c1024", tune_now, path=cache)))


def test_two_ranks_on_one_host_tune_once_and_both_get_its_config(tmp_path):
    cache, calls = tmp_path / "triton_tuned.json", tmp_path / "calls"
    context = multiprocessing.get_context("fork")
    go, results = context.Event(), context.Queue()
    ranks = [context.Process(target=rank, args=(cache, calls, go, results, index)) for index in range(2)]
    for process in ranks:
        process.start()
    go.set()
    got = dict(results.get(timeout=60) for _ in ranks)
    for process in ranks:
        process.join(30)
        assert process.exitcode == 0
    assert calls.read_text().splitlines() == ["tuned"]
    assert got == {0: CONFIG, 1: CONFIG}
    assert json.loads(cache.read_text()) == {"Some GPU": {"grad/bfloat16/native/c1024": CONFIG}}
    # a later run reads it and tunes nothing
    assert tuned_once("Some GPU", "grad/bfloat16/native/c1024", lambda: 1 / 0, path=cache) == CONFIG


def test_a_cache_file_cut_short_is_tuned_again_and_written_whole(tmp_path):
    cache = tmp_path / "triton_tuned.json"
    cache.write_text('{"Some GPU": {"grad/bf')
    assert tuned_once("Some GPU", "stats/bfloat16/native/c512", lambda: CONFIG, path=cache) == CONFIG
    assert json.loads(cache.read_text()) == {"Some GPU": {"stats/bfloat16/native/c512": CONFIG}}


def test_a_small_block_takes_the_default_tiles_and_a_large_one_is_tuned(monkeypatch, tmp_path):
    """No tuning (tens of seconds on a cold GPU) for a block whose loss takes milliseconds: a GPU's small batch, a
    GPU test. A table's entry is used at any size; MEGABATCH_AUTOTUNE=0 never tunes."""
    import types

    import torch

    from megabatch.kernels import triton_tiles

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MEGABATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Untuned GPU 7")
    tuned = []
    monkeypatch.setattr(triton_tiles, "tuned_once", lambda gpu, key, tune_now: tuned.append(key) or CONFIG)

    def rows(m):
        return types.SimpleNamespace(is_cuda=True, shape=(m, 512), dtype=torch.bfloat16, device="cuda:0")

    side = int(triton_tiles.TUNE_MIN_LOGITS ** 0.5)
    default = triton_tiles.default_config(torch.bfloat16)
    assert triton_tiles.get_config("stats", rows(side // 2), "tf32", cols=side // 2) == default
    assert triton_tiles.get_config("grad", rows(4 * side), "tf32", cols=side // 8) == default  # rows x cols counts
    assert tuned == []
    assert triton_tiles.get_config("grad", rows(side), "tf32", cols=side) == CONFIG
    assert triton_tiles.get_config("stats", rows(2 * side), "tf32") == CONFIG  # cols not given: square
    assert tuned == ["grad/bfloat16/native/c512", "stats/bfloat16/native/c512"]
    monkeypatch.setenv("MEGABATCH_AUTOTUNE", "0")
    assert triton_tiles.get_config("sigmoid", rows(2 * side), "tf32", cols=2 * side) == default
    # a known key (here: what this host tuned, now in the table) is used at any size
    assert triton_tiles.get_config("grad", rows(16), "tf32", cols=16) == CONFIG
    assert len(tuned) == 2


def test_tune_kernels_missing_tunes_only_what_the_table_lacks(tmp_path):
    """scripts/tune_kernels.py --missing: the keys the committed table lacks for this GPU, each once (c = 768 and
    1024 share a key); without it every key asked for."""
    import importlib.util

    from ..helpers import ROOT

    spec = importlib.util.spec_from_file_location("tune_kernels", ROOT / "scripts" / "tune_kernels.py")
    tune_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_kernels)
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"Some GPU": {"stats/bfloat16/native/c512": CONFIG},
                                 "Other GPU": {"grad/bfloat16/native/c512": CONFIG}}))
    keys = [row[-1] for row in tune_kernels.to_tune("Some GPU", ["bf16"], [512, 768, 1024], ["stats", "grad"], True,
                                                    table)]
    assert keys == ["grad/bfloat16/native/c512", "stats/bfloat16/native/c1024", "grad/bfloat16/native/c1024"]
    every = tune_kernels.to_tune("Some GPU", ["bf16", "fp32"], [512], ["stats"], False, table)
    assert [row[-1] for row in every] == ["stats/bfloat16/native/c512", "stats/float32/tf32/c512"]
