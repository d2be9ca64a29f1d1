"""Kernel tuning once per host: the ranks of a run ask for the same untuned tile config at once; one
process tunes (a counted call), the others wait for it and read its result from the cache file."""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch

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
    monkeypatch.setattr(triton_tiles, "device_record", lambda device: {"capability": "7.5", "sms": 40})  # no sibling
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


def test_a_gpu_missing_a_key_takes_a_shipped_gpu_of_the_same_sms_and_else_tunes(monkeypatch, tmp_path, caplog):
    """A GPU whose own table lacks a key (here one the table does not name at all) takes the key's config from a
    GPU that ``tuned.json`` records with the same compute capability and SM count, the first by name, and tunes
    nothing; a GPU of another SM count tunes. The record is made only where another GPU has the key."""
    import logging
    import types

    import torch

    from megabatch.kernels import triton_tiles

    table = tmp_path / "tuned.json"
    big = {"capability": "9.0", "sms": 132}
    other = {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    for gpu, config in (("B GPU", CONFIG), ("A GPU", other)):
        triton_tiles.save_config(gpu, "grad/bfloat16/native/c512", config, table, big)
    triton_tiles.save_config("C GPU", "stats/bfloat16/native/c512", CONFIG, table, {"capability": "9.0", "sms": 114})
    assert json.loads(table.read_text())[triton_tiles.DEVICES] == {"A GPU": big, "B GPU": big,
                                                                   "C GPU": {"capability": "9.0", "sms": 114}}
    monkeypatch.setattr(triton_tiles, "TUNED_FILE", table)
    monkeypatch.setattr(triton_tiles, "_shipped", lambda: json.loads(table.read_text()))
    triton_tiles._load_tables.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MEGABATCH_CACHE", str(tmp_path / "host"))
    tuned, made = [], []
    monkeypatch.setattr(triton_tiles, "tuned_once", lambda gpu, key, tune_now: tuned.append((gpu, key)) or CONFIG)
    record = {"New GPU": big, "Small GPU": {"capability": "9.0", "sms": 114}}
    name = {"value": "New GPU"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["value"])
    monkeypatch.setattr(triton_tiles, "device_record", lambda device: made.append(1) or record[name["value"]])
    rows = types.SimpleNamespace(is_cuda=True, shape=(16384, 512), dtype=torch.bfloat16, device="cuda:0")
    try:
        with caplog.at_level(logging.INFO, logger=triton_tiles.__name__):
            assert triton_tiles.get_config("grad", rows, "tf32") == other  # A GPU's: the first by name
        assert tuned == []
        assert "A GPU's shipped tiles" in caplog.text
        assert triton_tiles.get_config("stats", rows, "tf32") == CONFIG  # C GPU has it, with 114 SMs: tuned
        assert tuned == [("New GPU", "stats/bfloat16/native/c512")]
        assert triton_tiles.get_config("sigmoid", rows, "tf32") == CONFIG  # no GPU has it: tuned, no record made
        assert len(made) == 2
        half = types.SimpleNamespace(is_cuda=True, shape=(16384, 512), dtype=torch.float16, device="cuda:0")
        assert triton_tiles.get_config("grad", half, "tf32") == other  # fp16 takes bf16's tiles, a sibling's too
        assert len(tuned) == 2
        name["value"] = "Small GPU"
        assert triton_tiles.get_config("stats", rows, "tf32") == CONFIG  # C GPU's (its own tuning not called)
        assert triton_tiles.get_config("grad", rows, "tf32") == CONFIG  # 132 SMs' only: tuned
        assert tuned[1:] == [("New GPU", "sigmoid/bfloat16/native/c512"), ("Small GPU", "grad/bfloat16/native/c512")]
        assert len(tuned) == 3
    finally:
        triton_tiles._load_tables.cache_clear()


def test_every_gpu_in_the_shipped_table_has_its_device_record():
    """tuned.json names each GPU's compute capability and SM count, which is what lets another GPU take its tiles."""
    from megabatch.kernels import triton_tiles

    shipped = json.loads(triton_tiles.TUNED_FILE.read_text())
    records = shipped.pop(triton_tiles.DEVICES)
    assert set(records) == set(shipped)
    for record in records.values():
        assert set(record) == {"capability", "sms"} and isinstance(record["sms"], int)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels in the interpreter, on CPU tensors (a GPU raises "
                    "OutOfResources itself)")
def test_a_config_that_does_not_fit_the_gpu_is_tuned_again_and_the_kernel_runs(monkeypatch, tmp_path, caplog):
    """A shipped config that no longer fits the GPU (seen on an H200: grad fp32 c512's tiles, tuned before the kernels
    moved to TMA, asked 311 KB of shared memory of 227 KB): the kernel's first launch raises ``OutOfResources``
    before it writes anything; the key is tuned again (here: a small block, so the default tiles), the warning names
    it, and the call returns the gradients it would have. The kernels run in the interpreter, the first launch at the
    bad tiles made to fail as the GPU's does."""
    import logging

    import torch
    import triton

    from megabatch.kernels import triton_tiles

    monkeypatch.setenv("MEGABATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    bad = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4}
    monkeypatch.setattr(triton_tiles, "get_config", lambda *args, **kwargs: bad)
    launches, real = [], triton_tiles._grad_launch

    def launch(rows, cols, scale, row_lse, col_lse, diagonal, precision, config, *rest):
        launches.append(config)
        if config == bad:
            raise triton.runtime.errors.OutOfResources(311352, 232448, "shared memory")
        return real(rows, cols, scale, row_lse, col_lse, diagonal, precision, triton_tiles.INTERPRET_CONFIG, *rest)

    monkeypatch.setattr(triton_tiles, "_grad_launch", launch)
    torch.manual_seed(0)
    rows = torch.nn.functional.normalize(torch.randn(32, 16), dim=-1)
    cols = torch.nn.functional.normalize(torch.randn(32, 16), dim=-1)
    scale, weight = torch.tensor(5.0), torch.tensor(1 / 64)
    lse = triton_tiles.block_stats(rows, cols, scale, config=triton_tiles.INTERPRET_CONFIG)
    expected = real(rows, cols, scale, *lse, True, "tf32", triton_tiles.INTERPRET_CONFIG, weight,
                    torch.zeros_like(rows), torch.zeros_like(cols), None, (rows, cols))
    triton_tiles._load_tables.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=triton_tiles.__name__):
            d_rows, d_cols, d_scale = triton_tiles.block_grads(rows, cols, scale, *lse, weight, True)
    finally:
        triton_tiles._load_tables.cache_clear()
    assert launches == [bad, triton_tiles.default_config(torch.float32)]
    assert "grad/float32/tf32/c64 on Some GPU: the tiles" in caplog.text and "do not fit this GPU" in caplog.text
    assert torch.equal(d_scale, expected * weight)
    reference = triton_tiles.block_grads(rows, cols, scale, *lse, weight, True, config=triton_tiles.INTERPRET_CONFIG)
    assert torch.equal(d_rows, reference[0]) and torch.equal(d_cols, reference[1])


def test_a_stale_cached_config_is_tuned_again_and_replaced(tmp_path):
    cache = tmp_path / "tuned.json"
    stale = {**CONFIG, "BLOCK_N": 256}
    triton_tiles_key = "grad/float32/tf32/c512"
    assert tuned_once("Some GPU", triton_tiles_key, lambda: stale, path=cache) == stale
    assert tuned_once("Some GPU", triton_tiles_key, lambda: CONFIG, path=cache) == stale  # cached: not tuned
    assert tuned_once("Some GPU", triton_tiles_key, lambda: CONFIG, path=cache, stale=stale) == CONFIG
    assert json.loads(cache.read_text())["Some GPU"][triton_tiles_key] == CONFIG


def test_tune_kernels_check_retunes_what_does_not_fit_and_drops_it_from_same_sm_gpus(monkeypatch, tmp_path):
    """scripts/tune_kernels.py --check: the configs this GPU takes (its own, and a same-SM GPU's for keys it lacks)
    launched once each; those that do not fit are tuned again, and with --merge a same-SM GPU's identical config is
    dropped (it then takes the new one); another SM count's is kept."""
    import importlib.util

    import torch

    from megabatch.kernels import triton_tiles

    from ..helpers import ROOT

    spec = importlib.util.spec_from_file_location("tune_kernels", ROOT / "scripts" / "tune_kernels.py")
    tune_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_kernels)
    big, small = {"capability": "9.0", "sms": 132}, {"capability": "9.0", "sms": 114}
    bad = {**CONFIG, "BLOCK_N": 256}
    table = tmp_path / "tuned.json"
    triton_tiles.save_config("H200", "grad/float32/tf32/c512", bad, table, big)
    triton_tiles.save_config("H200", "stats/bfloat16/native/c1024", CONFIG, table, big)
    triton_tiles.save_config("H100", "grad/float32/tf32/c512", bad, table, big)
    triton_tiles.save_config("H100", "sigmoid/float32/tf32/c512", bad, table, big)
    triton_tiles.save_config("H20", "grad/float32/tf32/c512", bad, table, small)
    assert tune_kernels.taken_configs("H200", big, table) == {
        "grad/float32/tf32/c512": bad, "stats/bfloat16/native/c1024": CONFIG, "sigmoid/float32/tf32/c512": bad}
    assert tune_kernels.parse_key("stats/bfloat16/native/c1024") == ("stats", torch.bfloat16, 768, "tf32")
    assert tune_kernels.parse_key("grad/float32/ieee/c512") == ("grad", torch.float32, 512, "ieee")
    monkeypatch.setattr(tune_kernels, "taken_configs", lambda gpu, record: {"grad/float32/tf32/c512": bad,
                                                                            "stats/bfloat16/native/c1024": CONFIG})
    monkeypatch.setattr(triton_tiles, "fits", lambda kernel, dtype, c, precision, config, device: config != bad)
    todo, stale = tune_kernels.misfits("H200", big, "cuda")
    assert [row[-1] for row in todo] == ["grad/float32/tf32/c512"] and stale == {"grad/float32/tf32/c512": bad}
    triton_tiles.save_config("H200", "grad/float32/tf32/c512", CONFIG, table, big)  # what --merge writes, then
    tune_kernels.drop_siblings("grad/float32/tf32/c512", bad, big, table)
    data = json.loads(table.read_text())
    assert data["H200"]["grad/float32/tf32/c512"] == CONFIG and "grad/float32/tf32/c512" not in data["H100"]
    assert data["H100"]["sigmoid/float32/tf32/c512"] == bad and data["H20"]["grad/float32/tf32/c512"] == bad


def test_tune_kernels_times_each_candidate_by_its_median_and_writes_the_timings(monkeypatch, tmp_path):
    """scripts/tune_kernels.py --timings: ``triton_tiles.tune`` times every candidate by the median of its launches
    (``do_bench``'s ``return_mode``), picks the fastest, and records each one, a candidate that does not fit the GPU
    with why; the script writes those rows and the picks with the run's meta, after every key."""
    import importlib.util
    import sys

    import triton.testing

    from megabatch.kernels import triton_tiles

    from ..helpers import ROOT

    spec = importlib.util.spec_from_file_location("tune_kernels", ROOT / "scripts" / "tune_kernels.py")
    tune_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_kernels)
    slow, fast, too_big = ({**CONFIG, "BLOCK_M": m} for m in (128, 64, 256))
    times = {128: 2.0, 64: 1.5}
    asked = []

    def do_bench(fn, warmup, rep, return_mode):
        asked.append(return_mode)
        config = fn.args[0]
        if config["BLOCK_M"] == 256:
            raise triton_tiles.triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        return times[config["BLOCK_M"]]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(triton_tiles, "_launcher", lambda *args: lambda config: None)
    monkeypatch.setattr(triton_tiles, "candidate_configs", lambda dtype: [slow, fast, too_big])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(triton_tiles, "device_record", lambda device: {"capability": "9.0", "sms": 132})
    timings = tmp_path / "timings.json"
    monkeypatch.setattr(sys, "argv", ["tune_kernels.py", "--dims", "512,768", "--dtypes", "bf16", "--kernels",
                                      "sigmoid", "--size", "24576", "--out", str(tmp_path / "tuned.json"),
                                      "--timings", str(timings)])
    tune_kernels.main()
    written = json.loads(timings.read_text())
    keys = ["sigmoid/bfloat16/native/c512", "sigmoid/bfloat16/native/c1024"]
    assert set(asked) == {"median"} and len(asked) == 6
    assert written["meta"]["picks"] == {key: fast for key in keys}
    assert [(row["key"], row["dim"], row["size"], row["config"]["BLOCK_M"], row.get("ms"), row.get("skipped"))
            for row in written["results"]] == [
        (key, dim, 24576, m, times.get(m), None if m != 256 else "OutOfResources")
        for key, dim in zip(keys, (512, 768), strict=True) for m in (128, 64, 256)]
    assert json.loads((tmp_path / "tuned.json").read_text())["Some GPU"] == {key: fast for key in keys}


# tiles a Hopper GPU refused for today's kernels (OutOfResources: shared memory), besides those in the tuning files the
# test reads: grad fp32 at 128 x 256 x 32, 8 warps, 4 stages asked 311,352 bytes of an H200's 232,448 (seen at c = 512
# in session 28; a kernel's shared memory does not depend on the width, so no width may ship it)
REFUSED = [("NVIDIA H200", "grad/float32/tf32",
            {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4})]


def test_the_shipped_tables_hold_no_tiles_a_gpu_of_their_kind_refused():
    """A tile config a GPU could not launch (its shared memory) at one width is refused at every width, and on the
    other GPUs of its compute capability and SM count (which take each other's tiles): such a config in
    ``tuned.json`` only costs a failed launch and a tuning at its first use. Refusals: ``REFUSED`` and each
    ``OutOfResources`` in the tuning timings (``scripts/tune_kernels.py --timings``) of today's kernels."""
    from megabatch.kernels import triton_tiles

    from ..helpers import ROOT

    shipped = json.loads(triton_tiles.TUNED_FILE.read_text())
    devices = shipped.pop(triton_tiles.DEVICES)
    refused = list(REFUSED)
    timings = json.loads((ROOT / "docs" / "bench" / "tune_24k_median_h100.json").read_text())
    refused += [(timings["meta"]["gpu"], row["key"].rsplit("/", 1)[0], row["config"]) for row in timings["results"]
                if "OutOfResources" in str(row.get("skipped", ""))]
    assert len(refused) > len(REFUSED)  # the file's refusals were read
    found = []
    for gpu, kernel, config in refused:
        alike = [name for name, record in devices.items() if record == devices[gpu]]
        found += [(name, key) for name in alike for key, shipped_config in shipped[name].items()
                  if key.rsplit("/", 1)[0] == kernel and shipped_config == config]
    assert found == []
