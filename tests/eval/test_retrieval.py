"""Recall@K against a brute-force count, and the JSONL retrieval path end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megabatch.data.shard_writer import encode_png
from megabatch.eval.retrieval import recall_at_k
from megabatch.models import build_model


def brute_force(images, texts, owner, k):
    sims = images @ texts.T
    i2t = np.mean([owner[sims[i].topk(k).indices].eq(i).any().item() for i in range(len(images))])
    t2i = np.mean([sims[:, t].topk(k).indices.eq(owner[t]).any().item() for t in range(len(texts))])
    return 100 * i2t, 100 * t2i


def test_chunked_recall_matches_brute_force():
    generator = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(23, 8, generator=generator), dim=-1)
    owner = torch.arange(23).repeat_interleave(3)[:67]  # ~3 captions per image, ragged
    texts = F.normalize(images[owner] + 0.9 * torch.randn(67, 8, generator=generator), dim=-1)
    result = recall_at_k(images, texts, owner, chunk=5)
    for k in (1, 5, 10):
        i2t, t2i = brute_force(images, texts, owner, k)
        assert abs(result[f"image_to_text_R@{k}"] - i2t) < 1e-9
        assert abs(result[f"text_to_image_R@{k}"] - t2i) < 1e-9
    assert 0 < result["image_to_text_R@1"] < result["image_to_text_R@10"] <= 100


def test_retrieval_eval_from_jsonl(tmp_path):

    from megabatch.eval.zeroshot import run_zeroshot

    from ..helpers import compose

    rows = []
    for index in range(6):
        pixels = np.full((12, 12, 3), 30 * index, dtype=np.uint8)
        (tmp_path / f"{index}.png").write_bytes(encode_png(pixels))
        rows.append({"image": f"{index}.png", "captions": [f"picture {index}", f"image {index}"]})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose("eval=retrieval", f"eval.retrieval.jsonl={tmp_path / 'pairs.jsonl'}", "eval.retrieval.chunk=4")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    result = run_zeroshot(model, model.tokenizer(), cfg.eval.retrieval, cfg.data, torch.device("cpu"))
    assert result["samples"] == 6
    assert result["text_to_image_R@10"] == 100.0  # K >= 6 images: every caption is a hit
    assert all(0 <= value <= 100 for key, value in result.items() if "R@" in key)
    assert result["image_to_text_R@1"] <= result["image_to_text_R@5"] <= result["image_to_text_R@10"]


def test_retrieval_eval_from_shards(tmp_path):

    from megabatch.data.shard_writer import Sample, write_shards
    from megabatch.eval.zeroshot import run_zeroshot

    from ..helpers import compose

    samples = [Sample(encode_png(np.full((12, 12, 3), 30 * i, dtype=np.uint8)), "png", f"picture {i}",
                      {"captions": [f"picture {i}", f"image {i}", f"photo {i}"]}) for i in range(5)]
    write_shards(samples, tmp_path, "pairs", per_shard=3)
    cfg = compose("eval=retrieval", f"eval.retrieval.urls='{tmp_path}/pairs-{{000000..000001}}.tar'")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    result = run_zeroshot(model, model.tokenizer(), cfg.eval.retrieval, cfg.data, torch.device("cpu"))
    assert result["samples"] == 5 and result["text_to_image_R@5"] == 100.0


def test_retrieval_from_shards_by_loader_workers_leaves_out_bad_samples(tmp_path):
    """Shards read by 2 loader workers, with a corrupt image and a sample without a caption: the numbers of a jsonl
    of the good pairs alone, and of the same shards read in the main process."""
    from megabatch.data.shard_writer import Sample, write_shards
    from megabatch.eval.zeroshot import run_zeroshot

    from ..helpers import compose

    rng, samples, rows = np.random.default_rng(0), [], []
    for i in range(9):
        pixels = rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)
        captions = [] if i == 4 else [f"picture {i}", f"image {i} of {rng.integers(9)}"]
        image = b"not a png" if i == 2 else encode_png(pixels)
        samples.append(Sample(image, "png", captions[0] if captions else "", {"captions": captions}))
        if captions and i != 2:
            (tmp_path / f"{i}.png").write_bytes(image)
            rows.append({"image": f"{i}.png", "captions": captions})
    write_shards(samples, tmp_path, "pairs", per_shard=4)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    shards = f"eval.retrieval.urls='{tmp_path}/pairs-{{000000..000002}}.tar'"
    model = build_model(compose("eval=retrieval", shards).model)
    results = []
    for source in (f"eval.retrieval.jsonl={tmp_path / 'pairs.jsonl'}", shards):
        for workers in (0, 2):
            cfg = compose("eval=retrieval", source, f"eval.retrieval.num_workers={workers}",
                          "eval.retrieval.batch_size=3")
            results.append(run_zeroshot(model, model.tokenizer(), cfg.eval.retrieval, cfg.data, torch.device("cpu")))
    assert results[0]["samples"] == 7
    for result in results[1:]:
        assert result == pytest.approx(results[0], abs=1e-9)
