"""Write image-caption webdataset shards in the img2dataset layout (key.png|jpg, key.txt, key.json).

    python scripts/make_shards.py digits --out ~/.cache/megabatch/digits      # the embedded data
    python scripts/make_shards.py folder --src photos/ --out shards/ --prefix train
    python scripts/make_shards.py table --src captions.csv --out shards/ [--path-key path --caption-key caption]
    python scripts/make_shards.py index '/data/cc12m/{00000..01242}.tar'      # sizes.json for any shards
    python scripts/make_shards.py teacher '/data/cc12m/{00000..01242}.tar' --out /data/cc12m-l14 \
        --teacher ViT-L-14-quickgelu --pretrained /models/vit_l14_openai.pt    # stored teacher embeddings
    python scripts/make_shards.py image-features '/data/cc12m/{00000..01242}.tar' --out /data/cc12m-b16 \
        --tower ViT-B-16 --pretrained /models/vit_b16.pt                      # a locked tower's features (LiT)

A folder's captions come from a .txt beside each image (else "a photo of a <folder name>"); a table
is a CSV with a header, or JSONL, naming each image's path (relative to the table) and caption.
A sizes.json with each shard's sample count is written beside the shards. `index` writes one for
shards made elsewhere (img2dataset's <shard>_stats.json counts, else one scan of each tar's headers).
`image-features` copies shards with each sample's image features added (`<key>.image.npy`: the tower's
L2-normalised features of the image's centre crop), for `model.image_features=stored
data.train.image_features_key=image.npy` (LiT: the locked tower is not run in training). The tower is an
open_clip architecture with --pretrained weights (a local file), a megabatch checkpoint or an export folder
(--tower), or the model a training run builds (--model 'model=vit_b16_bert model.image.ckpt=...': the same
overrides as train.py's); image_features.json beside the copies holds its fingerprint, and a run with
another tower refuses them.
`teacher` copies shards with each sample's teacher embeddings added (`<key>.teacher.npy`: its image's and
caption's, per teacher; several --teacher: an ensemble), for `distill.teacher=stored
data.train.teacher_key=teacher.npy`: a teacher is an open_clip architecture with --pretrained weights (a
local file), a megabatch checkpoint or an export folder. Both read and decode with --workers loader
processes and run the model on the GPU in bf16 (compiled: --compile/--no-compile), --batch images at a time, on a
GPU their blocks' GELU in the tanh form that cuBLASLt's GEMM epilogue computes (--gelu auto: tanh on a GPU, 8% faster
for ViT-L/14, its features as near the float32 model's as the exact GELU's in bf16; exact on the CPU) or exact
(--gelu erf).
Under torchrun each rank writes its share of the shards on its GPU; shards already written are skipped, so an
interrupted run resumes.
"""

import argparse
import logging
import os
from pathlib import Path

from megabatch.data.digits import digit_samples
from megabatch.data.shard_writer import (
    samples_from_folder,
    samples_from_table,
    shard_pattern,
    write_shards,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=["digits", "folder", "table", "index", "teacher", "image-features"])
    parser.add_argument("pattern", nargs="?", help="index, teacher, image-features: the shards, a brace pattern "
                        "(quote it)")
    parser.add_argument("--src", help="image folder (folder) or CSV/JSONL file (table)")
    parser.add_argument("--out", help="output folder for the .tar shards (all but index)")
    parser.add_argument("--prefix", default="train", help="shard name prefix (digits: ignored)")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--path-key", default="path", help="table column holding the image path")
    parser.add_argument("--caption-key", default="caption", help="table column holding the caption (teacher: "
                        "the shards' caption member, default txt)")
    parser.add_argument("--teacher", action="append", default=[], help="teacher: an open_clip architecture, a "
                        "checkpoint or an export folder; repeat for an ensemble")
    parser.add_argument("--pretrained", action="append", default=[], help="teacher: the weights of each "
                        "--teacher given by architecture, in order ('none' for random weights)")
    parser.add_argument("--tower", help="image-features: an open_clip architecture (with --pretrained), a "
                        "checkpoint or an export folder")
    parser.add_argument("--model", help="image-features: the training run's model, as train.py overrides "
                        "(quoted: 'model=vit_b16_bert model.image.ckpt=/models/vit_b16.pt ...')")
    parser.add_argument("--key", help="the member the embeddings go in (teacher: teacher.npy, image-features: "
                        "image.npy)")
    parser.add_argument("--batch", type=int, default=256, help="teacher, image-features: images a forward pass")
    parser.add_argument("--workers", type=int, default=None, help="teacher, image-features: loader processes "
                        "reading and decoding the shards (default: the cores less one, at most 16)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="teacher, image-features: torch.compile the model on a GPU")
    parser.add_argument("--gelu", choices=["auto", "tanh", "erf"], default="auto",
                        help="teacher, image-features: the blocks' GELU while writing: tanh (fused into the GEMM, "
                        "within bf16's rounding of the exact one), erf (exact, one more pass) or auto (tanh on a GPU)")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16",
                        help="teacher, image-features: stored as")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.source == "index":
        return index(parser, args.pattern)
    if args.source == "teacher":
        return teacher(parser, args)
    if args.source == "image-features":
        return image_features(parser, args)
    if args.out is None:
        parser.error(f"{args.source} needs --out")
    if args.source == "digits":
        jobs = {split: digit_samples(split) for split in ("train", "test")}
    elif args.src is None:
        parser.error(f"{args.source} needs --src")
    elif args.source == "folder":
        jobs = {args.prefix: samples_from_folder(args.src)}
    else:
        jobs = {args.prefix: samples_from_table(args.src, args.path_key, args.caption_key)}
    for prefix, samples in jobs.items():
        paths = write_shards(samples, args.out, prefix, per_shard=args.per_shard)
        print(f"{prefix}: {shard_pattern(paths)}")


def index(parser: argparse.ArgumentParser, pattern: str | None) -> None:
    from megabatch.config import ConfigError
    from megabatch.data.urls import expand_urls, write_sizes

    if not pattern:
        parser.error("index needs the shards: make_shards.py index '/data/{00000..01242}.tar'")
    try:
        urls = expand_urls(pattern, "pattern")
        written = write_sizes(urls, os.environ.get("MEGABATCH_CACHE", "~/.cache/megabatch"))
    except ConfigError as error:
        parser.error(str(error))
    for path, sizes in written.items():
        print(f"{path}: {len(sizes)} shards, {sum(sizes.values())} samples")


def workers(args) -> int:
    """--workers, or the cores less one (the main process runs the model), at most 16."""
    return args.workers if args.workers is not None else max(1, min(16, (os.cpu_count() or 2) - 1))


def device_of_rank():
    """This rank's ``(rank, world, device)`` under torchrun (one process: rank 0 of 1), its GPU where there is one."""
    import torch

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    return rank, world, torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")


def image_features(parser: argparse.ArgumentParser, args) -> None:
    import numpy as np

    from megabatch.config import ConfigError
    from megabatch.data.urls import expand_urls
    from megabatch.train.step.teacher import write_image_feature_shards

    if not args.pattern or not args.out or bool(args.tower) == bool(args.model):
        parser.error("image-features needs the shards, --out and one of --tower or --model: make_shards.py "
                     "image-features '/data/{00000..00099}.tar' --out /data/b16-features --tower ViT-B-16 --pretrained "
                     "/models/vit_b16.pt")
    rank, world, device = device_of_rank()
    try:
        urls = expand_urls(args.pattern, "pattern")
        model = tower_model(args)
        written = write_image_feature_shards(urls, Path(args.out).expanduser(), model, device,
                                             key=args.key or "image.npy", batch=args.batch,
                                             dtype=getattr(np, args.dtype), rank=rank, world=world,
                                             show_progress=rank == 0, workers=workers(args), compile=args.compile,
                                             gelu=args.gelu)
    except ConfigError as error:
        parser.error(str(error))
    print(f"rank {rank}: wrote {len(written)} shard(s) with image features to {args.out}")


def tower_model(args):
    """The model whose image tower writes the features: --model's training config, or --tower (with
    --pretrained)."""
    from omegaconf import OmegaConf

    from megabatch.config import ConfigError

    if args.model:
        import shlex

        import torch

        from megabatch.config.compose import compose
        from megabatch.config.schema import check_model
        from megabatch.models import build_model

        cfg = compose(*shlex.split(args.model))
        check_model(cfg.model)
        torch.manual_seed(cfg.seed)  # as train.py builds it: the same random weights where none are loaded
        return build_model(cfg.model)
    from megabatch.train.step.teacher import load_teacher_model

    weights = args.pretrained[0] if args.pretrained else None
    try:
        return load_teacher_model(OmegaConf.create({"teacher": args.tower,
                                                    "pretrained": None if weights == "none" else weights}))
    except ConfigError as error:  # the loader names the teacher's keys: these are this command's options
        raise ConfigError(str(error).replace("distill.teacher", "--tower").replace("distill.pretrained",
                                                                                    "--pretrained")) from None


def teacher(parser: argparse.ArgumentParser, args) -> None:
    import numpy as np
    from omegaconf import OmegaConf

    from megabatch.config import ConfigError
    from megabatch.data.urls import expand_urls
    from megabatch.train.step.teacher import (
        Teacher,
        for_inference,
        load_teacher_model,
        write_teacher_shards,
        writing_gelu,
    )

    if not args.pattern or not args.out or not args.teacher:
        parser.error("teacher needs the shards, --out and --teacher: make_shards.py teacher '/data/{00000..00099}.tar' "
                     "--out /data/with-teacher --teacher ViT-L-14 --pretrained /models/vit_l14.pt")
    rank, world, device = device_of_rank()
    pretrained = list(args.pretrained)
    try:
        urls = expand_urls(args.pattern, "pattern")
        teachers = []
        for name in args.teacher:
            weights = None
            if not os.path.exists(name):  # an architecture takes the next --pretrained
                weights = pretrained.pop(0) if pretrained else None
                weights = None if weights in (None, "none") else weights
            model = load_teacher_model(OmegaConf.create({"teacher": name, "pretrained": weights}))
            model = for_inference(model, writing_gelu(args.gelu, device))
            teachers.append((name, Teacher(model, model.logit_scale.exp().item(), device, compile=args.compile)))
        written = write_teacher_shards(urls, Path(args.out).expanduser(), teachers, key=args.key or "teacher.npy",
                                       caption_key=args.caption_key if args.caption_key != "caption" else "txt",
                                       batch=args.batch, dtype=getattr(np, args.dtype), rank=rank, world=world,
                                       show_progress=rank == 0, workers=workers(args))
    except ConfigError as error:
        parser.error(str(error))
    print(f"rank {rank}: wrote {len(written)} shard(s) with teacher embeddings to {args.out}")


if __name__ == "__main__":
    main()
