"""Write image-caption webdataset shards in the img2dataset layout (key.png|jpg, key.txt, key.json).

    python scripts/make_shards.py digits --out ~/.cache/megabatch/digits      # the embedded data
    python scripts/make_shards.py folder --src photos/ --out shards/ --prefix train
    python scripts/make_shards.py table --src captions.csv --out shards/ [--path-key path --caption-key caption]

A folder's captions come from a .txt beside each image (else "a photo of a <folder name>"); a table
is a CSV with a header, or JSONL, naming each image's path (relative to the table) and caption.
A sizes.json with each shard's sample count is written beside the shards.
"""

import argparse
import logging

from megabatch.data.digits import digit_samples
from megabatch.data.shard_writer import (
    samples_from_folder,
    samples_from_table,
    shard_pattern,
    write_shards,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=["digits", "folder", "table"])
    parser.add_argument("--src", help="image folder (folder) or CSV/JSONL file (table)")
    parser.add_argument("--out", required=True, help="output folder for the .tar shards")
    parser.add_argument("--prefix", default="train", help="shard name prefix (digits: ignored)")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--path-key", default="path", help="table column holding the image path")
    parser.add_argument("--caption-key", default="caption", help="table column holding the caption")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

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


if __name__ == "__main__":
    main()
