"""Several captions per sample (data.train.text_key, data.train.text_probs): one drawn per sample and
epoch, the same on 1 and 2 ranks x 1 and 2 loader workers and across a resume; probabilities honoured;
a sample with none of the keys skipped and counted; bad keys named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.data import TrainData
from megabatch.data.captions import CaptionKeys
from megabatch.data.shard_writer import Sample, encode_png, write_shards

from ..helpers import compose, preprocess

SHARDS, PER_SHARD, BATCH = 4, 10, 8
KINDS = {"alt": 0, "re": 1, "blip": 2, "coca": 3}  # caption "<kind> <sample id>"


@pytest.fixture(scope="module")
def shard_urls(tmp_path_factory) -> list[str]:
    """40 samples: alt-text in txt, a recaption and a list of two more in the JSON; sample 5 has no
    recaption, sample 6 an empty alt-text, sample 7 no caption at all (skipped)."""
    folder = tmp_path_factory.mktemp("captioned")
    rng, samples = np.random.default_rng(0), []
    for i in range(SHARDS * PER_SHARD):
        meta = {"recaption": f"re {i}", "synthetic": {"list": [f"blip {i}", f"coca {i}"]}}
        if i == 5:
            del meta["recaption"]
        samples.append(Sample(encode_png(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)), "png",
                              "" if i in (6, 7) else f"alt {i}", meta if i != 7 else {}))
    write_shards(samples, folder, "c", per_shard=PER_SHARD)
    return [str(folder / f"c-{{000000..{SHARDS - 1:06d}}}.tar")]


def ids(captions: list[str]) -> torch.Tensor:
    """The 'tokenizer': each caption as (kind, sample id)."""
    return torch.tensor([[KINDS[c.split()[0]], int(c.split()[1])] for c in captions])


def make_data(urls, tmp_path, *overrides) -> TrainData:
    cfg = compose("data=webdataset", "data.train.split=indexed", "data.train.streams=4",
                  "data.train.shuffle_buffer=7", *overrides)
    cfg.data.train.urls, cfg.data.cache_dir = urls, str(tmp_path / "cache")
    validate(cfg)
    return TrainData(cfg.data, ids, preprocess(8), seed=cfg.seed)


def chosen(data: TrainData, world: int, sub_batch: int, steps: int, start: int = 0, epoch: int = 0) -> dict:
    """{sample id: caption kind} over ``world`` ranks, steps ``start ..``; and the skipped count."""
    kinds, missing = {}, 0
    for rank in range(world):
        loader = data.loader(epoch, start, rank_batch=BATCH // world, rank=rank, world_size=world,
                             num_batches=steps, sub_batch=sub_batch)
        for sub in loader:
            for kind, sample in sub.texts.tolist():
                assert kinds.setdefault(sample, kind) == kind  # a sample read twice (a stand-in): the same caption
            missing = max(missing, sub.stats["missing_caption"])
    return kinds, missing


KEYS = "data.train.text_key=[txt,json:recaption,json:synthetic.list]"


def test_the_captions_are_the_same_on_any_ranks_and_workers_and_across_a_resume(shard_urls, tmp_path):
    data = make_data(shard_urls, tmp_path, KEYS, "data.num_workers=0")
    steps = data.steps_per_epoch(BATCH, 1, BATCH)
    one, missing = chosen(data, 1, BATCH, steps)
    assert len(one) > 20 and set(one.values()) == {0, 1, 2, 3}  # every key drawn
    assert 7 not in one and missing >= 1  # no caption at all: skipped and counted (a stand-in took its place)
    assert one.get(6, 1) != 0 and one.get(5, 0) != 1  # only the keys a sample has (6's alt-text is empty)
    for world, sub_batch, workers in ((2, 2, 1), (2, 4, 2), (1, 4, 2)):
        other = make_data(shard_urls, tmp_path, KEYS, f"data.num_workers={workers}")
        assert chosen(other, world, sub_batch, steps)[0] == one, (world, sub_batch, workers)
    resumed, _ = chosen(make_data(shard_urls, tmp_path, KEYS, "data.num_workers=2"), 2, 2, steps, start=2)
    assert resumed and all(one[sample] == kind for sample, kind in resumed.items())
    next_epoch, _ = chosen(data, 1, BATCH, steps, epoch=1)
    shared = [s for s in next_epoch if s in one]
    assert any(next_epoch[s] != one[s] for s in shared)  # drawn again each epoch


def test_the_probabilities_are_honoured():
    keys = CaptionKeys(["txt", "json:recaption"], [0.8, 0.2], seed=3)
    sample = {"txt": b"alt", "json": json.dumps({"recaption": "re"}).encode()}
    picks = [keys.pick(sample, position) for position in range(4000)]
    assert 0.77 < picks.count("alt") / len(picks) < 0.83
    assert picks == [keys.pick(sample, position) for position in range(4000)]  # a function of the position
    assert CaptionKeys(["txt", "json:recaption"], [0, 1]).pick(sample, 0) == "re"
    assert CaptionKeys(["txt", "json:recaption"], [1, 0]).pick({"json": sample["json"]}, 0) is None  # weight 0
    assert CaptionKeys(["json:recaption"]).pick({"txt": b"alt", "json": b"{not json"}, 0) is None
    assert CaptionKeys("txt").pick({"txt": b"plain"}, 0) == "plain"


@pytest.mark.parametrize("overrides,key", [
    (["data.train.text_key=[]"], "data.train.text_key"),
    (["data.train.text_key=json:"], "data.train.text_key"),
    (["data.train.text_key=[txt,json:recaption]", "data.train.text_probs=[1.0]"], "data.train.text_probs"),
    (["data.train.text_key=[txt,json:recaption]", "data.train.text_probs=[0,0]"], "data.train.text_probs"),
    (["data.train.text_probs=[-1]"], "data.train.text_probs"),
])
def test_bad_caption_keys_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose(*overrides))


def test_hard_negatives_are_read_cycled_and_a_sample_without_them_is_counted():
    from megabatch.data.samples import Stats, Texts, decode_pair

    keys = CaptionKeys("txt", negatives_key="json:negatives", negatives=3)
    sample = {"txt": b"a cat", "png": b"", "json": json.dumps({"negatives": ["a dog", "a cow"]}).encode()}
    assert keys.negatives_of(sample) == ["a dog", "a cow", "a dog"]
    lines = CaptionKeys("txt", negatives_key="neg.txt", negatives=2)
    assert lines.negatives_of({"neg.txt": b"a dog\n\na cow\na pig\n"}) == ["a dog", "a cow"]
    stats = Stats()
    assert decode_pair(sample, stats, lambda data: "image", keys, 0)[2] == Texts("a cat", ["a dog", "a cow", "a dog"])
    assert decode_pair({**sample, "json": b"{}"}, stats, lambda data: "image", keys, 0) is None
    assert stats.missing_negatives == 1 and stats.as_dict()["missing_negatives"] == 1
