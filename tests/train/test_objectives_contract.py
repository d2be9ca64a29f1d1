"""The contract every training objective (``train/step/objectives``) keeps: one pass, GradCache with 4
sub-batches, GradCache with offload and 2 gloo ranks give the same loss and gradients, for each valid combination of
the objectives the tiny models build (the contrastive loss at each weight, + the caption loss, + a teacher, online or
its embeddings stored in the shards, + hard negatives, a locked image tower's stored features alone and with those,
SigLIP 2's late terms each alone and together, with the decoder, a teacher or hard negatives, and the allowed pairs).
``loss.contrastive_weight``
multiplies the contrastive term on every path: with the contrastive loss alone, weight 0.5 gives exactly half of
weight 1's loss and gradients (the one-pass step ignored it until the objectives issue: relative difference 1.0)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from megabatch.config.schema import validate
from megabatch.data.shard_writer import Sample, encode_png, write_shards
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full
from megabatch.models import build_model
from megabatch.train.build.parts import RunParts

from ..helpers import ROOT, compose, rel_error, run_ranks
from .test_gradcache import BASE, BATCH, flat

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
NEGATIVES = ["data.train.negatives_key=json:negatives", "data.train.negatives=2"]
IMAGE_FEATURES = ["model.lock_image=true", "model.image_features=stored", "data.train.image_features_key=image.npy"]
# each objective's overrides on top of the contrastive loss; the teacher's path is filled in by the fixture
DECODER = ["model.decoder.layers=1", "model.decoder.width=32", "model.decoder.heads=2"]
VIEWS = ["self_distill.start=0", "self_distill.local_crops=2", "self_distill.local_size=16",
         "self_distill.prototypes=32", "self_distill.hidden=32", "self_distill.bottleneck=16"]
SELF_DISTILL = ["self_distill.weight=1.0", "self_distill.masked_weight=0.25", *VIEWS]
OBJECTIVES = {
    "contrastive": [],
    "caption": ["model=tiny_coca", "loss.caption_weight=1.5"],
    "teacher": ["distill.teacher={teacher}"],
    "stored teacher": ["distill.teacher=stored", "data.train.teacher_key=teacher.npy"],  # read from data["stored"]
    "negatives": NEGATIVES,
    "caption+teacher": ["model=tiny_coca", "loss.caption_weight=1.5", "distill.teacher={teacher}"],
    # model.decoder: a captioner over the image tower's tokens alone (LocCa), half the captions predicted in parallel
    "decoder": [*DECODER, "loss.caption_weight=1.5"],
    "teacher+negatives": ["distill.teacher={teacher}", *NEGATIVES],
    # LiT from stored image features (read from data["features"]), alone and beside what they combine with
    "image features": IMAGE_FEATURES,
    "image features+negatives": [*IMAGE_FEATURES, *NEGATIVES],
    "image features+stored teacher": [*IMAGE_FEATURES, "distill.teacher=stored", "data.train.teacher_key=teacher.npy"],
    # SigLIP 2's late terms from the first step: an EMA teacher's targets for the student's crops and masked view
    "self distill": SELF_DISTILL,
    "local-to-global alone": ["self_distill.weight=1.0", *VIEWS],
    "masked alone": ["self_distill.masked_weight=0.25", *VIEWS],
    "self distill+decoder": [*SELF_DISTILL, *DECODER, "loss.caption_weight=1.5"],
    "self distill+teacher": [*SELF_DISTILL, "distill.teacher={teacher}"],
    "self distill+negatives": [*SELF_DISTILL, *NEGATIVES],
}
WEIGHTS = ["1.0", "0.5"]
PATHS = {"gradcache": [f"trainer.sub_batch={BATCH // 4}"],
         "offload": [f"trainer.sub_batch={BATCH // 4}", "trainer.offload=true"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """64 captioned images with 2 hard negatives each, as shards; a tiny teacher checkpoint (seed 1), and the
    shards again with its embeddings stored (float32), as ``scripts/make_shards.py teacher`` writes them."""
    folder, rng, samples = tmp_path_factory.mktemp("objectives"), np.random.default_rng(0), []
    for i in range(64):
        negatives = [f"a photo of {WORDS[(i + 1) % 10]}", f"the digit {WORDS[(i + 3) % 10]}"]
        samples.append(Sample(encode_png(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)), "png",
                              f"a photo of {WORDS[i % 10]}", {"negatives": negatives}))
    write_shards(samples, folder, "o", per_shard=16)
    torch.manual_seed(1)
    teacher = folder / "teacher.pt"
    model = build_model(compose("model.text.width=48").model)
    torch.save({"model": model.state_dict(), "step": 0, "open_clip": model.description()}, teacher)
    urls = str(folder / "o-{000000..000003}.tar")
    spec = importlib.util.spec_from_file_location("make_shards", ROOT / "scripts" / "make_shards.py")
    make_shards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_shards)
    make_shards.main(["teacher", urls, "--out", str(folder / "stored"), "--teacher", str(teacher), "--dtype",
                      "float32", "--batch", "64"])
    stored = str(folder / "stored" / "o-{000000..000003}.tar")
    # and the locked tiny image tower's features added to those (the run's own tower: seed 0)
    make_shards.main(["image-features", stored, "--out", str(folder / "features"), "--model", "model.lock_image=true",
                      "--dtype", "float32", "--batch", "64", "--workers", "1"])
    return {"urls": urls, "teacher": str(teacher), "stored": stored,
            "features": str(folder / "features" / "o-{000000..000003}.tar")}


def overrides(data: dict, objective: str, weight: str) -> list[str]:
    urls = data["features"] if "image features" in objective else data["stored"] if "stored" in objective else \
        data["urls"]
    return [item.format(teacher=data["teacher"]) for item in OBJECTIVES[objective]] + \
        [f"loss.contrastive_weight={weight}", f"+urls={urls}"]


def run_parts(data: dict, *extra: str) -> RunParts:
    """The trainer's parts for the contract's runs, on the shards ``+urls=`` names (the plain ones without it)."""
    urls = next((item.removeprefix("+urls=") for item in extra if item.startswith("+urls=")), data["urls"])
    cfg = compose(*BASE, "model.image.patch_dropout=0", "loss=infcl", "loss.tile=8", "data=webdataset",
                  "data.num_workers=0", "data.train.split=position",
                  *(item for item in extra if not item.startswith("+urls=")))
    cfg.data.train.urls, cfg.data.cache_dir = urls, compose().data.cache_dir
    return RunParts.build(validate(cfg), init_distributed("cpu"))


def gradients(data: dict, *extra: str) -> dict:
    """One step's loss, terms and gradients (before the optimizer) through the trainer's own step (``run_parts``)."""
    parts = run_parts(data, *extra)
    loss, _ = parts.step.gradients(parts.inputs(0))
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    terms = {**getattr(parts.step.loss_fn, "terms", {}), **parts.step.contrastive.terms}
    parts.close()
    return {"loss": loss.detach(), "grads": grads, "terms": {k: v.detach() for k, v in terms.items()}}


def assert_same(result: dict, expected: dict, where: str) -> None:
    assert result["grads"].keys() == expected["grads"].keys(), where
    assert rel_error(result["loss"], expected["loss"]) <= 1e-6, where
    assert rel_error(flat(result["grads"]), flat(expected["grads"])) <= 1e-5, where
    assert rel_error(result["grads"]["clip.logit_scale"], expected["grads"]["clip.logit_scale"]) <= 1e-5, where


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_every_path_gives_the_one_pass_loss_and_gradients(data, objective):
    for weight in WEIGHTS:
        one_pass = gradients(data, *overrides(data, objective, weight))
        if "teacher" in objective:  # the distillation term is there, not silently dropped
            assert float(one_pass["terms"]["distill"]) > 0, one_pass["terms"]
        for path, extra in PATHS.items():
            assert_same(gradients(data, *overrides(data, objective, weight), *extra), one_pass,
                        f"{objective}, contrastive_weight={weight}, {path}")


def test_the_contrastive_weight_scales_the_contrastive_term_on_every_path(data):
    """Alone, weight 0.5 is half of weight 1 (loss and every gradient): on the one-pass step as in GradCache."""
    for path, extra in {"one pass": [], **PATHS}.items():
        whole = gradients(data, *overrides(data, "contrastive", "1.0"), *extra)
        half = gradients(data, *overrides(data, "contrastive", "0.5"), *extra)
        assert rel_error(half["loss"], whole["loss"] / 2) <= 1e-6, path
        assert rel_error(flat(half["grads"]), flat(whole["grads"]) / 2) <= 1e-6, path


# on 2 ranks at the weight that is not 1 alone: a path that ignored it differs there (one process above checks both)
RANK_WEIGHT = "0.5"


def two_ranks(rank: int, world: int, data: dict) -> dict:
    return {objective: gradients(data, *overrides(data, objective, RANK_WEIGHT), "trainer.sub_batch=4")
            for objective in OBJECTIVES}


def test_two_ranks_equal_one_process(data, tmp_path):
    single = {objective: gradients(data, *overrides(data, objective, RANK_WEIGHT)) for objective in OBJECTIVES}
    for rank, results in enumerate(run_ranks(2, two_ranks, data, tmp_path=tmp_path)):
        for key, result in results.items():
            assert_same(result, single[key], f"rank {rank}: {key}")


# A NaFlex tower under a token budget (tests/train/test_naflex.py): seed 1 draws 9 patches for step 0, whose 4
# sub-batches of 8 images the budget joins two by two; the objectives that ride on sub-batches keep their rows in order
NAFLEX_BUDGET = ["model=tiny_naflex", "data.naflex.seq_lens=[9,16]", "seed=1"]


@pytest.mark.parametrize("objective", ["negatives", "stored teacher"])
def test_a_token_budget_joins_each_objectives_rows_in_order(data, objective):
    """Hard negatives and stored teacher embeddings under ``trainer.sub_batch_tokens``: joined sub-batches give the
    one-pass loss and gradients (a teacher row joined out of order would pair with another image; the negatives are
    the softmax's extra columns, in any order, so for them: none lost or counted twice)."""
    budget = [*overrides(data, objective, "1.0"), *NAFLEX_BUDGET, "trainer.sub_batch_tokens=144"]
    parts = run_parts(data, *budget)
    stream = parts.inputs(0)
    try:  # step 0's 4 sub-batches of 8 nine-patch images, joined into 2 of 16
        assert (parts.plan.sub_batches, stream.step_sub_batches()) == (4, 2)
        assert [len(next(stream).texts) for _ in range(2)] == [16, 16]
    finally:
        stream.close()
        parts.close()
    one_pass = gradients(data, *overrides(data, objective, "1.0"), *NAFLEX_BUDGET)
    if "teacher" in objective:
        assert float(one_pass["terms"]["distill"]) > 0, one_pass["terms"]
    assert_same(gradients(data, *budget), one_pass, f"{objective} under a token budget")
