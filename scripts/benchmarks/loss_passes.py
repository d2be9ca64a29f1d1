"""The loss kernels pass by pass, TFLOP/s and share of the GPU's bf16 peak, for several source trees side by side.

    python scripts/benchmarks/loss_passes.py --trees before=before/src,after=src --batches 256k,1M --dims 512,768 \\
        --out loss_passes.json

One process per tree (its ``megabatch`` imported from the tree's ``src``), the same features in each. Passes, on
one ``b x b`` block with positives on the diagonal (the one-GPU loss):
- ``stats``: the forward, both directions' log-sum-exps (``block_stats``): one ``b^2 c`` GEMM's FLOPs (2 b^2 c);
- ``grad_kernel``: the backward's kernel alone, ``G'`` written block by block (no GEMMs): one GEMM's FLOPs;
- ``backward``: the whole backward (``block_grads``: the kernel and cuBLAS's two GEMMs): three GEMMs' FLOPs;
- ``loss``: ``stats`` then ``backward``, four GEMMs' FLOPs (the recomputed logits counted);
- ``sigmoid`` (with ``--passes``): the sigmoid loss and its gradients in one pass (``sigmoid_block``: the kernel and
  cuBLAS's two GEMMs), three GEMMs' FLOPs;
- ``distill`` (with ``--passes``): the distillation term's statistics and its pass with the gradients
  (``distill_stats``, the student's and the teacher's ``block_stats``, then ``distill_block``; a tree from before
  2026-12-06: ``distill_stats``, one kernel, then ``distill_grads``) with a teacher as wide as the student (the
  student's features swapped), six GEMMs' FLOPs;
- ``distill_stats`` (with ``--passes``): its statistics alone, the student's and the teacher's logits: two GEMMs'.
``--dtypes``: ``bf16`` features, or ``fp32_bf16_values`` (fp32 holding bf16 values, as GradCache's phase 2 calls the
loss: the kernels' dots in bf16, ``G'`` and the GEMMs fp32 with TF32). ``--configs``: tile configs (JSON objects)
tried on the kernels besides each tree's own (``kernels/tuned.json``): a config's rows time each pass with it, the
distillation's kernels all taking it (its pass with the gradients is ``distill`` less ``distill_stats``).
On a GPU each row also has the SM clock over its timed calls (``sm_mhz``: the median of nvidia-smi's samples, with
the lowest and highest), the median power draw and the reasons the driver held the clock down (``clock_limits``):
the peak assumes 1,830 MHz, and an H100 at its 700 W cap ran these passes at 1,440-1,620 MHz (2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started

PEAK_BF16_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0}
PASS_GEMMS = {"stats": 1, "grad_kernel": 1, "backward": 3, "loss": 4, "sigmoid": 3, "distill": 6, "distill_stats": 2}
PASSES = ("stats", "grad_kernel", "backward")
DTYPES = ("bf16", "fp32_bf16_values")


def measure(tree: str, name: str, batches: list[int], dims: list[int], dtypes: list[str], configs: list[dict],
            repeats: int, wanted: tuple = PASSES) -> list[dict]:
    """Every pass in ``tree`` (its ``src`` first on the path), a row each."""
    sys.path.insert(0, str(Path(tree).resolve()))
    import torch
    from bench import ClockSampler

    from megabatch.kernels import triton_tiles as tt

    assert Path(tt.__file__).resolve().is_relative_to(Path(tree).resolve()), tt.__file__
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: TRITON_INTERPRET=1, a smoke test
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = PEAK_BF16_TFLOPS.get(gpu)
    rows_out = []

    clocks = {}

    def timed(fn, pass_name: str) -> float:
        fn()  # compile, tune, warm
        times = []
        with ClockSampler(device) as sampler:
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        clocks[pass_name] = sampler.summary()
        return min(times)

    for b in batches:
        for c in dims:
            image, text, scale, weight = unit_features(b, c, device)
            for dtype_name in dtypes:
                rows, cols = image.bfloat16(), text.bfloat16()
                dots = None
                if dtype_name == "fp32_bf16_values":
                    rows, cols, dots = rows.float(), cols.float(), torch.bfloat16
                own = {kernel: tt.get_config(kernel, rows.to(dots) if dots else rows, "tf32")
                       for kernel in ("stats", "grad")}
                for config in [None, *configs]:
                    stats_config = config or own["stats"]
                    grad_config = config or own["grad"]
                    operands = tt._dot_operands(rows, cols, dots)
                    lse = tt.block_stats(rows, cols, scale, config=stats_config, dots_dtype=dots)
                    passes = {  # called in this iteration only
                        "stats": partial(tt.block_stats, rows, cols, scale, config=stats_config, dots_dtype=dots),
                        "grad_kernel": partial(tt._grad_launch, rows, cols, scale, *lse, True, "tf32", grad_config,
                                               dots=operands),
                        "backward": partial(tt.block_grads, rows, cols, scale, *lse, weight, True,
                                            config=grad_config, dots_dtype=dots),
                        "sigmoid": partial(sigmoid_pass, tt, rows, cols, scale, dots, config),
                        "distill": partial(distill_pass, tt, rows, cols, scale, weight, dots, config),
                        "distill_stats": partial(distill_stats_pass, tt, rows, cols, scale, dots, config),
                    }
                    passes = {key: fn for key, fn in passes.items() if key in wanted}
                    seconds = {}
                    for pass_name, fn in passes.items():
                        try:
                            seconds[pass_name] = timed(fn, pass_name)
                        except Exception as error:  # a config this GPU cannot run (shared memory, registers)
                            seconds[pass_name] = None
                            print(f"{name} b={b} c={c} {dtype_name} {config}: {pass_name} {type(error).__name__}",
                                  file=sys.stderr)
                    if seconds.get("stats") is not None and seconds.get("backward") is not None:
                        seconds["loss"] = seconds["stats"] + seconds["backward"]
                    narrow = operands[0]  # the dtype the kernels' dots take (their configs' key)
                    tiles = {"stats": stats_config, "grad_kernel": grad_config, "backward": grad_config,
                             "loss": grad_config, "sigmoid": config or tt.get_config("sigmoid", narrow, "tf32"),
                             "distill": [config or tt.get_config(kernel, narrow, "tf32")
                                         for kernel in (distill_stats_kernel(tt), "distill_grad")],
                             "distill_stats": config or tt.get_config(distill_stats_kernel(tt), narrow, "tf32")}
                    for pass_name, s in seconds.items():
                        if s is None:
                            continue
                        tflops = PASS_GEMMS[pass_name] * 2 * b * b * c / s / 1e12
                        row = {"tree": name, "batch": b, "dim": c, "dtype": dtype_name, "pass": pass_name,
                               "config": "own" if config is None else config,
                               "tile": tiles[pass_name],
                               "time_s": s, "tflops": tflops, "peak_share": tflops / peak if peak else None,
                               **clocks.get(pass_name, {})}
                        rows_out.append(row)
                        print(json.dumps(row), flush=True)
            del image, text
            torch.cuda.empty_cache()
    return rows_out


def unit_features(b: int, c: int, device) -> tuple:
    """The passes' inputs: ``(image, text, scale, weight)``, ``b`` unit rows of width ``c`` each, the text near its
    image (seeded), scale 100 and the loss's weight ``1 / 2b``."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator(device=device).manual_seed(0)
    image = F.normalize(torch.randn(b, c, device=device, generator=generator), dim=-1)
    text = F.normalize(image + 0.8 * torch.randn(b, c, device=device, generator=generator), dim=-1)
    return image, text, torch.tensor(100.0, device=device), torch.tensor(1.0 / (2 * b), device=device)


def sigmoid_pass(tt, rows, cols, scale, dots, config=None):
    """The sigmoid loss's one pass with its gradients (SigLIP's bias, positives on the diagonal); ``config``: its
    kernel's tiles, else the tree's own."""
    import torch

    d_rows, d_cols = torch.zeros(rows.shape, device=rows.device), torch.zeros(cols.shape, device=rows.device)
    bias = torch.tensor(-10.0, device=rows.device)
    return tt.sigmoid_block(rows, cols, scale, bias, True, d_rows, d_cols, dots_dtype=dots, config=config)


def distill_stats_kernel(tt) -> str:
    """The kernel that takes the distillation term's statistics in ``tt``'s tree (its tiles' key)."""
    return "stats" if hasattr(tt, "distill_block") else "distill_stats"


def distill_stats_pass(tt, rows, cols, scale, dots, config=None):
    """The distillation term's statistics, the teacher the student's features swapped: the student's and the
    teacher's log-sum-exps, ``([2, m], [2, n])`` (``distill_stats``: ``block_stats`` of each; a tree from before
    2026-12-06 made both tiles in one kernel and gave the teacher-weighted logits as a third row)."""
    import torch

    stats = tt.distill_stats(rows, cols, cols, rows, scale, 100.0, dots_dtype=dots, config=config)
    return torch.stack([stats[0][0], stats[0][1]]), torch.stack([stats[1][0], stats[1][1]])


def distill_pass(tt, rows, cols, scale, weight, dots, config=None):
    """The distillation term's passes with its gradients, the teacher the student's features swapped (as wide,
    another matrix); ``config``: every kernel's tiles, else the tree's own."""
    import torch

    lse = distill_stats_pass(tt, rows, cols, scale, dots, config)
    d_rows, d_cols = torch.zeros(rows.shape, device=rows.device), torch.zeros(cols.shape, device=rows.device)
    if not hasattr(tt, "distill_block"):
        return tt.distill_grads(rows, cols, cols, rows, scale, 100.0, *lse, weight, d_rows, d_cols, dots_dtype=dots,
                                config=config)
    return tt.distill_block(rows, cols, cols, rows, scale, 100.0, *lse, float(weight), d_rows, d_cols,
                            dots_dtype=dots, config=config)


def main() -> None:
    from megabatch.config import parse_count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="this=src",
                        help="name=src-path pairs, comma-separated, run in turn; name=src-path@KEY=VALUE sets an "
                             "environment variable for that tree (MEGABATCH_LOSS_G_FP16=0: fp32 G' and TF32 GEMMs)")
    parser.add_argument("--batches", default="256k")
    parser.add_argument("--dims", default="512,768")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--configs", default="[]", help="a JSON list of tile configs tried besides the trees' own")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", default=",".join(PASSES),
                        help=f"of {', '.join(PASS_GEMMS)} (loss: stats plus backward, which it adds)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    passes = tuple(args.passes.split(","))
    unknown = [name for name in passes if name not in PASS_GEMMS]
    if unknown:
        parser.error(f"--passes: {', '.join(unknown)} unknown; take some of {', '.join(PASS_GEMMS)}")
    if "loss" in passes:  # the sum of the forward and the backward: measured with them (else it had no row)
        passes = tuple(dict.fromkeys([*passes, "stats", "backward"]))
    batches = [parse_count(b, "--batches") for b in args.batches.split(",")]
    dims = [int(c) for c in args.dims.split(",")]
    dtypes, configs = args.dtypes.split(","), json.loads(args.configs)
    if args.worker:  # one tree, in a process of its own
        name, _, tree = args.worker.partition("=")
        tree = tree.partition("@")[0]
        Path(args.out).write_text(json.dumps(measure(tree, name, batches, dims, dtypes, configs, args.repeats,
                                                   passes)))
        return
    from bench import run_trees, write_results

    def done(per_tree: list) -> None:  # a tree's rows, or its failure
        rows = [row for result in per_tree for row in (result if isinstance(result, list) else [result])]
        write_results(args.out, rows, trees=args.trees, passes=PASS_GEMMS)

    run_trees(__file__, args.trees, args.out, done)


if __name__ == "__main__":
    main()
