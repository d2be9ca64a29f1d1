"""scripts/benchmarks: one entry point that lists every benchmark and runs one by name, and a README
table that names each of them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import unittest.mock

import torch

from .helpers import ROOT

FOLDER = ROOT / "scripts" / "benchmarks"


def runner():
    spec = importlib.util.spec_from_file_location("benchmarks_run", FOLDER / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runner_lists_every_benchmark_and_the_readme_table_names_them():
    module = runner()
    names = module.benchmarks()
    files = {path.stem for path in FOLDER.glob("*.py")} - module.NOT_BENCHMARKS
    assert set(names) == files and "end_to_end" in names
    assert all(summary for summary in names.values())  # each has a docstring
    table = (FOLDER / "README.md").read_text()
    assert [name for name in names if f"| `{name}` |" not in table] == []


def test_the_runner_runs_a_benchmark_by_name_and_refuses_an_unknown_one():
    ran = subprocess.run([sys.executable, str(FOLDER / "run.py"), "plot_memory", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "usage: plot_memory.py" in ran.stdout, ran.stderr
    unknown = subprocess.run([sys.executable, str(FOLDER / "run.py"), "nope"], capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 2 and "no benchmark 'nope'" in unknown.stderr


def test_the_benchmarks_time_the_step_the_trainer_builds():
    """``bench.trainer_step`` (what gradcache.py and fsdp.py time) is the trainer's own step: the
    same weights, sub-batches, caption trimming and gradients as ``RunParts.build``'s on a fixed
    batch."""
    from itertools import repeat

    import bench  # scripts/benchmarks/bench.py (tests/conftest.py puts its folder on the path)

    from megabatch.config.schema import validate
    from megabatch.data.synthetic import synthetic_sub_batch

    from .helpers import build_parts, compose, rel_error

    cfg = validate(compose("batch=32", "trainer.sub_batch=16", "model.image.patch_dropout=0"))
    step, trained = bench.trainer_step(cfg, "cpu"), build_parts(cfg).step
    assert step.sub_batches == trained.sub_batches == 2
    assert step.keep.text_trim is not None and trained.keep.text_trim is not None  # model.trim_text, as configured
    weights, trained_weights = step.model.state_dict(), trained.model.state_dict()
    assert weights.keys() == trained_weights.keys()
    assert all(torch.equal(weights[name], trained_weights[name]) for name in weights)
    sub = synthetic_sub_batch(16, step.model.image_size, step.model.context_length, "cpu")
    sub.texts[:, 9:] = 0  # captions shorter than the context: trimming cuts them
    sub.texts[:, 8] = 49407
    grads = []
    for built in (step, trained):
        torch.manual_seed(0)
        built.gradients(repeat(sub))
        grads.append(torch.cat([p.grad.flatten() for p in built.model.parameters() if p.grad is not None]))
    assert rel_error(grads[0], grads[1]) <= 1e-6


def test_learning_compares_each_setting_with_the_first_paired_by_seed():
    """learning.py's summary: each later setting's metrics less the first setting's, seed by seed, with a 95%
    interval (report/seeds.py); a metric not measured is left out, one seed has no interval."""
    import learning  # scripts/benchmarks/learning.py

    rows = [{"setting": s, "seed": seed, "zero_shot_top1": top1, "linear_probe_top1": probe}
            for s, seed, top1, probe in [("plain", 0, 97.0, 98.0), ("plain", 1, 95.0, 99.0), ("plain", 2, 98.0, 97.0),
                                         ("new", 0, 96.0, 98.5), ("new", 1, 95.0, 99.0), ("new", 2, 96.5, 97.5),
                                         ("one", 1, 96.0, None)]]
    compared = learning.against(rows, "plain", "new")
    assert set(compared) == {"zero_shot_top1", "linear_probe_top1"}
    assert compared["zero_shot_top1"]["mean"] == -2.5 / 3 and compared["zero_shot_top1"]["seeds"] == 3
    assert 0 < compared["linear_probe_top1"]["half_width"] and compared["linear_probe_top1"]["mean"] == 1 / 3
    assert learning.against(rows, "plain", "one") == {
        "zero_shot_top1": {"mean": 1.0, "half_width": None, "seeds": 1}}


def test_learning_shares_the_cores_out_among_the_runs_at_once():
    """learning.py --parallel N: each run's torch takes the machine's cores / N threads (at least one), unless
    OMP_NUM_THREADS is given."""
    import learning  # scripts/benchmarks/learning.py

    assert [learning.threads_each(n, cores=2) for n in (1, 2, 3)] == ["2", "1", "1"]
    assert learning.threads_each(8, cores=16) == "2"
    assert learning.threads_each(2, cores=16, given="4") == "4"


def test_startup_rows_say_where_the_first_steps_wait_for_images_went():
    """``startup.py`` keeps the first step's phases and its waits by cause (the loader, the GPU's decoding) from the
    run's metrics, so a start-up's first batch wait can be told apart."""
    import startup  # scripts/benchmarks/startup.py

    records = [{"step": 1, "loss": 4.1, "time/data": 1.6, "time/encode": 2.0, "data_wait_s/look_ahead_source": 1.2,
                "data_wait_s/look_ahead_decode": 0.4}, {"step": 2, "time/data": 0.1}]
    assert startup.first_step_waits(records) == {
        "phases_s": {"data": 1.6, "encode": 2.0},
        "decode_waits_s": {"look_ahead_source": 1.2, "look_ahead_decode": 0.4}}
    assert startup.first_step_waits([{"step": 2}]) is None


def test_startup_keeps_each_rows_log_in_a_file_of_its_own():
    """``startup.py --logs``: a row's run output beside the JSON, one file per row (the same cache state twice, or two
    trees at one state, each its own)."""
    import startup  # scripts/benchmarks/startup.py

    assert str(startup.run_log("out/startup.json", "block", "now", "warm", 3)) == "out/startup.block-now.warm.3.log"
    assert len({startup.run_log("s.json", "block", label, "warm", index)
                for label, index in (("now", 1), ("now", 2), ("before", 2))}) == 3


def test_startup_compares_one_or_several_earlier_trees(tmp_path):
    """``startup.py --before``: one tree is labelled ``before``, several each by their folder's name."""
    import startup  # scripts/benchmarks/startup.py

    assert startup.before_trees(None) == []
    assert startup.before_trees(str(tmp_path / "x")) == [(tmp_path / "x", "before")]
    assert startup.before_trees(f"{tmp_path / 'a'},{tmp_path / 'b'}") == [(tmp_path / "a", "a"), (tmp_path / "b", "b")]


def test_the_clock_sampler_reads_nvidia_smis_samples_and_names_what_held_the_clock(tmp_path):
    """``bench.ClockSampler`` runs nvidia-smi (here a stand-in that prints what the real one printed on an H100 under
    load, then waits to be stopped) around a region: the median, lowest and highest SM clock, the median power, and
    the reasons from the bits of every sample (power cap 0x4, thermal 0x20; idle 0x1 left out), a line that is not a
    sample skipped. Without nvidia-smi, nothing."""
    import bench

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\n"
                    "printf '1140, 702.21, 0x0000000000000004\\n1470, 695.00, 0x0000000000000001\\n"
                    "[N/A], [N/A], [N/A]\\n1965, 420.50, 0x0000000000000020\\n'\nexec sleep 30\n")
    fake.chmod(0o755)
    with bench.ClockSampler(3, interval_ms=100, command=str(fake)) as sampler:
        time.sleep(0.3)
    summary = sampler.summary()
    assert summary == {"sm_mhz": 1470.0, "sm_mhz_min": 1140.0, "sm_mhz_max": 1965.0, "power_w": 695.0,
                       "clock_limits": ["power cap", "thermal (software)"], "clock_samples": 3}
    assert (tmp_path / "args").read_text().split() == ["--id=3", f"--query-gpu={bench.ClockSampler.QUERY}",
                                                        "--format=csv,noheader,nounits", "--loop-ms=100"]
    with bench.ClockSampler(0, command=str(tmp_path / "absent")) as sampler:
        pass
    assert sampler.summary() == {}
    # torch's cuda:1 under CUDA_VISIBLE_DEVICES=5,GPU-abc is nvidia-smi's GPU-abc; cuda:0 without the variable, its 0
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    with unittest.mock.patch.dict(os.environ, {**env, "CUDA_VISIBLE_DEVICES": "5,GPU-abc"}, clear=True):
        assert bench.ClockSampler(torch.device("cuda", 1)).args[1] == "--id=GPU-abc"
    with unittest.mock.patch.dict(os.environ, env, clear=True):
        assert bench.ClockSampler(torch.device("cuda")).args[1] == "--id=0"


def test_loss_passes_names_an_unknown_pass_and_the_loss_brings_its_parts(tmp_path):
    """``loss_passes.py --passes``: a misspelt pass is refused with the names it takes (before any GPU work); ``loss``
    (the forward plus the backward) adds the two passes it is the sum of, which it silently lacked without them."""
    script = str(FOLDER / "loss_passes.py")
    ran = subprocess.run([sys.executable, script, "--passes", "stats,lose", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert ran.returncode == 2 and "--passes: lose unknown" in ran.stderr and "backward" in ran.stderr
    spec = importlib.util.spec_from_file_location("loss_passes", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seen = {}

    def measure(tree, name, batches, dims, dtypes, configs, repeats, passes):
        seen["passes"] = passes
        return []

    module.measure = measure
    out = tmp_path / "part.json"
    argv = sys.argv
    try:
        sys.argv = [script, "--passes", "loss,sigmoid", "--worker", "this=src", "--out", str(out)]
        module.main()
    finally:
        sys.argv = argv
    assert seen["passes"] == ("loss", "sigmoid", "stats", "backward") and json.loads(out.read_text()) == []


def test_kernel_instructions_counts_a_loss_kernels_machine_code(tmp_path):
    """kernel_instructions.py compiles loss kernels for sm_90 without a GPU and counts their machine code: the
    backward's kernel at the H200's tiles has its tensor-core instructions and, in the block that holds them, two
    exponentials a logit of its tile (P_row and P_col), no spills, and a register count. The forward with the shared
    shift on, a branch a tile or checked, keeps its dots pipelined: a branch in a flattened loop made Triton wait for
    each tensor-core instruction (every one ending its batch). With ``MEGABATCH_LOSS_ACC_FLAG=1`` (``auto``, the
    default, on for sm_90; ``0`` here for the first tree) the backward's
    kernel resets its accumulator through the tensor cores' flag, not a select over its 64 registers a thread: more
    than 64 instructions fewer."""
    out = tmp_path / "instructions.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    trees = ("branch=src@MEGABATCH_LOSS_ACC_FLAG=0,"
             "checked=src@MEGABATCH_LOSS_SHARED_SHIFT=checked@MEGABATCH_LOSS_ACC_FLAG=1")
    ran = subprocess.run([sys.executable, str(FOLDER / "kernel_instructions.py"), "--kernels", "grad,stats", "--trees",
                          trees, "--out", str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    grad, stats, flagged, checked = json.loads(out.read_text())["results"]
    assert flagged["kernel"] == "grad" and flagged["instructions"] < grad["instructions"] - 64
    assert grad["kernel"] == "grad" and grad["tuned"] and grad["instructions"] == sum(grad["opcodes"].values())
    loop = max(grad["blocks"], key=lambda block: block["hgmma"])
    assert loop["hgmma"] > 0 and loop["mufu"] == 2 * grad["logits_per_thread"]
    assert grad["spill_stores"] == 0 and 0 < grad["registers"] <= 255
    for row in (grad, stats, checked):
        assert 0 < row["hgmma_batches_ended"] < row["opcodes"]["HGMMA"], (row["tree"], row["kernel"])


def test_a_result_names_the_commit_whose_sources_it_measured_where_the_checkouts_history_lags(tmp_path):
    """``bench.source_tree`` is git's id of a folder's tree, computed from its files (what git ignores left out), so a
    run on a copy of the working tree whose history stopped at an older commit still says which code it measured;
    ``results_page.py --resolve`` turns that back into the commit."""
    import bench
    import results_page

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True,
                              env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                   "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()

    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("x = 1\n")
    (src / "pkg" / "sub" / "b.json").write_text("{}\n")
    (src / "pkg-x.py").write_text("y = 2\n")  # sorts before "pkg/" as git sorts a folder: name + "/"
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    assert bench.source_tree(src) == git("rev-parse", "HEAD:src")
    (src / "pkg" / "a.py").write_text("x = 2\n")
    git("commit", "-qam", "second")
    (src / "pkg" / "__pycache__").mkdir()  # ignored by git, so by the id too
    (src / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (src / "pkg" / "c.pyc").write_bytes(b"\0")
    assert bench.source_tree(src) == git("rev-parse", "HEAD:src") != bench.source_tree(src / "pkg")
    assert bench.source_tree(tmp_path / "nope") is None
    assert bench.tree_ids(f"now={src},gone={tmp_path / 'nope'}@X=1") == {"now": git("rev-parse", "HEAD:src"),
                                                                           "gone": None}
    assert bench.commit_of_tree(git("rev-parse", f"{first}:src"), root=tmp_path) == first
    assert bench.commit_of_tree("0" * 40, root=tmp_path) is None

    # a result measured at the first commit's sources, reported from a copy whose history said otherwise
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"meta": {"git_commit": "abc1234+dirty", "src_tree": git("rev-parse", f"{first}:src")},
                                  "results": [1]}))
    said = results_page.resolve_commits([str(result)], root=tmp_path)
    meta = json.loads(result.read_text())["meta"]
    assert meta["git_commit"] == first and meta["reported_commit"] == "abc1234+dirty" and first[:7] in said[0]
    assert "already" in results_page.resolve_commits([str(result)], root=tmp_path)[0]


def test_a_result_names_its_card_and_host_and_the_page_shows_them(tmp_path):
    """Every result's metadata names its host's CPU model (read from ``/proc/cpuinfo``, else ``platform``) and, on a
    GPU, the card's UUID as nvidia-smi writes it, so two results can be told to come from one card or two (H100 hosts
    differed by more than any start-up change measured); the results page shows them where a result has them."""
    import bench
    import results_page

    host = bench.metadata()["host"]
    assert host["cpus"] == os.cpu_count() and "cpu_model" in host
    if os.path.exists("/proc/cpuinfo") and "model name" in open("/proc/cpuinfo").read():
        assert host["cpu_model"] and host["cpu_model"] in open("/proc/cpuinfo").read()

    class Properties:
        uuid = "3f2a9c1e-0b7d-4e1a-9d2c-5a6b7c8d9e0f"  # torch's form, without nvidia-smi's prefix

    with unittest.mock.patch.object(torch.cuda, "is_available", return_value=True), \
            unittest.mock.patch.object(torch.cuda, "current_device", return_value=0), \
            unittest.mock.patch.object(torch.cuda, "get_device_properties", return_value=Properties()), \
            unittest.mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100 80GB HBM3"):
        meta = bench.metadata()
    assert meta["gpu_uuid"] == "GPU-3f2a9c1e-0b7d-4e1a-9d2c-5a6b7c8d9e0f" and meta["gpu"] == "NVIDIA H100 80GB HBM3"
    assert "gpu_uuid" not in bench.metadata() or torch.cuda.is_available()  # no card, no UUID
    meta["host"] = {"cpus": 16, "machine": "x86_64", "cpu_model": "Intel(R) Xeon(R) Platinum 8480+"}
    assert results_page.machine(meta) == ("1 x NVIDIA H100 80GB HBM3 (card GPU-3f2a9c1e, "
                                          "16 x Intel(R) Xeon(R) Platinum 8480+)")
    # a result from before these fields: as the page showed it
    assert results_page.machine({"gpu": "NVIDIA H200", "gpus": 4, "host": {"cpus": 64}}) == "4 x NVIDIA H200"


def test_kernel_counters_gives_each_kernel_ncu_profiled_its_pass_and_flops():
    """``kernel_counters.py`` reads ncu's raw CSV page of one pass (an ncu run a pass): each kernel is the pass's, a
    Triton kernel counts its dots and cuBLAS's GEMMs one GEMM, and a launch right after one of the same kernel (the
    checked shift's redo) is given no FLOPs; the distillation pass launches the statistics kernel twice (the student's
    and the teacher's) and both count."""
    import kernel_counters as kc

    metrics = kc.counters()
    header = ["ID", "Kernel Name", "Grid Size", "Block Size", *metrics]
    units = ["", "", "", "", *["" for _ in metrics]]

    def record(i, name, time_ns, tensor):
        values = {kc.AMOUNTS["time_ns"]: str(time_ns), kc.SHARES["tensor"]: str(tensor),
                  kc.AMOUNTS["l2_bytes"]: "1,000,000", kc.STALL.format("barrier"): "0.5"}
        return [str(i), name, "(264, 1, 1)", "(128, 1, 1)", *[values.get(metric, "n/a") for metric in metrics]]

    lines = ["==PROF== Connected to process", "distill 1 c"] + [
        ",".join(f'"{v}"' for v in row) for row in (
            header, units, record(9, "vectorized_elementwise_kernel", 3_000, 0),
            record(0, "_stats_kernel", 2_000_000, 51.0), record(1, "_stats_kernel", 10_000, 1.0),
            record(2, "reduce_kernel", 5_000, 0), record(3, "_stats_kernel", 2_000_000, 50.0),
            record(4, "_distill_grad_kernel", 3_000_000, 40.0), record(5, "nvjet_hsh_256x128_2cta", 1_000_000, 77.0))]
    b, c = 1024, 512
    rows = kc.rows_of("\n".join(lines), b, c, "distill")
    assert [row["kernel"] for row in rows] == [
        "vectorized_elementwise_kernel", "_stats_kernel", "_stats_kernel", "reduce_kernel", "_stats_kernel",
        "_distill_grad_kernel", "nvjet_hsh_256x128_2cta"]
    assert {row["pass"] for row in rows} == {"distill"}
    gemm = 2 * b * b * c
    # the student's statistics, its checked shift's redo (none), the teacher's, the G kernel's two dots, a GEMM
    assert [row["flops"] for row in rows] == [None, gemm, None, None, gemm, 2 * gemm, gemm]
    assert rows[1]["tflops"] == gemm / 2e-3 / 1e12 and rows[1]["tensor"] == 51.0 and rows[1]["xu"] is None
    assert rows[1]["l2_bytes"] == 1e6 and rows[1]["l2_bytes_per_flop"] == 1e6 / gemm
    assert rows[1]["stalls"]["barrier"] == 0.5 and rows[1]["stalls"]["wait"] is None
    assert kc.rows_of("==ERROR== no kernels were profiled", b, c, "stats") == []


def test_kernel_counters_runs_ncu_again_without_a_counter_it_does_not_know(tmp_path):
    """The whole script against a stand-in for ncu that knows every counter but one: the first run fails naming it,
    the second, without it, profiles; the JSON names the counter left out and holds the kernels' rows."""
    import kernel_counters as kc

    missing = kc.STALL.format("imc_miss")
    fake = tmp_path / "ncu"
    fake.write_text(f"""#!{sys.executable}
import sys
metrics = sys.argv[sys.argv.index("--metrics") + 1].split(",")
assert "--profile-from-start" in sys.argv and "--worker" in sys.argv
if {missing!r} in metrics:
    print("==ERROR== Failed to find metric {missing.split('.')[0]}", file=sys.stderr)
    sys.exit(1)
header = ["ID", "Kernel Name", *metrics]
print("==PROF== Disconnected")
for row in (header, [""] * len(header), ["0", "_sigmoid_kernel", *["2,000" for _ in metrics]]):
    print(",".join(f'"{{v}}"' for v in row))
""")
    fake.chmod(0o755)
    out = tmp_path / "counters.json"
    ran = subprocess.run([sys.executable, str(FOLDER / "kernel_counters.py"), "--ncu", str(fake), "--batch", "1024",
                          "--dims", "512", "--passes", "sigmoid", "--out", str(out)], capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr
    data = json.loads(out.read_text())
    assert data["meta"]["unknown_metrics"] == [missing] and missing not in data["meta"]["metrics"]
    [row] = data["results"]
    assert row["pass"] == "sigmoid" and row["time_ns"] == 2000 and row["tflops"] == 2 * 1024 * 1024 * 512 / 2e-6 / 1e12
