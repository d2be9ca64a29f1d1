"""Stored teacher embeddings (``distill.teacher=stored``) travel with their samples: whatever the ranks, the
loader workers or the step a run resumes from, each row's embeddings are its own sample's, so a run resumed on
another world size reads the same targets for the same samples."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch

from megabatch.config.schema import validate
from megabatch.data import TrainData
from megabatch.data.shard_writer import Sample, encode_png, write_shards
from megabatch.data.teacher_store import TeacherSpec

from ..helpers import compose, preprocess

SHARDS, PER_SHARD, BATCH, WIDTH = 4, 10, 8, 4


@pytest.fixture(scope="module")
def shard_urls(tmp_path_factory) -> list[str]:
    """40 samples, each captioned "alt <id>" with embeddings [1, 2, WIDTH]: the image's all <id>, the caption's
    all -<id>, and their teacher.json."""
    folder = tmp_path_factory.mktemp("stored")
    rng = np.random.default_rng(0)
    samples = [Sample(encode_png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)), "png", f"alt {i}")
               for i in range(SHARDS * PER_SHARD)]
    for path in write_shards(samples, folder, "t", per_shard=PER_SHARD):
        with tarfile.open(path) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        with tarfile.open(path, "w") as tar:
            for member, data in members:
                tar.addfile(member, io.BytesIO(data))
                if member.name.endswith(".txt"):
                    sample = int(data.decode().split()[1])
                    array = np.stack([np.full(WIDTH, sample), np.full(WIDTH, -sample)])[None].astype(np.float32)
                    buffer = io.BytesIO()
                    np.save(buffer, array)
                    info = tarfile.TarInfo(member.name[:-len("txt")] + "teacher.npy")
                    info.size = len(buffer.getvalue())
                    tar.addfile(info, io.BytesIO(buffer.getvalue()))
    (folder / "teacher.json").write_text(TeacherSpec("teacher.npy", 1, WIDTH, (10.0,)).to_json())
    return [str(folder / f"t-{{000000..{SHARDS - 1:06d}}}.tar")]


def ids(captions) -> torch.Tensor:
    """The 'tokenizer': each caption's sample id."""
    return torch.tensor([[int(str(c).split()[1])] for c in captions])


def read(urls, tmp_path, world: int, workers: int, split: str, start: int = 0) -> dict[int, torch.Tensor]:
    """{sample id: its row's stored embeddings} over ``world`` ranks' sub-batches from step ``start``."""
    cfg = compose("data=webdataset", f"data.train.split={split}", "data.train.shuffle_buffer=7",
                  f"data.num_workers={workers}", "distill.teacher=stored", "data.train.teacher_key=teacher.npy")
    cfg.data.train.urls, cfg.data.cache_dir = urls, str(tmp_path / "cache")
    validate(cfg)
    data = TrainData(cfg.data, ids, preprocess(8), seed=cfg.seed)
    steps = data.steps_per_epoch(BATCH, world, BATCH // world)
    seen: dict[int, torch.Tensor] = {}
    for rank in range(world):
        loader = data.loader(0, start, rank_batch=BATCH // world, rank=rank, world_size=world,
                             num_batches=steps, sub_batch=BATCH // world)
        for sub in loader:
            assert sub.teacher is not None and sub.teacher.shape[1:] == (1, 2, WIDTH)
            for sample, embeddings in zip(sub.texts[:, 0].tolist(), sub.teacher, strict=True):
                seen[sample] = embeddings
    return seen


@pytest.mark.parametrize("split", ["indexed", "position"])
def test_each_rows_embeddings_are_its_samples_on_any_ranks_and_across_a_resume(shard_urls, tmp_path, split):
    for world, workers, start in ((1, 0, 0), (2, 2, 0), (2, 1, 2), (1, 2, 3)):
        seen = read(shard_urls, tmp_path, world, workers, split, start)
        assert len(seen) >= BATCH, (world, workers, start)
        for sample, embeddings in seen.items():
            assert torch.equal(embeddings[0, 0], torch.full((WIDTH,), float(sample))), (world, workers, start)
            assert torch.equal(embeddings[0, 1], torch.full((WIDTH,), -float(sample))), (world, workers, start)
