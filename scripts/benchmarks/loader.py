"""Training-loader throughput on JPEG shards: samples/s in all and per worker, for the first pass
(read, decode, augment, tokenise) and for the offload re-decode of kept bytes.

    python scripts/benchmarks/loader.py --workers 1,2 --samples 4096 --out loader.json
    python scripts/benchmarks/loader.py --workers 14 --splits shard,indexed --out splits.json   # side by side

Writes ``--images`` distinct JPEGs (``--size`` px, smooth random pictures that compress like
photos) as img2dataset shards, then times ``TrainData.loader`` (ViT-B/32 transforms: 224 px
RandomResizedCrop, open_clip tokenizer) and ``Offload.replay_images`` with each worker count and
each ``data.train.split`` of ``--splits`` (``indexed`` twice: its tar indexes built during the
first pass, ``cold``, then read from the cache, ``warm``). ``--decode gpu``: the workers' part of
``data.decode=gpu`` only (tar members, JPEG headers, crop boxes, captions; no GPU needed), as at 1M
samples a step the loader's workers feed the GPU decoding:

    python scripts/benchmarks/loader.py --workers 1,2 --decode gpu --sub-batch 1024 --samples 8192 --out gpu.json

``--stored-teacher 768``: each measurement also on copies of the shards that carry every sample's teacher
embeddings (``teacher.npy``, float16 ``[1, 2, 768]`` as ``scripts/make_shards.py teacher`` writes them; random
values) read with ``data.train.teacher_key``, side by side with the plain shards (``distill.teacher=stored``):

    python scripts/benchmarks/loader.py --workers 1,2 --decode gpu --sub-batch 1024 --samples 8192 \
        --stored-teacher 768 --out stored_teacher_loader.json
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
import time
from pathlib import Path

from bench import write_results

from megabatch.config.compose import compose
from megabatch.data.synthetic import photo_shards
from megabatch.models import build_model
from megabatch.runtime.process import configure_process


def with_teacher(shards: list[str], width: int, folder: Path) -> list[str]:
    """Copies of ``shards`` in ``folder`` with a random float16 ``teacher.npy`` ``[1, 2, width]`` per sample (the
    layout of ``scripts/make_shards.py teacher``) and their ``teacher.json``."""
    import numpy as np

    from megabatch.data.teacher_store import TeacherSpec, encode_embeddings

    folder.mkdir(parents=True, exist_ok=True)
    rng, out = np.random.default_rng(0), []
    for shard in shards:
        target = folder / Path(shard).name
        out.append(str(target))
        if target.exists():
            continue
        with tarfile.open(shard) as source, tarfile.open(target, "w") as tar:
            for member in source.getmembers():
                data = source.extractfile(member).read()
                tar.addfile(member, io.BytesIO(data))
                if member.name.endswith(".txt"):
                    array = rng.standard_normal((1, 2, width)).astype(np.float32)
                    array = (array / np.linalg.norm(array, axis=-1, keepdims=True)).astype(np.float16)
                    payload = encode_embeddings(array)
                    info = tarfile.TarInfo(member.name[:-len("txt")] + "teacher.npy")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    (folder / "teacher.json").write_text(TeacherSpec("teacher.npy", 1, width, (100.0,)).to_json())
    sizes = Path(shards[0]).parent / "sizes.json"  # the same shard names: their sample counts hold
    if sizes.is_file():
        shutil.copy(sizes, folder / sizes.name)
    return out


def measure(urls: list[str], workers: int, samples: int, sub_batch: int, split: str = "shard",
            cache_dir: str | None = None, decode: str = "cpu", teacher: bool = False) -> dict:

    from megabatch.data import TrainData
    from megabatch.data.offload import Offload

    cfg = compose("model=vit_b32", "data=webdataset", f"data.num_workers={workers}", f"data.train.split={split}",
                  *(["distill.teacher=stored", "data.train.teacher_key=teacher.npy"] if teacher else []))
    cfg.data.train.urls = urls
    if cache_dir:
        cfg.data.cache_dir = cache_dir
    model = build_model(cfg.model)  # its tokenizer and preprocessing
    data = TrainData(cfg.data, model.tokenizer(), model.preprocess, seed=0)
    batches = samples // sub_batch
    loader = data.loader(epoch=0, start_batch=0, rank_batch=sub_batch, rank=0, world_size=1,
                         num_batches=batches + 1, sub_batch=sub_batch, keep_raw=True, gpu_decode=decode == "gpu")
    raws, start = [], None
    for index, sub in enumerate(loader):
        if index == 0:  # worker start-up and the first batch are not throughput
            start = time.perf_counter()
            continue
        raws.append(sub.raw)
    first_pass = (len(raws) * sub_batch) / (time.perf_counter() - start)
    if decode == "gpu":  # the workers' part only (tar members, JPEG headers, crop boxes, captions)
        return {"split": split, "decode": decode, "workers": workers, "samples": len(raws) * sub_batch,
                "sub_batch": sub_batch, "first_pass_samples_s": first_pass,
                "first_pass_per_worker": first_pass / max(1, workers)}
    offload = Offload(data.transform, seed=0, workers=workers)
    start = time.perf_counter()
    count = sum(images.shape[0] for images in offload.replay_images(raws, epoch=0))
    redecode = count / (time.perf_counter() - start)
    offload.close()
    return {"split": split, "decode": decode, "workers": workers, "samples": len(raws) * sub_batch,
            "sub_batch": sub_batch, "first_pass_samples_s": first_pass,
            "first_pass_per_worker": first_pass / max(1, workers),
            "redecode_samples_s": redecode, "redecode_per_worker": redecode / max(1, workers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--samples", type=int, default=4096, help="timed samples per pass")
    parser.add_argument("--sub-batch", type=int, default=256)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--workdir", default="/tmp/loader-bench")
    parser.add_argument("--splits", default="shard", help="data.train.split values, side by side")
    parser.add_argument("--decode", default="cpu", choices=("cpu", "gpu"),
                        help="the workers' work for data.decode: cpu (decode and crop; then the offload "
                             "re-decode) or gpu (tar members, JPEG headers and crop boxes: no GPU needed)")
    parser.add_argument("--stored-teacher", type=int, default=0, metavar="WIDTH",
                        help="also read shards carrying teacher embeddings of this width, side by side")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    configure_process()  # what train.py sets first, before CUDA starts: the decoding streams' queues
    shards = photo_shards(args.images, args.size, Path(args.workdir) / "shards", per_shard=512)
    mean_kb = sum(Path(s).stat().st_size for s in shards) / args.images / 1e3
    copies = 4 * -(-args.samples // args.images) + 1
    urls = shards * copies
    stored = with_teacher(shards, args.stored_teacher, Path(args.workdir) / "stored") * copies \
        if args.stored_teacher else None
    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        cache = Path(args.workdir) / f"cache-{workers}"
        shutil.rmtree(cache, ignore_errors=True)  # the indexed split's first pass builds its indexes
        for split in args.splits.split(","):
            for index_cache in ("cold", "warm") if split == "indexed" else ("",):
                for teacher in (False, True) if stored else (False,):
                    row = measure(stored if teacher else urls, workers, args.samples, args.sub_batch, split,
                                  str(cache), args.decode, teacher)
                    row["index_cache"] = index_cache or None
                    row["stored_teacher_width"] = args.stored_teacher if teacher else None
                    print(json.dumps(row), flush=True)
                    results.append(row)
                    write_results(args.out, results, jpeg_kb_per_sample=mean_kb)


if __name__ == "__main__":
    main()
