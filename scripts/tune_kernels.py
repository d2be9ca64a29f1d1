"""Autotune the Triton loss kernels' tile configs on this GPU and write them as JSON.

    python scripts/tune_kernels.py --dims 512,768 --dtypes bf16,fp32 --out tuned.json
    python scripts/tune_kernels.py --kernels stats,grad,sigmoid,distill_grad --missing --merge \
        --out tuned_missing.json

The output has the layout of ``src/megabatch/kernels/tuned.json`` ({gpu name: {key: config}}, and under
``_devices`` each GPU's compute capability and SM count); ``--merge`` folds it into that committed file, so fresh
GPU machines start tuned: these GPUs, and any GPU of the same capability and SM count for the keys its own
table lacks. ``--missing`` tunes only the keys that file lacks for this GPU (dims that share a key, 768 and 1024,
are tuned once). ``--check`` launches every config this GPU would take from that file (its own, and a GPU's of the
same capability and SM count where its own lacks the key) and tunes again those that no longer fit it (shared
memory or registers: a config tuned before a kernel changed); with ``--merge`` the new ones replace them, and a
same-SM GPU's identical config is dropped, so that GPU takes the new one:

    python scripts/tune_kernels.py --check --merge --out tuned_check.json

``--timings`` also writes each candidate's median time and the picks (``{"meta": {..., "picks"}, "results"}``, as the
benchmarks write theirs; the results page draws it as a ``tune`` table):

    python scripts/tune_kernels.py --size 24576 --dims 512,768 --dtypes bf16 --kernels sigmoid --out tuned.json \
        --timings tune_sigmoid.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megabatch.kernels import triton_tiles

sys.path.insert(0, str(Path(__file__).resolve().parent / "benchmarks"))  # bench: the benchmarks' JSON layout
from bench import write_results  # noqa: E402

DTYPES = {"bf16": (torch.bfloat16, "tf32"), "fp16": (torch.float16, "tf32"),
          "fp32": (torch.float32, "tf32"), "fp32_ieee": (torch.float32, "ieee")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", default="512,768")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--kernels", default="stats,grad,sigmoid")
    parser.add_argument("--size", type=int, default=16384, help="rows and columns of the tuning block")
    parser.add_argument("--out", required=True)
    parser.add_argument("--timings", default=None,
                        help="also write every candidate's median time and the picks here (JSON, with the run's meta)")
    parser.add_argument("--merge", action="store_true", help="also merge into the committed tuned.json")
    parser.add_argument("--missing", action="store_true", help="only the keys tuned.json lacks for this GPU")
    parser.add_argument("--check", action="store_true",
                        help="only the configs this GPU takes from tuned.json that no longer fit it")
    args = parser.parse_args()
    unknown = [k for k in args.kernels.split(",") if k not in triton_tiles.KERNELS]
    if unknown:
        parser.error(f"--kernels: {', '.join(unknown)} unknown; take some of {', '.join(triton_tiles.KERNELS)}")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    record = triton_tiles.device_record(device)
    out = Path(args.out)
    if args.check:
        todo, stale = misfits(gpu, record, device)
    else:
        todo = to_tune(gpu, args.dtypes.split(","), [int(d) for d in args.dims.split(",")], args.kernels.split(","),
                       args.missing)
        stale = {}
    print(f"{gpu}: {len(todo)} kernel configs to tune", flush=True)
    timings, picks = [], {}
    for kernel, dtype, dim, precision, key in todo:
        start = time.perf_counter()
        config = triton_tiles.tune(kernel, dtype, dim, precision, device, size=args.size, timings=timings)
        print(f"{gpu} {key}: {config} ({time.perf_counter() - start:.0f} s)", flush=True)
        picks[key] = config
        if args.timings:  # after every key: a run cut short keeps what it timed
            write_results(args.timings, timings, picks=picks)
        triton_tiles.save_config(gpu, key, config, out, record)
        if args.merge:
            triton_tiles.save_config(gpu, key, config, triton_tiles.TUNED_FILE, record)
            drop_siblings(key, stale.get(key), record)


def parse_key(key: str) -> tuple[str, torch.dtype, int, str]:
    """``(kernel, dtype, dim, precision)`` of a ``config_key``: the width this script tunes its bucket at (c1024:
    768, as ``--dims 512,768`` does)."""
    kernel, dtype_name, precision, bucket = key.split("/")
    width = int(bucket.removeprefix("c"))
    return kernel, getattr(torch, dtype_name), 768 if width == 1024 else width, \
        "tf32" if precision == "native" else precision


def taken_configs(gpu: str, record: dict, tuned_file: Path = triton_tiles.TUNED_FILE) -> dict[str, dict]:
    """Each key's config this GPU takes from ``tuned_file``: its own, else the first same-record GPU's by name."""
    shipped = json.loads(tuned_file.read_text()) if tuned_file.exists() else {}
    taken = dict(shipped.get(gpu, {}))
    for key in sorted({key for name, table in shipped.items() if name != triton_tiles.DEVICES for key in table}):
        if key not in taken and (sibling := triton_tiles.sibling_config(gpu, key, lambda: record, shipped)):
            taken[key] = sibling[1]
    return taken


def misfits(gpu: str, record: dict, device) -> tuple[list[tuple], dict[str, dict]]:
    """``to_tune``'s rows for the configs this GPU takes that do not fit it, and each such key's config."""
    todo, stale = [], {}
    for key, config in sorted(taken_configs(gpu, record).items()):
        kernel, dtype, dim, precision = parse_key(key)
        ok = triton_tiles.fits(kernel, dtype, dim, precision, config, device)
        print(f"{gpu} {key}: {config} {'fits' if ok else 'does NOT fit'}", flush=True)
        if not ok:
            todo.append((kernel, dtype, dim, precision, key))
            stale[key] = config
    return todo, stale


def drop_siblings(key: str, config: dict | None, record: dict, tuned_file: Path = triton_tiles.TUNED_FILE) -> None:
    """Drop ``key``'s ``config`` (one that did not fit) from the other GPUs of ``record`` in ``tuned_file``: they take
    the new one from the GPU that tuned it."""
    if config is None:
        return
    data = json.loads(tuned_file.read_text())
    for other, mine in data.get(triton_tiles.DEVICES, {}).items():
        if mine == record and data.get(other, {}).get(key) == config:
            del data[other][key]
    tuned_file.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


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
