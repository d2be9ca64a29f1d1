"""The loss kernels' hardware counters on one GPU, read by Nsight Compute (``ncu``): each pass (``stats``, ``backward``,
``sigmoid``, ``distill``; ``loss_passes.py``'s) run once (an ncu run a pass) on one block of ``--batch`` rows (bf16,
the tree's tuned tiles) inside the profiler's range, every kernel it launches (Triton's and cuBLAS's) a row: its time
and how busy it kept each part of the GPU, as shares of that part's peak: the tensor cores, the exponential unit (XU,
``MUFU``), the FMA and ALU pipes, instruction issue, L2 and DRAM; L2's bytes per FLOP and where the warps waited
(ncu's stall reasons, cycles a warp spent stalled for each reason per instruction it issued). A kernel held by L2 shows
L2 near its peak and the tensor cores far from theirs; one held by its epilogue shows issue or XU near theirs.

    python scripts/benchmarks/kernel_counters.py --batch 24576 --dims 512,768 --out counters.json

Needs ``ncu`` on the PATH (else ``--ncu``) with access to the GPU's counters; the clocks are left as they run
(``--clock-control none``). ncu replays each kernel once per group of counters, so a pass takes seconds here, not
milliseconds; the times are each kernel's own (``gpu__time_duration``), caches flushed before it, at the SM clock it
ran at (``sm_hz``): a kernel replayed alone is not held by the GPU's power cap as a pass of many is (an H100 at
700 W ran the 256k passes at 1,440-1,620 MHz, ``loss_passes.py``'s ``sm_mhz``), so its time here is its floor.
On an H100 with ncu 2025.3 the warpgroup (GMMA) counter reads n/a: ``tensor_hmma`` counts every tensor-core
instruction there (cuBLAS's GEMMs 97%).
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # this checkout's kernels

PASSES = ("stats", "backward", "sigmoid", "distill")
# each Triton kernel's dots (b^2 c GEMMs' FLOPs); a pass may launch several (the distillation term's: the student's and
# the teacher's statistics, then its G kernel)
TRITON = {"_stats_kernel": 1, "_grad_kernel": 1, "_sigmoid_kernel": 1, "_distill_grad_kernel": 2}
GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass")  # cuBLAS's GEMM kernels: one b^2 c GEMM each on a square block
SHARES = {  # column: counter (a share of its peak, in %)
    "tensor": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_hmma": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "xu": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "fma": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "alu": "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "l2": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "warps": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
AMOUNTS = {"time_ns": "gpu__time_duration.sum", "sm_hz": "sm__cycles_elapsed.avg.per_second",
           "l2_bytes": "lts__t_bytes.sum",
           "dram_read_bytes": "dram__bytes_read.sum", "dram_write_bytes": "dram__bytes_write.sum"}
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "mio_throttle", "math_pipe_throttle", "wait",
          "lg_throttle", "dispatch_stall", "not_selected", "selected", "sleeping", "membar", "no_instruction",
          "branch_resolving", "drain", "tex_throttle", "misc", "imc_miss")
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def counters() -> list[str]:
    return [*SHARES.values(), *AMOUNTS.values(), *(STALL.format(reason) for reason in STALLS)]


def find_ncu(given: str | None) -> str:
    found = given or shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if not found:
        raise SystemExit("kernel_counters.py: no ncu on the PATH or in /opt/nvidia/nsight-compute: give --ncu PATH")
    return found


def unknown_counters(stderr: str, asked: list[str]) -> list[str]:
    """The counters of ``asked`` an ncu run's errors name as unknown to it or to the GPU (one such counter stops the
    whole run, so the run is repeated without them)."""
    return [name for name in asked if name in stderr or name.split(".")[0] in stderr]


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def rows_of(csv_text: str, b: int, c: int, pass_name: str) -> list[dict]:
    """ncu's raw page (one line a kernel, a line of units after the header) of one pass (``pass_name``: ncu runs the
    worker once a pass) as rows, each kernel with its FLOPs: a Triton kernel's dots (``TRITON``; none for a launch
    right after one of the same kernel, the checked shift's redo), one GEMM for each of cuBLAS's."""
    lines = [line for line in csv_text.splitlines() if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(table) < 3:
        return []
    header, records = table[0], table[2:]
    rows, previous = [], None
    for record in records:
        values = dict(zip(header, record, strict=False))
        name = values.get("Kernel Name", "")
        triton = next((kernel for kernel in TRITON if name.startswith(kernel)), None)
        gemms = None
        if triton:
            gemms = None if triton == previous else TRITON[triton]
        elif any(part in name.lower() for part in GEMM_NAMES):
            gemms = 1
        previous = triton
        row = {"pass": pass_name, "dim": c, "batch": b, "kernel": triton or name[:120],
               "grid": values.get("Grid Size"), "block": values.get("Block Size")}
        for column, metric in {**AMOUNTS, **SHARES}.items():
            row[column] = number(values[metric]) if metric in values else None
        row["stalls"] = {reason: number(values[STALL.format(reason)]) for reason in STALLS
                         if STALL.format(reason) in values}
        flops = gemms * 2 * b * b * c if gemms else None
        row["flops"] = flops
        seconds = row["time_ns"] * 1e-9 if row.get("time_ns") else None
        row["tflops"] = flops / seconds / 1e12 if flops and seconds else None
        row["l2_bytes_per_flop"] = row["l2_bytes"] / flops if flops and row.get("l2_bytes") else None
        rows.append(row)
    return rows


def worker(b: int, c: int, passes: list[str]) -> None:
    """Each pass warmed (compiled, its tiles looked up), then run once between cudaProfilerStart and Stop."""
    import torch
    from loss_passes import distill_pass, sigmoid_pass, unit_features

    from megabatch.kernels import triton_tiles as tt

    image, text, scale, weight = unit_features(b, c, torch.device("cuda"))
    rows, cols = image.bfloat16(), text.bfloat16()
    lse = tt.block_stats(rows, cols, scale)
    calls = {"stats": partial(tt.block_stats, rows, cols, scale),
             "backward": partial(tt.block_grads, rows, cols, scale, *lse, weight, True),
             "sigmoid": partial(sigmoid_pass, tt, rows, cols, scale, None),
             "distill": partial(distill_pass, tt, rows, cols, scale, weight, None)}
    for name in passes:
        calls[name]()
        calls[name]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        calls[name]()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=24576, help="rows and columns of the one block (default: one G' "
                        "block's side at the default MEGABATCH_LOSS_G_MIB)")
    parser.add_argument("--dims", default="512,768")
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--ncu", default=None, help="Nsight Compute's command line (default: ncu on the PATH)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", required=False)
    args = parser.parse_args()
    passes = args.passes.split(",")
    unknown = [name for name in passes if name not in PASSES]
    if unknown:
        parser.error(f"--passes: {', '.join(unknown)} unknown; take some of {', '.join(PASSES)}")
    if args.worker is not None:
        worker(args.batch, args.worker, passes)
        return
    if not args.out:
        parser.error("--out is required")
    from bench import write_results

    ncu = find_ncu(args.ncu)
    metrics, dropped, results = counters(), [], []
    for c, pass_name in ((int(d), name) for d in args.dims.split(",") for name in passes):
        for _ in range(6):  # ncu may name one unknown counter a run
            ran = subprocess.run([ncu, "--clock-control", "none", "--profile-from-start", "off", "--metrics",
                                  ",".join(metrics), "--csv", "--page", "raw", sys.executable, __file__, "--worker",
                                  str(c), "--batch", str(args.batch), "--passes", pass_name],
                                 capture_output=True, text=True)
            found = rows_of(ran.stdout, args.batch, c, pass_name)
            unknown = [] if found else unknown_counters(ran.stdout + ran.stderr, metrics)
            if not unknown or len(unknown) == len(metrics):
                break
            print(f"ncu knows no {', '.join(unknown)} here: measured without", file=sys.stderr)
            metrics = [name for name in metrics if name not in unknown]
            dropped += unknown
        if not found:
            results.append({"dim": c, "pass": pass_name,
                            "status": f"exit {ran.returncode}: {ran.stderr.strip()[-400:]}"})
        for row in found:
            results.append(row)
            shares = ", ".join(f"{k} {row[k]:.0f}%" for k in SHARES if row.get(k) is not None)
            print(f"c={c} {row['pass']} {row['kernel'][:40]}: {(row['time_ns'] or 0) / 1e3:.0f} us"
                  + (f", {row['tflops']:.0f} TFLOP/s" if row.get("tflops") else "") + f"; {shares}", flush=True)
        write_results(args.out, results, ncu=ncu, metrics=metrics, unknown_metrics=dropped)


if __name__ == "__main__":
    main()
