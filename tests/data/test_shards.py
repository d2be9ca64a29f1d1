"""scripts/make_shards.py: digits, image folders and CSV/JSONL tables become readable shards."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from megabatch.data.digits import CLASS_NAMES
from megabatch.data.shard_writer import encode_png
from megabatch.data.urls import expand_urls, shard_sizes

from ..helpers import ROOT


def make_images(folder, count=5):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        pixels = rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)
        (folder / f"img{index}.png").write_bytes(encode_png(pixels))
    return sorted(folder.glob("*.png"))


def read_tar(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def make_shards(*args):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_digits_shards_are_real_labelled_images(data_cache):
    from megabatch.data.digits import ensure_digits

    patterns = ensure_digits(data_cache)
    train, test = expand_urls(patterns["train"], "t"), expand_urls(patterns["test"], "t")
    assert sum(shard_sizes(train, "t")) + sum(shard_sizes(test, "t")) == 1797
    assert sum(shard_sizes(test, "t")) == 360
    files = read_tar(test[0])
    assert {"000000000.png", "000000000.txt", "000000000.json"} <= files.keys()
    meta = json.loads(files["000000000.json"])
    caption = files["000000000.txt"].decode()
    assert CLASS_NAMES[meta["label"]] in caption or str(meta["label"]) in caption
    image = Image.open(io.BytesIO(files["000000000.png"]))
    assert image.size == (32, 32) and np.asarray(image).std() > 10  # a real scan, not blank
    first = read_tar(train[0])  # read once: not once per member
    captions = {value.decode() for name, value in first.items() if name.endswith(".txt")}
    assert len(captions) > 30  # several phrasings per class


def test_folder_to_shards(tmp_path):
    images = make_images(tmp_path / "photos" / "golden_retriever")
    (images[0].with_suffix(".txt")).write_text("a dog on a beach")
    out = make_shards("folder", "--src", str(tmp_path / "photos"), "--out", str(tmp_path / "s"),
                      "--per-shard", "2")
    assert "train-{000000..000002}.tar" in out
    files = read_tar(tmp_path / "s" / "train-000000.tar")
    assert files["000000000.txt"] == b"a dog on a beach"
    assert files["000000001.txt"] == b"a photo of a golden retriever"
    sizes = json.loads((tmp_path / "s" / "sizes.json").read_text())
    assert sizes == {"train-000000.tar": 2, "train-000001.tar": 2, "train-000002.tar": 1}


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_table_to_shards(tmp_path, kind):
    images = make_images(tmp_path / "imgs", count=3)
    rows = [{"path": f"imgs/{p.name}", "caption": f"picture {i}"} for i, p in enumerate(images)]
    rows.append({"path": "imgs/missing.png", "caption": "gone"})
    table = tmp_path / f"captions.{kind}"
    if kind == "csv":
        table.write_text("path,caption\n" + "".join(f"{r['path']},{r['caption']}\n" for r in rows))
    else:
        table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_shards("table", "--src", str(table), "--out", str(tmp_path / "s"), "--prefix", "cc")
    files = read_tar(tmp_path / "s" / "cc-000000.tar")
    assert sorted(k for k in files if k.endswith(".txt")) == [f"00000000{i}.txt" for i in range(3)]
    assert files["000000002.txt"] == b"picture 2"


def test_missing_shards_are_a_clear_error(tmp_path):
    from megabatch.config import ConfigError

    with pytest.raises(ConfigError, match="matches no file"):
        expand_urls(str(tmp_path / "train-{000000..000003}.tar"), "data.train.urls")
