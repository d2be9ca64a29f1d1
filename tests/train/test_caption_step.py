"""CoCa's caption loss through the trainer's step (``loss.caption_weight``): a tiny CoCa (``model=tiny_coca``)
on the digits. GradCache's sub-batches (each replayed sub-batch adding its caption loss), offload and 2 gloo
ranks (DDP and FSDP) give the one-pass step's gradients of every parameter, the decoder's included, with the
terms alone and together; the caption term is the cross-entropy over the global batch's caption tokens
(OpenCLIP's ``CoCaLoss`` on the whole batch, float64); ``caption_weight=0`` is today's step; a model without a
decoder is a config error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.distributed import init_distributed
from megabatch.distributed.fsdp import full
from megabatch.train.build.parts import RunParts

from ..helpers import compose, rel_error, run_ranks
from .test_gradcache import BASE, BATCH, flat

COCA = [*BASE, "model=tiny_coca", "loss=infcl", "loss.tile=8", "model.image.patch_dropout=0"]


def gradients(*overrides: str, batch_of: bool = False, base: list[str] = COCA) -> dict:
    parts = RunParts.build(validate(compose(*base, *overrides)), init_distributed("cpu"))
    stream = parts.inputs(0)
    if batch_of:  # the step's sub-batches, kept for a reference computed on them
        subs = [next(stream) for _ in range(parts.plan.sub_batches)]
        stream = iter(subs)
    loss, _ = parts.step.gradients(stream)
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    result = {"loss": loss, "grads": grads, "terms": dict(parts.step.contrastive.terms)}
    if batch_of:
        result["model"], result["subs"] = parts.model, subs
    parts.close()
    return result


def decoder(grads: dict) -> torch.Tensor:
    return flat({n: g for n, g in grads.items() if "text_decoder" in n})


@pytest.mark.parametrize("weights", [("2.0", "1.0"), ("1.0", "0.0")])
def test_sub_batches_and_offload_give_the_one_pass_gradients(weights):
    caption, contrastive = weights
    extra = [f"loss.caption_weight={caption}", f"loss.contrastive_weight={contrastive}"]
    one_pass = gradients(*extra)
    assert set(one_pass["terms"]) == {"contrastive", "caption"} and decoder(one_pass["grads"]).abs().sum() > 0
    for more in ([f"trainer.sub_batch={BATCH // 4}"], [f"trainer.sub_batch={BATCH // 4}", "trainer.offload=true"]):
        cached = gradients(*extra, *more)
        assert cached["grads"].keys() == one_pass["grads"].keys(), more
        assert rel_error(cached["loss"], one_pass["loss"]) <= 1e-6, more
        assert rel_error(flat(cached["grads"]), flat(one_pass["grads"])) <= 1e-5, more
        assert rel_error(decoder(cached["grads"]), decoder(one_pass["grads"])) <= 1e-5, more


def test_the_caption_term_is_the_cross_entropy_over_the_global_batchs_tokens():
    """Against OpenCLIP's CoCaLoss on the whole batch in float64 (its caption term: the mean over the batch's
    non-pad tokens), and ``caption_weight=0`` against the contrastive step's gradients."""
    from open_clip.loss import CoCaLoss

    ours = gradients("loss.caption_weight=1.0", f"trainer.sub_batch={BATCH // 4}", batch_of=True)
    model = ours["model"].double()
    images = torch.cat([sub.images for sub in ours["subs"]])
    texts = torch.cat([sub.texts for sub in ours["subs"]])
    with torch.no_grad():
        pixels = (images.double() / 255 - torch.tensor(model.preprocess["mean"]).view(1, 3, 1, 1)) \
            / torch.tensor(model.preprocess["std"]).view(1, 3, 1, 1)
        out = model.clip(pixels, texts)
        loss = CoCaLoss(caption_loss_weight=1.0, clip_loss_weight=0.0, pad_id=model.clip.pad_id)
        _, caption = loss(out["image_features"], out["text_features"], out["logits"], out["labels"],
                          out["logit_scale"])
    assert rel_error(ours["terms"]["caption"].double(), caption) <= 1e-5
    assert rel_error(ours["loss"].double(), ours["terms"]["contrastive"].double() + caption) <= 1e-5
    plain = gradients(f"trainer.sub_batch={BATCH // 4}")  # caption_weight 0: today's step, the decoder frozen
    without = gradients("loss.caption_weight=0", f"trainer.sub_batch={BATCH // 4}")
    assert not any("text_decoder" in name for name in plain["grads"]) and plain["terms"] == {}
    assert torch.equal(flat(plain["grads"]), flat(without["grads"]))
    assert rel_error(flat({n: g for n, g in ours["grads"].items() if "text_decoder" not in n}),
                     flat(plain["grads"])) > 1e-4  # not vacuous: the caption loss reaches the towers too


def two_ranks(rank: int, world: int) -> dict:
    """DDP, and FSDP (each rank a shard of every parameter, the decoder's included; ``full`` gathers them); and DDP
    at step 2 of ``loss.caption_warmup``'s 4 steps (each rank counts its own: half of weight 2.0)."""
    results = {parallel: gradients("loss.caption_weight=1.5", "trainer.sub_batch=4", f"trainer.parallel={parallel}")
               for parallel in ("ddp", "fsdp")}
    results["warm-up, ddp"] = warmed_gradients(2, "loss.caption_weight=2.0", "loss.caption_warmup=0.5",
                                               "trainer.max_steps=8", "trainer.sub_batch=4")
    return results


def test_two_ranks_ddp_and_fsdp_equal_one_process(tmp_path):
    singles = {"ddp": gradients("loss.caption_weight=1.5"),
               "warm-up, ddp": gradients("loss.caption_weight=1.0", "trainer.max_steps=8")}
    singles["fsdp"] = singles["ddp"]
    for ranks in run_ranks(2, two_ranks, tmp_path=tmp_path):
        for parallel, result in ranks.items():
            single = singles[parallel]
            assert result["grads"].keys() == single["grads"].keys(), parallel
            assert rel_error(result["loss"], single["loss"]) <= 1e-6, parallel
            assert rel_error(flat(result["grads"]), flat(single["grads"])) <= 1e-5, parallel
            assert rel_error(decoder(result["grads"]), decoder(single["grads"])) <= 1e-5, parallel


def warmed_gradients(steps_done: int, *overrides: str) -> dict:
    """``gradients`` at the step after ``steps_done`` steps (the caption objective's count set, as a resume sets it)."""
    parts = RunParts.build(validate(compose(*COCA, *overrides)), init_distributed("cpu"))
    (caption,) = [objective for objective in parts.step.objectives if objective.name == "caption"]
    caption.steps = steps_done
    loss, _ = parts.step.gradients(parts.inputs(0))
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    result = {"loss": loss, "grads": grads, "warmup_steps": caption.warmup_steps, "weight": caption.weight}
    parts.close()
    return result


def test_the_caption_warmup_weighs_the_term_by_its_step_on_every_path():
    """``loss.caption_warmup=0.5`` of 8 steps: 4 steps of warm-up. At step 2 the term weighs half of
    ``loss.caption_weight=2.0``, exactly as ``caption_weight=1.0`` without it, on the one-pass step, GradCache and
    offload; at step 0 the decoder gets no gradient; from step 4 on, the whole weight."""
    warm = ["loss.caption_weight=2.0", "loss.caption_warmup=0.5", "trainer.max_steps=8"]
    half = gradients("loss.caption_weight=1.0", "trainer.max_steps=8")
    whole = gradients("loss.caption_weight=2.0", "trainer.max_steps=8")
    for more in ([], [f"trainer.sub_batch={BATCH // 4}"], [f"trainer.sub_batch={BATCH // 4}", "trainer.offload=true"]):
        mid = warmed_gradients(2, *warm, *more)
        assert (mid["warmup_steps"], mid["weight"]) == (4, 1.0), more
        assert rel_error(mid["loss"], half["loss"]) <= 1e-6, more
        assert rel_error(flat(mid["grads"]), flat(half["grads"])) <= 1e-5, more
        after = warmed_gradients(5, *warm, *more)
        assert rel_error(flat(after["grads"]), flat(whole["grads"])) <= 1e-5, more
        first = warmed_gradients(0, *warm, *more)
        assert decoder(first["grads"]).abs().sum() == 0 and first["weight"] == 0.0, more
        assert rel_error(flat(mid["grads"]), flat(first["grads"])) > 1e-3, more  # the weight reached the gradients


def test_the_caption_warmup_counts_its_steps_across_a_resume():
    from megabatch.train.step.objectives import Caption

    term = Caption(2.0, pad_id=0, device=torch.device("cpu"), warmup_steps=4)
    weights = []
    for _ in range(3):
        term.new_step()
        weights.append(term.weight)
    resumed = Caption(2.0, pad_id=0, device=torch.device("cpu"), warmup_steps=4)
    resumed.load_state_dict(term.state_dict())
    for _ in range(3):
        resumed.new_step()
        weights.append(resumed.weight)
    assert weights == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0]
    assert Caption(2.0, pad_id=0, device=torch.device("cpu")).state_dict() == {}  # no warm-up, no decoder: as before


def test_a_model_without_a_decoder_and_bad_weights_are_config_errors():
    with pytest.raises(ConfigError, match=r"loss\.caption_weight=1\.0 but model tiny has no caption decoder"):
        RunParts.build(validate(compose(*BASE, "loss.caption_weight=1.0")), init_distributed("cpu"))
    with pytest.raises(ConfigError, match=r"loss\.caption_weight=-1"):
        validate(compose("loss.caption_weight=-1"))
    with pytest.raises(ConfigError, match=r"loss\.caption_warmup=1\.5: give a share of the run's steps in \[0, 1\]"):
        validate(compose("loss.caption_weight=1.0", "loss.caption_warmup=1.5"))
    with pytest.raises(ConfigError, match=r"loss\.caption_warmup=0\.2 with loss\.caption_weight=0"):
        validate(compose("loss.caption_warmup=0.2"))


def test_caption_script_writes_a_caption_per_image(tmp_path, caplog, capsys):
    import json
    import logging

    import numpy as np

    from megabatch.data.shard_writer import encode_png
    from megabatch.models import build_model

    torch.manual_seed(0)
    model = build_model(compose("model=tiny_coca").model)
    ckpt = tmp_path / "coca.pt"
    torch.save({"model": model.state_dict(), "step": 0, "open_clip": model.description()}, ckpt)
    images = tmp_path / "images"
    (images / "more").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png", "more/c.png"):
        (images / name).write_bytes(encode_png(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)))
    (images / "broken.png").write_bytes(b"not an image")
    script = caption_script()
    with caplog.at_level(logging.WARNING):
        script.main([f"ckpt={ckpt}", f"images={images}", f"out={tmp_path / 'captions.jsonl'}", "max_len=8"])
    rows = [json.loads(line) for line in (tmp_path / "captions.jsonl").read_text().splitlines()]
    assert [Path(row["image"]).name for row in rows] == ["a.png", "b.png", "c.png"]
    assert all(isinstance(row["caption"], str) for row in rows) and "skipping" in caplog.text
    with pytest.raises(SystemExit) as exited:
        script.parse([f"ckpt={ckpt}", "images=/nowhere", "batch=0"])
    assert exited.value.code == 2 and "batch=" in capsys.readouterr().err


def caption_script():
    """scripts/caption.py as a module (its main() in this process: no interpreter start-up)."""
    import importlib.util

    from ..helpers import ROOT

    spec = importlib.util.spec_from_file_location("caption", ROOT / "scripts" / "caption.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAIN = [*BASE, "model=tiny", "loss=infcl", "loss.tile=8", "model.image.patch_dropout=0"]
LATE = ["model.decoder.layers=1", "model.decoder.width=32", "model.decoder.heads=2",
        "self_distill.weight=1.0", "self_distill.masked_weight=0.25", "self_distill.start=0",
        "self_distill.local_crops=2", "self_distill.local_size=16", "self_distill.prototypes=32",
        "self_distill.hidden=32", "self_distill.bottleneck=16"]


@pytest.mark.slow  # inductor compiles the caption graphs (and the views') on the CPU: ~80 s each (make test-all)
@pytest.mark.parametrize("base, extra", [(COCA, []), (PLAIN, LATE)], ids=["coca", "decoder+self-distill"])
def test_model_compile_compiles_the_caption_pass_in_the_warm_up_and_keeps_its_gradients(base, extra):
    """The warm-up compiles what the objectives ask of the model (the caption graphs, self_distill's views): the step
    itself compiles nothing, and gives the eager loss and gradients."""
    extra = [*extra, "loss.caption_weight=2.0", f"trainer.sub_batch={BATCH // 4}"]
    eager = gradients(*extra, base=base)
    parts = RunParts.build(validate(compose(*base, *extra, "model.compile=true")), init_distributed("cpu"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    loss, _ = parts.step.gradients(parts.inputs(0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the step compiled a graph"
    assert parts.model._compiled_caption is not None
    grads = {n: full(p.grad).detach().clone() for n, p in parts.model.named_parameters() if p.grad is not None}
    parts.close()
    assert rel_error(loss, eager["loss"]) <= 1e-6
    assert rel_error(flat(grads), flat(eager["grads"])) <= 1e-5
    if base is COCA:
        assert rel_error(decoder(grads), decoder(eager["grads"])) <= 1e-5
