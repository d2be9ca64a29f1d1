"""Write image-caption webdataset shards in the img2dataset layout (key.png|jpg, key.txt, key.json).

    python scripts/make_shards.py digits --out ~/.cache/megabatch/digits      # the embedded data
    python scripts/make_shards.py folder --src photos/ --out shards/ --prefix train
    python scripts/make_shards.py table --src captions.csv --out shards/ [--path-key path --caption-key caption]
    python scripts/make_shards.py index '/data/cc12m/{00000..01242}.tar'      # sizes.json for any shards

A folder's captions come from a .txt beside each image (else "a photo of a <folder name>"); a table
is a CSV with a header, or JSONL, naming each image's path (relative to the table) and caption.
A sizes.json with each shard's sample count is written beside the shards. `index` writes one for
shards made elsewhere (img2dataset's <shard>_stats.json counts, else one scan of each tar's headers).
"""

import argparse
import logging
import os

from megabatch.data.digits import digit_samples
from megabatch.data.shard_writer import (
    samples_from_folder,
    samples_from_table,
    shard_pattern,
    write_shards,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=["digits", "folder", "table", "index"])
    parser.add_argument("pattern", nargs="?", help="index: the shards, a brace pattern (quote it)")
    parser.add_argument("--src", help="image folder (folder) or CSV/JSONL file (table)")
    parser.add_argument("--out", help="output folder for the .tar shards (all but index)")
    parser.add_argument("--prefix", default="train", help="shard name prefix (digits: ignored)")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--path-key", default="path", help="table column holding the image path")
    parser.add_argument("--caption-key", default="caption", help="table column holding the caption")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.source == "index":
        return index(parser, args.pattern)
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


if __name__ == "__main__":
    main()
