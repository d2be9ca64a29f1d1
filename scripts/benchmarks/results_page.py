"""Write docs/benchmarks.md, the results page: today's figures for each question, from the JSONs in
docs/bench (their commands, machines, dates and commits are read from the files themselves).

    python scripts/benchmarks/results_page.py            # rewrite docs/benchmarks.md
    python scripts/benchmarks/results_page.py --plots    # and its pictures (matplotlib)
    python scripts/benchmarks/results_page.py --check    # exit 1 if docs/benchmarks.md is not what it would write

A new measurement replaces an entry of ``results_page.yaml`` (the superseded JSON leaves docs/bench;
git history keeps it); tests/test_docs.py checks that the committed page is what this script writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"
E2E_PLOT = "end_to_end_vs_openclip_h100.png"
MULTI_GPU_PLOT = "multi_gpu_scaling_4xh200.png"

# The page's entries, as data (results_page.yaml beside this script): each question, what it asks, and the
# measurements that answer it today; ``added``: the date of the commit that added each file written before the
# JSONs carried their own date and commit (meta.time, meta.git_commit).
ENTRIES = yaml.safe_load((Path(__file__).with_name("results_page.yaml")).read_text())
ADDED: dict[str, str] = ENTRIES["added"]
QUESTIONS: list[dict] = ENTRIES["questions"]


def load(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def machine(meta: dict) -> str:
    gpu = meta.get("gpu")
    host = meta.get("host") if isinstance(meta.get("host"), dict) else {}
    if gpu in (None, "None"):
        return f"CPU only ({host['cpus']} cores)" if host.get("cpus") else "CPU only"
    gpus = int(meta.get("gpus") or 1)
    where = f"{gpus} x {gpu}" if gpus > 1 else f"1 x {gpu}"
    # which card and host (recorded since 2026-12-06): results from one card compare; from two, the host moves them too
    known = [f"card {meta['gpu_uuid'][:12]}" if meta.get("gpu_uuid") else None,
             f"{host['cpus']} x {host['cpu_model']}" if host.get("cpu_model") and host.get("cpus") else None]
    known = [part for part in known if part]
    return f"{where} ({', '.join(known)})" if known else where


def provenance(name: str, meta: dict) -> str:
    date = (meta.get("time") or "")[:10] or ADDED.get(name, "undated")
    commit = (meta.get("git_commit") or "")[:7]
    if (meta.get("git_commit") or "").endswith("+dirty"):  # measured with changes not yet committed
        commit += " with uncommitted changes"
    command = meta.get("command") or "(not recorded)"
    if "scripts/" in command:  # as the benchmark is run today (scripts/bench_X.py moved to scripts/benchmarks/)
        command = command[command.index("scripts/"):]
    for old, new in (("bench_offload.py", "benchmarks/end_to_end.py"), ("bench_loss.py", "benchmarks/loss.py"),
                     ("bench_loader.py", "benchmarks/loader.py")):
        command = command.replace(f"scripts/{old}", f"scripts/{new}")
    if command.startswith("scripts/"):
        command = "python " + command
    where = f"{machine(meta)}, {date}" + (f", commit {commit}" if commit else "")
    return f"[`{name}`](bench/{name}): {where}; `{command}`"


def batch_name(batch: int) -> str:
    for size, suffix in ((2**20, "M"), (2**10, "k")):
        if batch >= size and batch % size == 0:
            return f"{batch // size}{suffix}"
    return f"{batch:,}"


def loss_table(data: dict, entry: dict) -> list[str]:
    rows = ["| backend | dtype | batch | time | useful TFLOP/s | extra GB |", "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if entry.get("backends") and row["backend"] not in entry["backends"]:
            continue
        if entry.get("dtypes") and row["dtype"] not in entry["dtypes"]:
            continue
        if row.get("status") == "ok":
            time = row["time_s"]
            shown = f"{time * 1000:.1f} ms" if time < 1 else f"{time:.2f} s"
            rows.append(f"| `{row['backend']}` | {row['dtype']} | {batch_name(row['batch'])} | {shown} | "
                        f"{row['useful_tflops']:.0f} | {row['extra_gb']:.2f} |")
        elif not str(row.get("status", "")).startswith("skipped"):
            rows.append(f"| `{row['backend']}` | {row['dtype']} | {batch_name(row['batch'])} | "
                        f"{row.get('status')} | | |")
    return rows


def loss_passes_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/loss_passes.py: each pass's time, TFLOP/s and share of the bf16 peak, per source tree."""
    rows = ["| tree | batch | c | features | pass | tiles (M x N, warps, stages) | time | TFLOP/s | % of bf16 peak |",
            "|---|---|---|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "pass" not in row:
            rows.append(f"| {row['tree']} | {row.get('status')} | | | | | | | |")
            continue
        tiles = row["tile"] if isinstance(row["tile"], list) else [row["tile"]]  # distill: both kernels'
        shown = f"{row['time_s'] * 1000:.0f} ms" if row["time_s"] < 1 else f"{row['time_s']:.2f} s"
        share = f"{100 * row['peak_share']:.1f}" if row.get("peak_share") else "-"
        rows.append(f"| {row['tree']} | {batch_name(row['batch'])} | {row['dim']} | {row['dtype']} | {row['pass']} | "
                    f"{'; '.join(tile_name(tile) for tile in tiles)} | {shown} | {row['tflops']:.0f} | {share} |")
    return rows


def tile_name(tile: dict) -> str:
    return f"{tile['BLOCK_M']} x {tile['BLOCK_N']}, {tile['num_warps']}, {tile['num_stages']}"


def tune_table(data: dict, entry: dict) -> list[str]:
    """scripts/tune_kernels.py --timings: each candidate tile's median time on the tuning block, the one it picked
    marked (a candidate that does not fit the GPU: why)."""
    rows = ["| kernel | c | block | tiles (M x N x K, warps, stages) | time | picked |", "|---|---|---|---|---|---|"]
    picks = data["meta"]["picks"]
    for row in data["results"]:
        c = row["config"]
        tiles = f"{c['BLOCK_M']} x {c['BLOCK_N']} x {c['BLOCK_K']}, {c['num_warps']}, {c['num_stages']}"
        shown = f"{row['ms']:.3f} ms" if "ms" in row else row["skipped"]
        picked = "yes" if picks.get(row["key"]) == c else ""
        rows.append(f"| {row['kernel']} | {row['dim']} | {row['size']:,} | {tiles} | {shown} | {picked} |")
    return rows


def counters_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/kernel_counters.py: each kernel a pass launched, with its time, TFLOP/s, how busy it kept
    each part of the GPU (% of that part's peak, ncu's counters) and the reasons its warps waited most; the kernels
    under 2% of their pass's time (PyTorch's small reductions and copies) in one line a pass."""
    rows = ["| c | pass | kernel | time | MHz | TFLOP/s | tensor cores | XU | FMA | issue | L2 | DRAM | L2 B/FLOP "
            "| warps waited most on (cycles an instruction) |", "|---" * 14 + "|"]

    def share(value) -> str:
        return "-" if value is None else f"{value:.0f}%"

    totals = {}
    for row in data["results"]:
        if "kernel" in row:
            key = (row["dim"], row["pass"])
            totals[key] = totals.get(key, 0.0) + (row.get("time_ns") or 0)
    small = {}
    for row in data["results"]:
        if "kernel" not in row:
            rows.append(f"| {row.get('dim')} | {row.get('status')} | | | | | | | | | | | | |")
            continue
        key = (row["dim"], row["pass"])
        time_us = (row.get("time_ns") or 0) / 1e3
        if row["pass"] is None or not row.get("flops") and time_us * 1e3 < 0.02 * totals[key]:
            count, us = small.get(key, (0, 0.0))
            small[key] = (count + 1, us + time_us)
            continue
        stalls = sorted(((v, k) for k, v in (row.get("stalls") or {}).items() if v), reverse=True)[:3]
        waited = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for v, k in stalls) or "-"
        tensor = row.get("tensor") if row.get("tensor") is not None else row.get("tensor_hmma")
        tflops = f"{row['tflops']:.0f}" if row.get("tflops") else "-"
        per_flop = f"{row['l2_bytes_per_flop']:.4f}" if row.get("l2_bytes_per_flop") else "-"
        mhz = f"{row['sm_hz'] / 1e6:.0f}" if row.get("sm_hz") else "-"
        rows.append(f"| {row['dim']} | {row['pass']} | `{row['kernel'][:48]}` | {time_us:.0f} us | {mhz} | {tflops} | "
                    f"{share(tensor)} | {share(row.get('xu'))} | {share(row.get('fma'))} | "
                    f"{share(row.get('issue'))} | {share(row.get('l2'))} | {share(row.get('dram'))} | {per_flop} | "
                    f"{waited} |")
    for (dim, name), (count, us) in small.items():  # no pass: before the first Triton kernel (its set-up)
        rows.append(f"| {dim} | {name or 'set-up'} | {count} small kernels | {us:.0f} us in all | | | | | | | | | | |")
    return rows


def loss_variants_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/loss_variants.py: each kernel variant's time, TFLOP/s, share of the peak and largest
    difference from the tree's own kernel (or why it did not build)."""
    rows = ["| pass | variant | tiles (M x N x K, warps, stages) | time | TFLOP/s | % of bf16 peak | largest "
            "difference |", "|---|---|---|---|---|---|---|"]
    for row in data["results"]:
        c = row["config"]
        tiles = f"{c['BLOCK_M']} x {c['BLOCK_N']} x {c['BLOCK_K']}, {c['num_warps']}, {c['num_stages']}"
        if "ms" not in row:
            rows.append(f"| {row['kind']} | {row['variant']} | {tiles} | {row['error'][:40]} | | | |")
            continue
        error = "-" if row.get("max_err") is None else f"{row['max_err']:.1e}"
        rows.append(f"| {row['kind']} | {row['variant']} | {tiles} | {row['ms']:.1f} ms | {row['tflops']:.0f} | "
                    f"{100 * row['peak_share']:.1f} | {error} |")
    return rows


def g_gemms_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/g_gemms.py: each route's GEMM on one block of G', its time, TFLOP/s and error to float64."""
    rows = ["| c | block side | product | G' route | time | TFLOP/s | relative error | relative max error |",
            "|---|---|---|---|---|---|---|---|"]
    for row in data["results"]:
        rows.append(f"| {row['dim']} | {row['side']:,} | {row['product']} | {row['route']} | "
                    f"{row['time_s'] * 1000:.2f} ms | {row['tflops']:.0f} | {row['relative_error']:.2e} | "
                    f"{row['relative_max_error']:.2e} |")
    return rows


def g_block_sides_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/g_block_sides.py: cuBLAS's GEMMs on one block of G' by side, then the whole backward with
    blocks of each side: time and share of the bf16 peak."""
    rows = ["| what | batch | c | features | block side | product | time | % of bf16 peak |",
            "|---|---|---|---|---|---|---|---|"]
    for row in data["results"]:
        shown = f"{row['time_s'] * 1000:.2f} ms" if row["time_s"] < 1 else f"{row['time_s']:.2f} s"
        side = row["side"] if isinstance(row["side"], str) else f"{row['side']:,}"
        if row["kind"] == "gemm":
            rows.append(f"| GEMM | | {row['dim']} | bf16 | {side} | {row['product']} | {shown} | "
                        f"{100 * row['peak_share']:.1f} |")
        else:
            rows.append(f"| backward | {batch_name(row['batch'])} | {row['dim']} | {row['dtype']} | {side} | | "
                        f"{shown} | {100 * row['peak_share']:.1f} |")
    return rows


def decoder_head_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/decoder_head.py: the caption decoder's head per tree and count of tokens, its peak memory
    and seconds."""
    rows = ["| tree | tokens | device | peak memory | what the peak is | forward + backward |",
            "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "peak_gb" not in row:
            rows.append(f"| {row['tree']} | {row.get('status')} | | | | |")
            continue
        rows.append(f"| {row['tree']} | {row['tokens']:,} | {row['device']} | {row['peak_gb']:.2f} GB | "
                    f"{row['peak_is']} | {row['seconds']:.2f} s |")
    return rows


def naflex_pack_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/naflex_pack.py: images a second through the packer per tree, and its bytes against the
    first tree's."""
    rows = ["| tree | images | resized sizes | time | images/s | bytes differing from the first tree | largest "
            "difference |", "|---|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "time_s" not in row:
            rows.append(f"| {row['tree']} | {row.get('status')} | | | | | |")
            continue
        share = row.get("bytes_differing_from_first")
        rows.append(f"| {row['tree']} | {row['images']:,} | {row['resized_sizes']} | {row['time_s'] * 1000:.0f} ms | "
                    f"{row['images_per_s']:,.0f} | {'-' if share is None else f'{share:.1e}'} | "
                    f"{row.get('largest_difference_from_first', '-')} |")
    return rows


def e2e_rows(data: dict) -> tuple[list[dict], dict | None]:
    ours = [row for row in data["results"] if row.get("system") == "megabatch"]
    theirs = next((row for row in data["results"] if str(row.get("system", "")).startswith("openclip")), None)
    return ours, theirs


def e2e_table(data: dict, entry: dict) -> list[str]:
    ours, theirs = e2e_rows(data)
    rows = ["| trainer | variant | sub-batch | s / step | samples/s | vs OpenCLIP | MFU | peak GPU GB |",
            "|---|---|---|---|---|---|---|---|"]
    base = theirs.get("samples_per_s") if theirs else None
    for row in ours:
        ratio = f"**{row['steady_samples_s'] / base:.2f}x**" if base else "-"
        setting = row.get("sub_batch_setting")
        sub = f"{row['sub_batch']}" + (" (auto)" if setting == "auto" else "")
        rows.append(f"| megabatch | {row.get('variant') or 'all-on'} | {sub} | {row['steady_step_s']:.3f} | "
                    f"{row['steady_samples_s']:,.0f} | {ratio} | {row['mfu'] * 100:.1f}% | {row['peak_gpu_gb']:.1f} |")
    if theirs:
        rows.append(f"| OpenCLIP 3.3 | accum {theirs.get('accum_freq', 1)} | {theirs['sub_batch']} | "
                    f"{theirs['step_s']:.3f} | {theirs['samples_per_s']:,.0f} | 1.00x | - | "
                    f"{theirs['peak_gpu_gb']:.1f} |")
    if entry.get("phases"):
        phases = ours[0]["steps"][-1]["phases_s"]
        rows.append("")
        rows.append("Where the step's time went: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) + ".")
    return rows


def multi_gpu_table(data: dict, entry: dict) -> list[str]:
    if entry.get("memory"):
        return memory_table(data["results"])
    if entry.get("with_memory"):  # speed, then each run's memory
        return multi_gpu_table(data, {k: v for k, v in entry.items() if k != "with_memory"}) + [
            ""] + memory_table(data["results"])
    rows = ["| trainer | GPUs | samples/s (median) | slowest - fastest | slowest / median | s / step | "
            "x 1 GPU | vs OpenCLIP | MFU | peak GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    runs = data["results"]
    results = [row for row in runs if row.get("samples_per_s")]
    for row in results:
        speed = row["samples_per_s"]
        one = next((r for r in results if r["system"] == row["system"] and r["gpus"] == 1), None)
        theirs = next((r for r in results if r["system"] == "openclip" and r["gpus"] == row["gpus"]), None)
        scaling = f"{speed['median'] / one['samples_per_s']['median']:.2f}x" if one and row["gpus"] > 1 else "-"
        versus = f"**{speed['median'] / theirs['samples_per_s']['median']:.2f}x**" \
            if theirs and row["system"] == "megabatch" else "-"
        trainer = trainer_name(row)
        peak = max(row["gpu_memory_peak_gb"]) if row.get("gpu_memory_peak_gb") else None
        mfu = row.get("mfu", {}).get("median")
        rows.append(f"| {trainer} | {row['gpus']} | {speed['median']:,.0f} | {speed['min']:,.0f} - {speed['max']:,.0f} "
                    f"| {speed['slowest_over_median']:.2f} | {sample_batch(row) / speed['median']:.2f} | {scaling} | "
                    f"{versus} | {f'{mfu * 100:.1f}%' if mfu else '-'} | {f'{peak:.1f}' if peak else '-'} |")
    if entry.get("waits"):
        rows += ["", "| trainer | data phase per step (s) | of which waiting for the GPU decoding (s) |",
                 "|---|---|---|"]
        for row in results:
            data = " ".join(f"{s['phases_s'].get('data', 0):.2f}" for s in row["steps"])
            decode = " ".join(f"{decoding_wait(s):.2f}" for s in row["steps"])
            rows.append(f"| megabatch ({row.get('variant') or 'default'}, {row['gpus']} GPU) | {data} | {decode} |")
        rows += ["", entry["waits"]]
    if entry.get("phases"):
        ours = next(row for row in results if row["system"] == "megabatch")
        last = ours["steps"][-1]["phases_s"]
        rows += ["", "Where the last step's time went (rank 0): " + ", ".join(f"{k} {v:.1f} s" for k, v in last.items())
                 + "."]
    if entry.get("every_step"):  # each step's seconds and phases, the first (compiling, tuning) included
        rows += ["", "| trainer | step | s | " + " | ".join(PHASES) + " | rank 0 allocated GB |",
                 "|---|---|---|" + "---|" * len(PHASES) + "---|"]
        for row in results:
            for step in row["steps"]:
                rows.append(f"| megabatch ({row.get('variant') or 'default'}, {row['gpus']} GPU) | {step['step']} | "
                            f"{sample_batch(row) / step['samples_per_s']:.1f} | "
                            + " | ".join(f"{step['phases_s'].get(p, 0):.1f}" for p in PHASES)
                            + f" | {step['peak_gpu_gb']:.1f} |")
    started = [row for row in results if row.get("time_to_first_step_s") is not None]
    if started:  # multi_gpu.py since --cold: each run's start, from rank 0's status.json
        # the first step began after: the start less the step itself (its wait for the loader and its own time)
        rows += ["", f"| trainer | caches | first step after (s) | first step began after (s) | {startup_header()} |",
                 "|---|---|---|---|" + "---|" * len(STARTUP_PHASES)]
        for row in started:
            phases, cells = startup_phases(row)
            caches, first = "cold" if row.get("cold_caches") else "as found", row["time_to_first_step_s"]
            stepping = [phases.get(name) for name in ("first_batch_wait", "first_step")]
            began = "-" if None in stepping else f"{first - sum(stepping):.1f}"
            rows.append(f"| {trainer_name(row)} ({row['gpus']} GPU) | {caches} | **{first:.1f}** | {began} | {cells} |")
    if entry.get("losses"):  # each step's loss (runs on the same samples: their agreement)
        rows += ["", "| trainer | loss per step |", "|---|---|"]
        for row in results:
            rows.append(f"| megabatch ({row.get('variant') or 'default'}, {row['gpus']} GPU) | "
                        + " ".join(f"{step['loss']:.6f}" for step in row["steps"] if step.get("loss") is not None)
                        + " |")
    stopped = [row for row in runs if not row.get("samples_per_s")]
    if stopped:  # runs without a logged step: out of memory, a time limit, an error
        rows += ["", "| trainer | GPUs | batch | outcome | peak GB in use (nvidia-smi) |", "|---|---|---|---|---|"]
        for row in stopped:
            trainer = trainer_name(row)
            peak = max(row["gpu_memory_peak_gb"]) if row.get("gpu_memory_peak_gb") else None
            rows.append(f"| {trainer} | {row['gpus']} | {sample_batch(row):,} | {outcome(row)} | "
                        f"{f'{peak:.1f}' if peak else '-'} |")
    return rows


PHASES = ("data", "encode", "loss", "replay", "optimizer")
# the start-up phases shown (status.json's startup_s, less "_s"), in the order a run goes through them
# (data: the shards' counts, where neither sizes.json nor img2dataset's _stats.json gives them)
STARTUP_PHASES = ("launch", "model", "data", "plan", "step", "loader_start", "compile", "first_batch_wait",
                  "first_step")


def startup_header() -> str:
    """The shown start-up phases' column names."""
    return " | ".join(name.replace("_", " ") for name in STARTUP_PHASES)


def startup_phases(row: dict) -> tuple[dict[str, float], str]:
    """A run's ``startup_s`` by phase (less ``_s``), and the shown phases' cells ('-' for a phase it lacks)."""
    phases = {k.removesuffix("_s"): v for k, v in (row.get("startup_s") or {}).items()}
    return phases, " | ".join("-" if phases.get(name) is None else f"{phases[name]:.1f}" for name in STARTUP_PHASES)


def trainer_name(row: dict) -> str:
    return ("megabatch" + (f" ({row['variant']})" if row.get("variant") else "")
            if row["system"] == "megabatch" else "OpenCLIP 3.3")


def memory_table(runs: list[dict]) -> list[str]:
    """Each run's batch, outcome and peak memory, for runs that measure memory and not speed."""
    rows = ["| trainer | GPUs | batch | outcome | rank 0 allocated GB | peak GB in use (nvidia-smi) |",
            "|---|---|---|---|---|---|"]
    for row in runs:
        trainer = trainer_name(row)
        allocated = max((s["peak_gpu_gb"] for s in row["steps"] if s.get("peak_gpu_gb")), default=None)
        peak = max(row["gpu_memory_peak_gb"]) if row.get("gpu_memory_peak_gb") else None
        done = f"{len(row['steps'])} step{'s' if len(row['steps']) > 1 else ''}" if row["steps"] else outcome(row)
        rows.append(f"| {trainer} | {row['gpus']} | {sample_batch(row):,} | {done} | "
                    f"{f'{allocated:.1f}' if allocated else '-'} | {f'{peak:.1f}' if peak else '-'} |")
    return rows


def outcome(row: dict) -> str:
    """Why a run logged no step."""
    text = row.get("log_tail", "") + " ".join(row.get("error_lines", []))
    if "OutOfMemoryError" in text or "out of memory" in text:
        return "out of memory"
    if row.get("returncode") == "timeout":
        return f"no step within its {row['wall_s']:.0f} s"
    return f"exit status {row.get('returncode')}"


def decoding_wait(step: dict) -> float:
    """A step's wait on the GPU decoding's look-ahead (its source and its decoding; ``_first`` is a part of them)."""
    return sum(v for k, v in step.get("decode_waits_s", {}).items() if k.endswith(("_source", "_decode")))


def sample_batch(row: dict) -> int:
    """A row's global batch in samples (``32k``, ``1M`` or a number)."""
    batch = str(row["batch"])
    for suffix, size in (("k", 2**10), ("M", 2**20)):
        if batch.endswith(suffix):
            return int(batch[:-1]) * size
    return int(batch)


def loader_table(data: dict, entry: dict) -> list[str]:
    if any("stored_teacher_width" in row for row in data["results"]):
        return teacher_loader_table(data["results"])
    rows = ["| split | index cache | workers | sub-batch | samples/s |", "|---|---|---|---|---|"]
    for row in data["results"]:
        rows.append(f"| `{row['split']}` | {row.get('index_cache') or '-'} | {row['workers']} | {row['sub_batch']} | "
                    f"{row['first_pass_samples_s']:,.0f} |")
    return rows


def teacher_loader_table(results: list[dict]) -> list[str]:
    """The loader's workers on plain shards and on shards carrying teacher embeddings, per way of reading them."""
    rows = ["| embeddings read by | shards | workers | samples/s | per worker | stored / plain |",
            "|---|---|---|---|---|---|"]
    for row in results:
        plain = next((r for r in results if r.get("teacher_read") == row.get("teacher_read")
                      and r["workers"] == row["workers"] and not r.get("stored_teacher_width")), None)
        ratio = f"{row['first_pass_samples_s'] / plain['first_pass_samples_s']:.2f}" \
            if plain and row.get("stored_teacher_width") else "-"
        shards = f"embeddings, width {row['stored_teacher_width']}" if row.get("stored_teacher_width") else "plain"
        rows.append(f"| {row.get('teacher_read', '-')} | {shards} | {row['workers']} | "
                    f"{row['first_pass_samples_s']:,.0f} | {row['first_pass_per_worker']:,.0f} | {ratio} |")
    return rows


def stop_table(data: dict, entry: dict) -> list[str]:
    row = data["results"][0] if isinstance(data["results"], list) else data["results"]
    return ["| launcher | signal to | signal at step | signal to exit | exit status | last.pt step | last.pt GB |",
            "|---|---|---|---|---|---|---|",
            f"| {row['launcher']} | {row['signal_to']} | {row['signal_at_step']} | {row['signal_to_exit_s']:.1f} s | "
            f"{row['exit_status']} | {row['last_pt_step']} | {row['last_pt_gb']:.2f} |"]


def attention_table(data: dict, entry: dict) -> list[str]:
    rows = ["| shape | kernel | forward ms | backward ms | forward / backward TFLOP/s | host us |",
            "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "forward_ms" in row:
            rows.append(f"| {row['shape']} | {row['kernel']} | {row['forward_ms']:.3f} | {row['backward_ms']:.3f} | "
                        f"{row['forward_tflops']:.0f} / {row['backward_tflops']:.0f} | "
                        f"{row.get('forward_backward_host_us', float('nan')):.0f} |")
    return rows


def mlp_table(data: dict, entry: dict) -> list[str]:
    chosen = next(row["tiles"] for row in data["results"] if row.get("impl") == "fused" and row.get("tiles"))
    rows = ["| shape | kernel | ms | TFLOP/s (of the GEMM) |", "|---|---|---|---|"]
    for row in data["results"]:
        if "ms" in row and row.get("tiles", chosen) == chosen:
            tiles = f" {tuple(row['tiles'])}" if row.get("tiles") else ""
            rows.append(f"| {row['shape']} | {row['impl']}{tiles} | {row['ms']:.3f} | {row['tflops']:.0f} |")
    rows += ["", "| shape | MLP | forward ms | backward ms |", "|---|---|---|---|"]
    for row in data["results"]:
        if "forward_ms" in row:
            rows.append(f"| {row['shape']} | {row['impl']} | {row['forward_ms']:.3f} | {row['backward_ms']:.3f} |")
    return rows


def layernorm_table(data: dict, entry: dict) -> list[str]:
    rows = ["| shape | implementation | forward ms | forward GB/s | backward ms | backward GB/s |",
            "|---|---|---|---|---|---|"]
    for row in data["results"]:
        if "forward_ms" in row:
            tiles = f" {tuple(row['tiles'])}" if row.get("tiles") else ""
            rows.append(f"| {row['shape']} | {row['impl']}{tiles} | {row['forward_ms']:.3f} | "
                        f"{row['forward_gb_per_s']:.0f} | {row['backward_ms']:.3f} | {row['backward_gb_per_s']:.0f} |")
        elif row.get("impl") == "copy":
            rows.append(f"| {row['shape']} | one clone of the same bytes | {row['ms']:.3f} | "
                        f"{row['gb_per_s']:.0f} | | |")
    return rows


def towers_table(data: dict, entry: dict) -> list[str]:
    parts = ("image_forward_s", "image_replay_s", "text_forward_s", "text_replay_s")
    rows = ["| variant | image forward ms | image replay ms | text forward ms | text replay ms |",
            "|---|---|---|---|---|"]
    for row in data["results"]:
        if all(part in row for part in parts):
            rows.append(f"| {row['variant']} | " + " | ".join(f"{row[part] * 1e3:.1f}" for part in parts) + " |")
    return rows


def learning_table(data: dict, entry: dict) -> list[str]:
    steps = (100, 200, 300, 400, 500)
    rows = ["| setting | seeds | " + " | ".join(f"loss at {step}" for step in steps)
            + " | loss, last 100 steps | zero-shot top-1: mean (each) |", "|---" * (len(steps) + 4) + "|"]
    for summary in data["meta"]["summary"]:
        runs = [row for row in data["results"] if row["setting"] == summary["setting"]]
        curve = [sum(row["loss"][str(step)] for row in runs) / len(runs) for step in steps]
        each = ", ".join(f"{top1:.2f}" for top1 in summary["zero_shot_top1_each"])
        rows.append(f"| `{summary['setting']}` | {summary['seeds']} | " + " | ".join(f"{v:.3f}" for v in curve)
                    + f" | {summary['loss_last_100_mean']:.3f} | {summary['zero_shot_top1_mean']:.2f}% ({each}) |")
        if "caption_accuracy_mean" in summary:  # learning.py --caption-accuracy (a CoCa)
            named = ", ".join(f"{value:.2f}" for value in summary["caption_accuracy_each"])
            rows[-1] += f" {summary['caption_accuracy_mean']:.2f}% ({named}) |"
        if "linear_probe_top1_mean" in summary:  # each run's last.pt through scripts/evaluate.py eval=digits_probe
            probed = ", ".join(f"{value:.2f}" for value in summary["linear_probe_top1_each"])
            rows[-1] += f" {summary['linear_probe_top1_mean']:.2f}% ({probed}) |"
    if any("caption_accuracy_mean" in summary for summary in data["meta"]["summary"]):
        rows[0] += " held-out captions naming the digit: mean (each) |"
        rows[1] += "---|"
    if any("linear_probe_top1_mean" in summary for summary in data["meta"]["summary"]):
        rows[0] += " linear probe top-1: mean (each) |"
        rows[1] += "---|"
    return rows + paired_lines(data)


def paired_lines(data: dict) -> list[str]:
    """Under a learning table of several settings run with the same seeds (two or more): each later setting less
    the first, paired by seed, with a 95% interval (``megabatch/report/seeds.py``), in points."""
    from megabatch.report.seeds import METRICS, by_seed, paired_difference

    settings = [summary["setting"] for summary in data["meta"]["summary"]]
    results, parts = data["results"], []
    for setting in settings[1:]:
        compared = []
        for key, name in METRICS.items():
            paired = paired_difference(by_seed(results, settings[0], key), by_seed(results, setting, key))
            if paired is not None and paired.seeds >= 2:
                compared.append(f"{name} {paired.describe()}")
        if compared:
            parts.append(f"`{setting}`: " + ", ".join(compared))
    if not parts:
        return []
    return ["", f"Against `{settings[0]}`, paired by seed (the mean difference in points, its 95% interval, the "
            "seeds): " + "; ".join(parts) + "."]


def eval_suite_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/eval_suite.py: each run's wall time and each set's seconds and main number; the
    agreement of the several-GPU run with the one-GPU run."""
    from megabatch.report.results import headline, main_metric

    runs = [r for r in data["results"] if r.get("run") != "agreement"]
    names = list(dict.fromkeys(name for r in runs for name in r.get("sets", {})))
    first = {n: next(r["sets"][n] for r in runs if n in r.get("sets", {})) for n in names}
    rows = ["| run | GPUs | wall s | " + " | ".join(f"{n}: s, {main_metric(first[n])}" for n in names) + " |",
            "|---|---|---|" + "---|" * len(names)]
    for r in runs:
        cells = [f"{r['sets'][n]['seconds']:.1f} s, {headline(r['sets'][n]):.2f}" if n in r.get("sets", {}) else
                 ("-" if r.get("returncode") == 0 else f"({r.get('returncode')})") for n in names]
        wall = f"{r['wall_s']:.1f}" if r.get("returncode") == 0 else f"{r['wall_s']:.0f} ({r.get('returncode')})"
        rows.append(f"| {r['run']} | {r['gpus']} | {wall} | " + " | ".join(cells) + " |")
    for r in data["results"]:
        if r.get("run") == "agreement":
            worst = ", ".join(f"{n} {v:.2g}" for n, v in r["max_abs_difference"].items())
            rows += ["", f"Largest difference between the 1- and {r['gpus'][1]}-GPU numbers, per set: {worst}"]
    return rows


def embed_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/embed_shards.py: images a second written into shards per kind (in all, and steady: the
    batches from the first launch to the last), their TFLOP/s and share of the GPU's bf16 peak, against the model's
    forward alone on images already on the GPU; the image towers' smallest cosine to the model's float32 features
    where measured; the loader workers alone (decoding's ceiling)."""
    meta = data["meta"]
    rows = [f"{meta['arch']}: {meta['image_forward_gflop']:.1f} GFLOP an image's forward, "
            f"{meta['text_forward_gflop']:.1f} a caption's; {meta['per_shard']} JPEGs a shard, {meta['size']} px.", "",
            "| kind | compiled | loader workers | shards | images/s | steady images/s | TFLOP/s | of the peak | "
            "the forward alone: images/s | of the peak | warm-up s | cosine to float32 (least) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        if r["kind"] == "loader":
            rows.append(f"| loader alone (decoding) | - | {r['workers']} | {r['shards']} | {r['images_per_s']:,.0f} | "
                        "- | - | - | - | - | - | - |")
            continue
        share, steady = r.get("forward_alone_peak_share"), r.get("steady_images_per_s")
        cosine = r.get("min_cosine_to_float32")
        rows.append(f"| {r['kind']} | {'yes' if r['compiled'] else 'no'} | {r['workers']} | {r['shards']} | "
                    f"{r['images_per_s']:,.0f} | {f'{steady:,.0f}' if steady else '-'} | {r['tflops']:.0f} | "
                    f"{r['peak_share'] * 100:.1f}% | {r.get('forward_alone_images_per_s', 0):,.0f} | "
                    f"{f'{share * 100:.1f}%' if share else '-'} | {r['warm_up_s']:.0f} | "
                    f"{f'{cosine:.6f}' if cosine else '-'} |")
    return rows


def startup_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/startup.py: each run's seconds from the command to its first finished step, and for
    megabatch's where they went (``startup_s``; the phases not shown are in the rest)."""
    rows = [f"| trainer | model | batch | caches | first step after (s) | {startup_header()} | rest |",
            "|---|---|---|---|---|" + "---|" * (len(STARTUP_PHASES) + 1)]
    for row in data["results"]:
        if row.get("returncode") != 0 or row.get("time_to_first_step_s") is None:
            rows.append(f"| {row['system']} | {row['model']} | {row['batch']:,} | {row['cache']} | "
                        f"no step (exit {row.get('returncode')}) |" + " |" * (len(STARTUP_PHASES) + 1))
            continue
        phases, cells = startup_phases(row)
        rest = sum(phases.values()) - sum(phases.get(name) or 0.0 for name in STARTUP_PHASES) if phases else None
        rows.append(f"| {row['system']} | {row['model']} | {row['batch']:,} | {row['cache']} | "
                    f"**{row['time_to_first_step_s']:.1f}** | {cells} | {'-' if rest is None else f'{rest:.1f}'} |")
    return rows


def chaos_table(data: dict, entry: dict) -> list[str]:
    """scripts/benchmarks/chaos.py: the faults by kind, the steps each made the run do again (0 where a SIGTERM let it
    checkpoint its last step), the seconds to the next step, and every check."""
    kinds: dict[str, list[dict]] = {}
    for fault in data["faults"]:
        kinds.setdefault(fault["kind"], []).append(fault)
    rows = [f"{data['ranks']} ranks at the start, {data['steps']} steps, a checkpoint every {data['ckpt_every']}, "
            f"seed {data['seed']}: {len(data['faults'])} faults, {data['launches']} launches, {data['chaos_s']:.0f} s "
            f"against {data['straight_s']:.0f} s without faults.", "",
            "| fault | times | steps redone (most) | allowed | seconds to the next step (median) |",
            "|---|---|---|---|---|"]
    for kind, faults in sorted(kinds.items()):
        struck = [fault for fault in faults if "redone" in fault]
        seconds = sorted(fault["seconds_to_next_step"] for fault in struck)
        rows.append(f"| {kind} | {len(faults)} | {max(0, max((f['redone'] for f in struck), default=0))} | "
                    f"{max((f['redone_at_most'] for f in struck), default=0)} | "
                    f"{seconds[len(seconds) // 2]:.1f} |" if seconds else f"| {kind} | {len(faults)} | - | - | - |")
    rows += ["", "| check | held |", "|---|---|"]
    rows += [f"| {name} | {'yes' if held else '**no**'} |" for name, held in data["checks"].items()]
    return rows


TABLES = {"eval_suite": eval_suite_table, "embed": embed_table, "chaos": chaos_table, "loss": loss_table,
          "loss_passes": loss_passes_table, "loss_variants": loss_variants_table, "counters": counters_table,
          "g_gemms": g_gemms_table, "g_block_sides": g_block_sides_table, "tune": tune_table,
          "naflex_pack": naflex_pack_table,
          "decoder_head": decoder_head_table,
          "e2e": e2e_table,
          "loader": loader_table, "stop": stop_table,
          "attention": attention_table, "mlp": mlp_table, "towers": towers_table, "learning": learning_table,
          "layernorm": layernorm_table, "multi_gpu": multi_gpu_table, "startup": startup_table}


def page() -> str:
    lines = ["# Benchmarks", "",
             "[megabatch](../README.md) / Benchmarks. Today's figures, each with the machine, date, commit and "
             "command that measured it. This page is written by `python scripts/benchmarks/results_page.py` "
             "from the JSONs in [bench/](bench/); do not edit it by hand. How to run a benchmark: "
             "[scripts/benchmarks/README.md](../scripts/benchmarks/README.md). Superseded measurements "
             "are in git history (`git log --stat -- docs/bench`).", ""]
    contents = [f"- [{q['title'].replace('`', '')}](#{anchor(q['title'])})" for q in QUESTIONS]
    lines += ["Questions:", "", *contents, ""]
    for question in QUESTIONS:
        lines += [f"## {question['title']}", "", question["text"], ""]
        if question.get("picture"):
            lines += [f"![{question['title'].replace('`', '')}](bench/{question['picture']})", ""]
        for entry in question["entries"]:
            data = load(entry["file"])
            meta = data.get("meta") or {k: v for k, v in data.items() if k != "results"}
            if entry.get("label"):
                lines += [f"**{entry['label']}**", ""]
            lines += TABLES[entry["kind"]](data, entry) + ["", provenance(entry["file"], meta), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def cited() -> set[str]:
    """The docs/bench files this page reads or shows."""
    names = {entry["file"] for question in QUESTIONS for entry in question["entries"]}
    return names | {question["picture"] for question in QUESTIONS if question.get("picture")}


def plot_end_to_end(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios = [], []
    for entry in QUESTIONS[1]["entries"]:
        ours, theirs = e2e_rows(load(entry["file"]))
        if theirs and ours:
            labels.append(entry["label"].split(" (")[0].replace(", batch", "\n"))
            ratios.append(max(row["steady_samples_s"] for row in ours) / theirs["samples_per_s"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bars = ax.bar(range(len(ratios)), ratios, color="#3b7dd8")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ratios)), labels, fontsize=8)
    ax.set_ylabel("samples/s, megabatch / OpenCLIP")
    ax.set_title("End to end against OpenCLIP 3.3 --torchcompile (one GPU)")
    for bar, ratio in zip(bars, ratios, strict=True):
        ax.text(bar.get_x() + bar.get_width() / 2, ratio + 0.02, f"{ratio:.2f}x", ha="center", fontsize=8)
    ax.set_ylim(0, max(ratios) * 1.2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


FORKSERVER_RUN = "multi_gpu_vit_b32_32k_forkserver_thread_4xh200.json"
BATCH_256K = {"ViT-B/32": ("multi_gpu_vit_b32_256k_1gpu_4xh200.json", "multi_gpu_vit_b32_256k_2gpu_4xh200.json",
                           "multi_gpu_vit_b32_256k_4xh200.json"),
              "ViT-B/16": ("multi_gpu_vit_b16_256k_1gpu_2xh200.json", "multi_gpu_vit_b16_256k_2gpu_2xh200.json",
                           "multi_gpu_vit_b16_256k_4xh200.json")}


def warmup_steps(data: dict) -> int:
    """The steps a multi_gpu.py run left out of its figures (``--warmup-steps``, 2 unless its command says)."""
    words = data["meta"]["command"].split()
    return int(words[words.index("--warmup-steps") + 1]) if "--warmup-steps" in words else 2


def plot_multi_gpu(out: Path) -> None:
    """Samples/s against GPUs at 32k (ViT-B/32 beside OpenCLIP, ViT-B/16) and 256k, each step after warm-up a
    dot, the median a line, linear scaling from one GPU at 32k dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (file, arch) in zip(axes, (("multi_gpu_vit_b32_32k_4xh200.json", "ViT-B/32"),
                                       ("multi_gpu_vit_b16_32k_4xh200.json", "ViT-B/16")), strict=True):
        data = load(file)
        for system, color, label in (("megabatch", "#3b7dd8", "megabatch (torchrun train.py)"),
                                     ("openclip", "#d8703b", "OpenCLIP 3.3 (torchrun)")):
            rows = sorted((r for r in data["results"] if r["system"] == system and r.get("steps")),
                          key=lambda r: r["gpus"])
            if not rows:
                continue
            for row in rows:
                speeds = [s["samples_per_s"] / 1e3 for s in row["steps"][2:]]
                ax.scatter([row["gpus"]] * len(speeds), speeds, color=color, alpha=0.35, s=14)
            ax.plot([r["gpus"] for r in rows], [r["samples_per_s"]["median"] / 1e3 for r in rows], "o-",
                    color=color, label=label)
        if arch == "ViT-B/32":  # a later machine: the loader's workers from a fork server
            rows = sorted((r for r in load(FORKSERVER_RUN)["results"] if r.get("steps")), key=lambda r: r["gpus"])
            for row in rows:
                speeds = [s["samples_per_s"] / 1e3 for s in row["steps"][2:]]
                ax.scatter([row["gpus"]] * len(speeds), speeds, color="#3ba65a", alpha=0.35, s=14)
            ax.plot([r["gpus"] for r in rows], [r["samples_per_s"]["median"] / 1e3 for r in rows], "s-",
                    color="#3ba65a", label="megabatch as released (fork server; another machine)")
        # 256k: a run per GPU count, each on a machine of its own
        points = sorted((row["gpus"], warmup_steps(load(file)), row) for file in BATCH_256K[arch]
                        for row in load(file)["results"] if row.get("steps"))
        for gpus, warmup, row in points:
            speeds = [s["samples_per_s"] / 1e3 for s in row["steps"][warmup:]]
            ax.scatter([gpus] * len(speeds), speeds, color="#8a4fc4", alpha=0.35, s=14)
        ax.plot([g for g, _, _ in points], [r["samples_per_s"]["median"] / 1e3 for _, _, r in points], "D-",
                color="#8a4fc4", label="megabatch at 256k (points from several machines)")
        ours = [r for r in data["results"] if r["system"] == "megabatch" and r["gpus"] == 1]
        if ours:
            base = ours[0]["samples_per_s"]["median"] / 1e3
            ax.plot([1, 4], [base, 4 * base], ":", color="gray", label="linear from 1 GPU")
        ax.set_xticks([1, 2, 4])
        ax.set_xlabel("H200 GPUs of one host")
        ax.set_ylabel("k samples/s (dots: steps; line: median)")
        ax.set_title(f"{arch}, loss=infcl (batch 32k unless named)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is out of date")
    parser.add_argument("--plots", action="store_true", help="also draw the pictures (matplotlib)")
    parser.add_argument("--resolve", nargs="+", metavar="JSON",
                        help="first set each file's meta.git_commit to the commit whose src/ it measured (its "
                             "meta.src_tree), keeping what the run reported as meta.reported_commit: a GPU machine's "
                             "copy of the tree can report the commit it was first sent with")
    return parser


def resolve_commits(paths: list[str], root: Path = ROOT) -> list[str]:
    """``--resolve``: each JSON's ``meta.git_commit`` from its ``meta.src_tree`` (``bench.commit_of_tree``), rewritten
    in place where they differ; a line a file saying what was done."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import commit_of_tree

    said = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = data.get("meta", {})
        tree = meta.get("src_tree")
        commit = commit_of_tree(tree, root=root) if tree else None
        if commit is None:
            said.append(f"{path}: " + (f"no commit's src/ is tree {tree[:12]}: left as "
                                       f"{meta.get('git_commit')}" if tree else "no meta.src_tree: left alone"))
        elif commit == meta.get("git_commit"):
            said.append(f"{path}: {commit[:7]} already")
        else:
            meta["reported_commit"], meta["git_commit"] = meta.get("git_commit"), commit
            Path(path).write_text(json.dumps(data, indent=1))
            said.append(f"{path}: {meta['reported_commit']} -> {commit[:7]} (its src/)")
    return said


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for line in resolve_commits(args.resolve) if args.resolve else []:
        print(line)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/benchmarks/results_page.py")
            return 1
        return 0
    PAGE.write_text(text)
    if args.plots:
        plot_end_to_end(BENCH / E2E_PLOT)
        plot_multi_gpu(BENCH / MULTI_GPU_PLOT)
    print(f"wrote {PAGE.relative_to(ROOT)}" + (f" and {E2E_PLOT}, {MULTI_GPU_PLOT}" if args.plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
