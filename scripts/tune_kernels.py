"""Autotune the Triton loss kernels' tile configs on this GPU and write them as JSON.

    python scripts/tune_kernels.py --dims 512,768 --dtypes bf16,fp32 --out tuned.json

The output has the layout of ``src/megabatch/kernels/tuned.json`` ({gpu name: {key: config}});
``--merge`` folds it into that committed file, so fresh GPU machines start tuned.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    out = Path(args.out)
    for dtype_name in args.dtypes.split(","):
        dtype, precision = DTYPES[dtype_name]
        for dim in (int(d) for d in args.dims.split(",")):
            for kernel in args.kernels.split(","):
                start = time.perf_counter()
                config = triton_tiles.tune(kernel, dtype, dim, precision, device, size=args.size)
                key = triton_tiles.config_key(kernel, dtype, dim, precision)
                print(f"{gpu} {key}: {config} ({time.perf_counter() - start:.0f} s)", flush=True)
                triton_tiles.save_config(gpu, key, config, out)
                if args.merge:
                    triton_tiles.save_config(gpu, key, config, triton_tiles.TUNED_FILE)


if __name__ == "__main__":
    main()
