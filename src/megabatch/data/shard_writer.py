"""Write image-caption pairs as webdataset shards in the img2dataset layout.

Each sample is ``<key>.<ext>`` (the encoded image), ``<key>.txt`` (the caption) and ``<key>.json``
(metadata), with ``key`` a zero-padded 9-digit index (``000000123``). A ``sizes.json`` beside the
shards maps each shard's file name to its sample count, as OpenCLIP's loaders expect.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import webdataset as wds

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


@dataclass
class Sample:
    """One image-caption pair; ``image`` holds encoded bytes (PNG/JPEG/WebP) of type ``ext``."""

    image: bytes
    ext: str
    caption: str
    meta: dict = field(default_factory=dict)


def write_shards(
    samples: Iterable[Sample], out_dir: str | os.PathLike, prefix: str, per_shard: int = 1000
) -> list[str]:
    """Write ``samples`` to ``out_dir/<prefix>-000000.tar, ...``; return the shard paths.

    Shards are written into a temporary directory and moved into place at the end, so a crash
    never leaves a half-written shard under its final name.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tmp-") as tmp:
        pattern = os.path.join(tmp, f"{prefix}-%06d.tar")
        count = 0
        with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
            for index, sample in enumerate(samples):
                key = f"{index:09d}"
                meta = {"key": key, "caption": sample.caption, **sample.meta}
                ext = sample.ext.lower().lstrip(".")
                ext = "jpg" if ext == "jpeg" else ext
                sink.write(
                    {"__key__": key, ext: sample.image, "txt": sample.caption, "json": meta}
                )
                shard = f"{prefix}-{index // per_shard:06d}.tar"
                sizes[shard] = sizes.get(shard, 0) + 1
                count += 1
        if count == 0:
            raise ValueError(f"no samples to write for {out_dir}/{prefix}-*.tar")
        paths = []
        for name in sorted(sizes):
            shutil.move(os.path.join(tmp, name), out_dir / name)
            paths.append(str(out_dir / name))
    sizes_path = out_dir / "sizes.json"
    existing = json.loads(sizes_path.read_text()) if sizes_path.exists() else {}
    existing.update(sizes)
    sizes_path.write_text(json.dumps(existing, indent=1, sort_keys=True))
    log.info("wrote %d samples in %d shards to %s/%s-*.tar", count, len(paths), out_dir, prefix)
    return paths


def shard_pattern(paths: list[str]) -> str:
    """Brace pattern for consecutive shard paths: ``dir/train-{000000..000002}.tar``."""
    if len(paths) == 1:
        return paths[0]
    first, last = Path(paths[0]), Path(paths[-1])
    stem, start = first.stem.rsplit("-", 1)
    end = last.stem.rsplit("-", 1)[1]
    return str(first.parent / f"{stem}-{{{start}..{end}}}.tar")


def _read_image(path: Path) -> Sample:
    return Sample(image=path.read_bytes(), ext=path.suffix, caption="")


def samples_from_folder(root: str | os.PathLike) -> Iterator[Sample]:
    """Images under ``root`` (recursively, sorted). The caption of ``a/b.jpg`` is ``a/b.txt`` when
    present, else ``"a photo of a <parent folder name>"`` (an ImageFolder-style class folder)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    found = False
    for path in sorted(root.rglob("*")):
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        found = True
        sample = _read_image(path)
        sidecar = path.with_suffix(".txt")
        if sidecar.exists():
            sample.caption = sidecar.read_text().strip()
        else:
            sample.caption = f"a photo of a {path.parent.name.replace('_', ' ')}"
        sample.meta = {"source": str(path.relative_to(root))}
        yield sample
    if not found:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")


def samples_from_table(
    table: str | os.PathLike, path_key: str = "path", caption_key: str = "caption"
) -> Iterator[Sample]:
    """Rows of a CSV (with header) or JSONL file naming an image ``path_key`` and a caption.

    Relative image paths are resolved against the table's folder. A row whose image is missing is
    skipped with a warning and counted.
    """
    table = Path(table)
    if table.suffix.lower() in (".jsonl", ".json"):
        with open(table) as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
    else:
        with open(table, newline="") as handle:
            rows = list(csv.DictReader(handle))
    if rows and (path_key not in rows[0] or caption_key not in rows[0]):
        raise KeyError(
            f"{table} has columns {sorted(rows[0])}; pass --path-key/--caption-key to name the "
            f"image path and caption columns (looked for {path_key!r} and {caption_key!r})"
        )
    missing = 0
    for row in rows:
        path = Path(row[path_key])
        if not path.is_absolute():
            path = table.parent / path
        if not path.exists():
            missing += 1
            log.warning("skipping row with missing image %s", path)
            continue
        sample = _read_image(path)
        sample.caption = str(row[caption_key]).strip()
        sample.meta = {k: v for k, v in row.items() if k not in (path_key, caption_key)}
        yield sample
    if missing:
        log.warning("%d of %d rows of %s skipped: image file missing", missing, len(rows), table)


def encode_png(array) -> bytes:
    """Encode a uint8 array ``[h, w]`` or ``[h, w, 3]`` as PNG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()
