"""optim.layer_decay (train/build/optim.py): each tower's blocks get the peak lr times decay^(depth from that
tower's top), the embeddings at the bottom, the final norm and projection at the top, the logit scale
at the peak; the step sets each group's lr from the schedule times its scale; bad values name the key,
as do a bad optim=timm name and Muon under FSDP. (Resumes with each: test_resume.py.)"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from megabatch.config import ConfigError
from megabatch.data.samples import SubBatch
from megabatch.models import build_model
from megabatch.train.build.optim import build_optimizer, describe_param_groups
from megabatch.train.step.step import TrainStep

from ..helpers import compose, fixed_batch


def scales(overrides: list[str]) -> tuple[dict[str, float], dict[str, float], torch.optim.Optimizer]:
    """Each trainable parameter's lr scale and weight decay in the optimizer ``overrides`` build."""
    cfg = compose(*overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer, _ = build_optimizer(cfg.optim, model, 128)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert len(group_of) == sum(len(g["params"]) for g in optimizer.param_groups) == len(named)  # each once
    return ({name: group_of[id(p)].get("lr_scale", 1.0) for name, p in named},
            {name: group_of[id(p)]["weight_decay"] for name, p in named}, optimizer)


def test_each_tower_counts_its_blocks_from_its_own_top():
    scale, decay, optimizer = scales(["optim.layer_decay.image=0.5", "optim.layer_decay.text=0.8"])
    image_top, text_top = 4, 3  # the tiny towers: 3 image blocks, 2 text blocks, then the head
    expected = {
        "clip.visual.conv1.weight": 0.5 ** image_top, "clip.visual.class_embedding": 0.5 ** image_top,
        "clip.visual.positional_embedding": 0.5 ** image_top, "clip.visual.ln_pre.weight": 0.5 ** image_top,
        "clip.visual.transformer.resblocks.0.attn.in_proj_weight": 0.5 ** 3,
        "clip.visual.transformer.resblocks.2.mlp.c_fc.weight": 0.5,
        "clip.visual.ln_post.weight": 1.0, "clip.visual.proj": 1.0,
        "clip.token_embedding.weight": 0.8 ** text_top, "clip.positional_embedding": 0.8 ** text_top,
        "clip.transformer.resblocks.0.ln_1.bias": 0.8 ** 2, "clip.transformer.resblocks.1.attn.out_proj.weight": 0.8,
        "clip.ln_final.weight": 1.0, "clip.text_projection": 1.0, "clip.logit_scale": 1.0,
    }
    for name, value in expected.items():
        assert scale[name] == pytest.approx(value, rel=1e-12), name
    # weight decay as without layer decay: matrices only
    assert decay["clip.visual.transformer.resblocks.0.attn.in_proj_weight"] == 0.2
    assert decay["clip.transformer.resblocks.0.ln_1.bias"] == decay["clip.logit_scale"] == 0.0
    table = "\n".join(describe_param_groups(optimizer))
    assert "| image/depth 0 of 4 |" in table and "| scale/bias/all |" in table


def test_a_hugging_face_text_tower_and_one_number_for_both_towers():
    scale, _, _ = scales(["model=tiny_minilm", "optim.layer_decay=0.9"])
    assert scale["clip.text.transformer.embeddings.word_embeddings.weight"] == pytest.approx(0.9 ** 7)
    assert scale["clip.text.transformer.encoder.layer.0.attention.self.query.weight"] == pytest.approx(0.9 ** 6)
    assert scale["clip.text.transformer.encoder.layer.5.output.dense.weight"] == pytest.approx(0.9)
    assert scale["clip.text.proj.weight"] == 1.0 and scale["clip.visual.proj"] == 1.0
    assert scale["clip.visual.conv1.weight"] == pytest.approx(0.9 ** 4)


def test_off_by_default_and_for_a_tower_left_null():
    plain, _, optimizer = scales([])
    assert set(plain.values()) == {1.0} and len(optimizer.param_groups) == 2  # today's two groups
    assert all("lr_scale" not in group for group in optimizer.param_groups)
    image_only, _, _ = scales(["optim.layer_decay.image=0.5"])
    assert image_only["clip.transformer.resblocks.0.ln_1.bias"] == image_only["clip.token_embedding.weight"] == 1.0
    assert image_only["clip.visual.conv1.weight"] == 0.5 ** 4


def test_the_step_moves_each_parameter_by_its_scale_of_the_plain_update():
    """SGD: with layer decay each parameter moves by its scale times the move without it (to the
    rounding of the weights themselves: a move is the difference of two float32 weights)."""
    moves, start = {}, {}
    for overrides in ([], ["optim.layer_decay.image=0.5", "optim.layer_decay.text=0.8"]):
        cfg = compose("optim=sgd", *overrides)
        torch.manual_seed(0)
        model = build_model(cfg.model)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer, lr = build_optimizer(cfg.optim, model, 16)
        step = TrainStep(model, instantiate(cfg.loss), optimizer, torch.device("cpu"), precision="fp32")
        images, texts = fixed_batch(model.tokenizer())
        step.step(iter([SubBatch(images, texts, None)]), lr)
        step.settle()
        moves[bool(overrides)] = {name: p.detach() - before[name] for name, p in model.named_parameters()}
        start = before
    scale, _, _ = scales(["optim.layer_decay.image=0.5", "optim.layer_decay.text=0.8"])
    for name, plain in moves[False].items():
        ulps = 4 * torch.finfo(torch.float32).eps * (start[name].abs() + plain.abs()).max().item()
        torch.testing.assert_close(moves[True][name], scale[name] * plain, rtol=0, atol=ulps, msg=name)
    assert any(scale[name] < 1 and moves[True][name].abs().sum() > 0 for name in scale)


@pytest.mark.parametrize("override", ["optim.layer_decay.image=1.5", "optim.layer_decay.text=0",
                                      "optim.layer_decay=abc", "+optim.layer_decay.decoder=0.5"])
def test_a_bad_layer_decay_names_the_key(override):
    from megabatch.config.schema import validate

    with pytest.raises(ConfigError, match=r"optim\.layer_decay"):
        validate(compose(override))


def test_a_bad_timm_optimizer_names_the_key():
    from megabatch.config.schema import validate

    cfg = validate(compose("optim=timm", "optim.name=no_such"))  # the name is timm's to check, when built
    with pytest.raises(ConfigError, match=r"optim\.name='no_such'"):
        build_optimizer(cfg.optim, build_model(cfg.model), 128)
    with pytest.raises(ConfigError, match=r"optim\.name=muon with trainer\.parallel=fsdp"):
        validate(compose("optim=timm", "optim.name=muon", "trainer.parallel=fsdp"))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    """optim=muon (torch.optim.Muon with AdamW): the split by hand on the tiny towers, layer decay and weight
    decay kept in both halves, AdamW's own lr (optim.optimizer.adamw_lr), a step through TrainStep that
    moves every parameter, and Muon refused under FSDP."""
    from megabatch.config.schema import validate
    from megabatch.train.build.optim import MuonWithAdamW

    scale, decay, optimizer = scales(["optim=muon", "optim.layer_decay.image=0.5", "optim.lr=0.01",
                                      "optim.optimizer.adamw_lr=0.002"])
    assert isinstance(optimizer, MuonWithAdamW)
    cfg = compose("optim=muon")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    muon = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    by_name = {n: p for n, p in model.named_parameters()}
    expected_muon = sorted(n for n, p in by_name.items() if p.ndim == 2 and ".resblocks." in n)
    # the embeddings, the projections after the last block, norms, biases and the logit scale go to AdamW
    assert "clip.visual.transformer.resblocks.0.attn.in_proj_weight" in expected_muon
    assert "clip.transformer.resblocks.1.mlp.c_proj.weight" in expected_muon
    rebuilt, _ = build_optimizer(validate(compose("optim=muon")).optim, model, 128)
    got_muon = sorted(n for n, p in by_name.items() if id(p) in
                      {id(q) for g in rebuilt.muon.param_groups for q in g["params"]})
    assert got_muon == expected_muon and len(muon) == len(expected_muon)
    for name in ("clip.token_embedding.weight", "clip.text_projection", "clip.visual.proj", "clip.logit_scale",
                 "clip.visual.conv1.weight", "clip.visual.transformer.resblocks.0.ln_1.weight"):
        assert id(by_name[name]) in {id(q) for g in rebuilt.adamw.param_groups for q in g["params"]}, name
    # layer decay on both halves, AdamW's lr x 0.2 (0.002 / 0.01); weight decay on matrices only
    assert scale["clip.visual.transformer.resblocks.0.attn.in_proj_weight"] == pytest.approx(0.5 ** 3)
    assert scale["clip.visual.ln_post.weight"] == pytest.approx(0.2)
    assert scale["clip.visual.conv1.weight"] == pytest.approx(0.2 * 0.5 ** 4)
    assert decay["clip.visual.transformer.resblocks.0.attn.in_proj_weight"] == 0.2 == decay["clip.text_projection"]
    assert "(Muon)" in "\n".join(describe_param_groups(optimizer))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    images, texts = fixed_batch(model.tokenizer())
    step = TrainStep(model, instantiate(cfg.loss), rebuilt, torch.device("cpu"))
    step.step(iter([SubBatch(images, texts, None)]), lr=0.01)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert all("momentum_buffer" in rebuilt.state[by_name[n]] for n in expected_muon)
    assert all("exp_avg" in rebuilt.state[by_name[n]] for n in ("clip.visual.proj", "clip.logit_scale"))
    with pytest.raises(ConfigError, match=r"optim=muon with trainer\.parallel=fsdp"):
        validate(compose("optim=muon", "trainer.parallel=fsdp"))
