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
import os
import subprocess
import sys
import time
from pathlib import Path

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
    digest = hashlib.sha256(packed.cpu().numpy().tobytes()).hexdigest()
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
    from bench import write_results

    results = []
    for pair in args.trees.split(","):
        part = f"{args.out}.{pair.partition('=')[0]}.part"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([pair.partition("=")[2], os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", pair, "--out", part], env=env)
        results.append(json.loads(Path(part).read_text()) if done.returncode == 0 else
                       {"tree": pair.partition("=")[0], "status": f"exit {done.returncode}"})
        Path(part).unlink(missing_ok=True)
        print(json.dumps(results[-1]), flush=True)
        write_results(args.out, results, trees=args.trees)


if __name__ == "__main__":
    main()
