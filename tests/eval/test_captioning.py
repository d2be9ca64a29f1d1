"""Captioning evaluation (``task=captioning``): the PTB tokenization, BLEU and CIDEr as pycocoevalcap scores them
(BLEU-1 checked by hand), a tiny CoCa's captions of a JSONL set scored against their references, and the errors:
a model without a decoder, pycocoevalcap missing, a set without images."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.data.shard_writer import encode_png
from megabatch.eval.captioning import caption_scores, ptb_tokens
from megabatch.models import build_model

from ..helpers import compose


def test_ptb_tokens_split_punctuation_and_contractions_and_drop_punctuation():
    assert ptb_tokens("A dog's toy, outside.") == "a dog 's toy outside"
    assert ptb_tokens("It DOESN'T fit (really)!") == "it does n't fit really"
    assert ptb_tokens("two cats -- on a mat...\nthe end") == "two cats on a mat the end"


def test_bleu_and_cider_scores():
    # BLEU-1 by hand: every candidate word is in the reference (precision 1); brevity penalty exp(1 - 6/3)
    scores = caption_scores([["A cat sat on the mat."]], ["a cat sat"])
    assert math.isclose(scores["bleu1"], 100 * math.exp(1 - 6 / 3), rel_tol=1e-6)
    references = [["a photo of the digit seven", "a handwritten 7"], ["the number three", "a scan of a three"],
                  ["a pixelated one", "the digit one"]]
    right = caption_scores(references, ["a photo of the digit seven", "the number three", "the digit one"])
    wrong = caption_scores(references, ["the digit one", "a photo of the digit seven", "the number three"])
    assert right["bleu4"] > 90 and right["cider"] > wrong["cider"] >= 0 and set(right) == {
        "bleu1", "bleu2", "bleu3", "bleu4", "cider"}


def pairs(tmp_path, count: int = 3) -> str:
    rows = []
    for index in range(count):
        (tmp_path / f"{index}.png").write_bytes(encode_png(np.full((12, 12, 3), 40 * index, dtype=np.uint8)))
        rows.append({"image": f"{index}.png", "captions": [f"a photo of the digit {index}", f"the number {index}"]})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(tmp_path / "pairs.jsonl")


def test_a_cocas_captions_are_scored_against_each_images_references(tmp_path, monkeypatch):
    from megabatch.eval import captioning
    from megabatch.eval.zeroshot import headline, run_zeroshot

    cfg = validate(compose("model=tiny_coca", "eval=captioning", f"eval.captioning.jsonl={pairs(tmp_path)}",
                           "eval.captioning.batch_size=2"))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    seen = []
    score = captioning.caption_scores
    monkeypatch.setattr(captioning, "caption_scores", lambda refs, caps: seen.append((refs, caps)) or score(refs, caps))
    result = run_zeroshot(model, model.tokenizer(), cfg.eval.captioning, cfg.data, torch.device("cpu"))
    references, generated = seen[0]
    assert references == [[f"a photo of the digit {i}", f"the number {i}"] for i in range(3)] and len(generated) == 3
    assert result == {**score(references, generated), "samples": 3} and headline(result) == result["cider"]


def test_captioning_errors_name_the_key_and_the_fix(tmp_path, monkeypatch):
    from megabatch.eval.zeroshot import run_zeroshot

    jsonl = pairs(tmp_path, 1)
    cfg = validate(compose("eval=captioning", f"eval.captioning.jsonl={jsonl}"))  # the tiny CLIP: no decoder
    model = build_model(cfg.model)
    with pytest.raises(ConfigError, match=r"eval.captioning.task=captioning needs a model with a caption decoder"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.captioning, cfg.data, torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "pycocoevalcap.bleu.bleu", None)
    with pytest.raises(ConfigError, match="pip install pycocoevalcap"):
        caption_scores([["a cat"]], ["a cat"])
    with pytest.raises(ConfigError, match=r"eval.captioning.jsonl.*or eval.captioning.urls"):
        validate(compose("eval=captioning"))
    with pytest.raises(ConfigError, match=r"eval.captioning.jsonl='/nowhere/pairs.jsonl': no readable file"):
        validate(compose("model=tiny_coca", "eval=captioning", "eval.captioning.jsonl=/nowhere/pairs.jsonl"))
    cfg = compose("model=tiny_coca", "eval=captioning", "eval.captioning.jsonl=/nowhere/pairs.jsonl")
    model = build_model(cfg.model)
    monkeypatch.delitem(sys.modules, "pycocoevalcap.bleu.bleu")
    with pytest.raises(ConfigError, match=r"eval.captioning.jsonl='/nowhere/pairs.jsonl' does not exist"):
        run_zeroshot(model, model.tokenizer(), cfg.eval.captioning, cfg.data, torch.device("cpu"))
