"""``data.decode=gpu``'s NaFlex packing alone (``gpu_decode.packed_groups``: crop, resize, patchify, pack), images a
second on the GPU, for several source trees side by side.

    python scripts/benchmarks/naflex_pack.py --trees before=before/src,after=src --out naflex_pack.json

Decoded images (uint8, on the GPU) of ``--sizes`` in equal shares, as nvJPEG hands them over per image size; each
row's crop, resized size and length drawn as the workers draw them (``NaFlexSpec.gpu_row``, webdataset's training
crop: a share in [0.08, 1] of the area, its aspect ratio times [3/4, 4/3]), packed at ``--seq-len`` patches of
``--patch`` px. One process per tree, the same images and boxes in each; the trees' packed bits are compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started


def measure(tree: str, name: str, args) -> dict:
    sys.path.insert(0, str(Path(tree).resolve()))
    import torch

    from megabatch.data import gpu_decode
    from megabatch.data.naflex import NaFlexSpec

    assert Path(gpu_decode.__file__).resolve().is_relative_to(Path(tree).resolve()), gpu_decode.__file__
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = NaFlexSpec(args.patch, args.seq_len, (args.seq_len,), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    generator = torch.Generator().manual_seed(0)
    groups, boxes, row = [], [], 0
    for height, width in sizes:
        count = args.images // len(sizes)
        pixels = torch.randint(0, 256, (count, 3, height, width), dtype=torch.uint8, generator=generator)
        groups.append((list(range(row, row + count)), pixels.to(device)))
        boxes += [spec.gpu_row(height, width, True, args.seq_len, seed) for seed in range(row, row + count)]
        row += count
    boxes = torch.tensor(boxes, dtype=torch.int64)
    size = (args.seq_len, args.patch)

    def run():
        out = gpu_decode.packed_groups(groups, boxes, size, spec.interpolation)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    packed = run()  # warm
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    resized = len({tuple(box) for box in boxes[:, 7:9].tolist()})
    packed = packed.cpu().numpy()
    digest = hashlib.sha256(packed.tobytes()).hexdigest()
    np.save(f"{args.out}.packed.npy", packed)  # beside the worker's part, for compare_packed
    return {"tree": name, "images": row, "sizes": args.sizes, "resized_sizes": resized, "seq_len": args.seq_len,
            "patch": args.patch, "time_s": min(times), "images_per_s": row / min(times), "packed_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="this=src", help="name=src-path pairs, comma-separated, run in turn")
    parser.add_argument("--images", type=int, default=1020)
    parser.add_argument("--sizes", default="256x256,256x384,384x256,256x512,512x256",
                        help="the decoded images' sizes (height x width), in equal shares")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.worker:
        name, _, tree = args.worker.partition("=")
        Path(args.out).write_text(json.dumps(measure(tree, name, args)))
        return
    from bench import run_trees, write_results

    def done(results: list) -> None:
        print(json.dumps(results[-1]), flush=True)
        write_results(args.out, results, trees=args.trees)

    results = run_trees(__file__, args.trees, args.out, done)
    compare_packed(results, args.out)
    write_results(args.out, results, trees=args.trees)


def compare_packed(results: list, out: str) -> None:
    """Each tree's packed bytes against the first tree's: the share of bytes that differ and the largest difference
    (a pixel value), then the saved bytes removed."""
    from bench import part_path

    saved = [Path(f"{part_path(out, result['tree'])}.packed.npy") for result in results]
    first = np.load(saved[0]) if saved[0].exists() else None
    for result, path in zip(results, saved, strict=True):
        if first is not None and path.exists():
            packed = np.load(path)
            if packed.shape == first.shape:
                differ = packed.astype(np.int16) - first.astype(np.int16)
                result["bytes_differing_from_first"] = float((differ != 0).mean())
                result["largest_difference_from_first"] = int(np.abs(differ).max())
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
