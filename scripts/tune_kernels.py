"""Autotune the Triton loss kernels' tile configs on this GPU and write them as JSON.

    python scripts/tune_kernels.py --dims 512,768 --dtypes bf16,fp32 --out tuned.json
    python scripts/tune_kernels.py --kernels stats,grad,sigmoid,distill_stats,distill_grad --missing --merge \
        --out tuned_missing.json

The output has the layout of ``src/megabatch/kernels/tuned.json`` ({gpu name: {key: config}}, and under
``_devices`` each GPU's compute capability and SM count); ``--merge`` folds it into that committed file, so fresh
GPU machines start tuned: these GPUs, and any GPU of the same capability and SM count for the keys its own
table lacks. ``--missing`` tunes only the keys that file lacks for this GPU (dims that share a key, 768 and 1024,
are tuned once).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from megabatch.kernels import triton_tiles

DTYPES = {"bf16": (torch.bfloat16, "tf32"), "fp16": (torch.float16, "tf32"),
          "fp32": (torch.float32, "tf32"), "fp32_ieee": (torch.float32, "ieee")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="512,768")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--kernels", default="stats,grad,sigmoid")
    parser.add_argument("--size", type=int, default=16384, help="rows and columns of the tuning block")
    parser.add_argument("--out", required=True)
    parser.add_argument("--merge", action="store_true", help="also merge into the committed tuned.json")
    parser.add_argument("--missing", action="store_true", help="only the keys tuned.json lacks for this GPU")
    args = parser.parse_args()
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    out = Path(args.out)
    todo = to_tune(gpu, args.dtypes.split(","), [int(d) for d in args.dims.split(",")], args.kernels.split(","),
                   args.missing)
    print(f"{gpu}: {len(todo)} kernel configs to tune", flush=True)
    for kernel, dtype, dim, precision, key in todo:
        start = time.perf_counter()
        config = triton_tiles.tune(kernel, dtype, dim, precision, device, size=args.size)
        print(f"{gpu} {key}: {config} ({time.perf_counter() - start:.0f} s)", flush=True)
        record = triton_tiles.device_record(device)
        triton_tiles.save_config(gpu, key, config, out, record)
        if args.merge:
            triton_tiles.save_config(gpu, key, config, triton_tiles.TUNED_FILE, record)


def to_tune(gpu: str, dtypes: list[str], dims: list[int], kernels: list[str], missing: bool,
            tuned_file: Path = triton_tiles.TUNED_FILE) -> list[tuple]:
    """``(kernel, dtype, dim, precision, key)`` for each config to tune, each key once (widths that share a bucket
    share it); with ``missing``, only the keys ``tuned_file`` lacks for ``gpu``."""
    known = set(json.loads(tuned_file.read_text()).get(gpu, {})) if missing and tuned_file.exists() else set()
    todo, seen = [], set()
    for dtype_name in dtypes:
        if dtype_name not in DTYPES:
            raise SystemExit(f"--dtypes {dtype_name}: one of {', '.join(DTYPES)}")
        dtype, precision = DTYPES[dtype_name]
        for dim in dims:
            for kernel in kernels:
                key = triton_tiles.config_key(kernel, dtype, dim, precision)
                if key not in known and key not in seen:
                    seen.add(key)
                    todo.append((kernel, dtype, dim, precision, key))
    return todo


if __name__ == "__main__":
    main()
