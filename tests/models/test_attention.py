"""``model.direct_attention``: open_clip's attention blocks computed on views of the packed projection
give the features and gradients of ``nn.MultiheadAttention`` (fp32, rounding only), keep the state
dict, and leave cross-attention blocks alone."""

from __future__ import annotations

import copy

import pytest
import torch
from open_clip.transformer import ResidualAttentionBlock

from megabatch.models import ClipModel
from megabatch.models.attention import DirectAttentionBlock, use_direct_attention

from ..helpers import interpreted_only, record_calls, rel_error
from .test_text_length import SMALL_IMAGE, SMALL_TEXT, built, captions

MODELS = {  # name -> (overrides, blocks changed)
    "tiny": (["model=tiny"], 5),
    "vit_b32": (["model=vit_b32", "model.text.layers=2", "model.image.layers=2"], 4),
    "ViT-B-32": (["model=openclip", "model.arch=ViT-B-32", *SMALL_TEXT, *SMALL_IMAGE], 3),
    "ViT-L-14-worldwide": (["model=openclip", "model.arch=ViT-L-14-worldwide", "+model.text.vocab_size=512",
                            *SMALL_TEXT, *SMALL_IMAGE], 3),
}


def images(model: ClipModel, rows: int) -> torch.Tensor:
    shape = model.example_inputs(rows, torch.device("cpu"))[0].shape
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


def features_and_grads(model: ClipModel, pixels: torch.Tensor, texts: torch.Tensor):
    model.zero_grad(set_to_none=True)
    image, text, scale, _ = model(pixels, texts)
    # a loss that weighs every feature differently
    weights = torch.linspace(-1, 1, image.numel(), device=image.device).view_as(image)
    (scale * (image * weights).sum() + (image @ text.T).square().sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return image.detach(), text.detach(), grads


@pytest.mark.parametrize("name", list(MODELS))
def test_direct_attention_gives_the_modules_features_and_gradients(name):
    overrides, blocks = MODELS[name]
    module = built([*overrides, "model.direct_attention=false"]).train()  # nn.MultiheadAttention's path
    direct = copy.deepcopy(module)
    assert use_direct_attention(direct) == blocks
    assert use_direct_attention(direct) == 0  # applied once
    assert direct.state_dict().keys() == module.state_dict().keys()
    module.trim_text()
    direct.trim_text()
    pixels, texts = images(module, 5), captions(module, 5)
    short = module.text_trim.cut(texts[1:])  # cut captions: the causal mask's prefix
    for inputs in ((pixels, texts), (pixels[1:], short)):
        expected, got = features_and_grads(module, *inputs), features_and_grads(direct, *inputs)
        for want, have in zip(expected, got, strict=True):
            assert rel_error(have, want) <= 1e-6
    # a state dict of one loads into the other
    direct.load_state_dict(module.state_dict())


@interpreted_only
@pytest.mark.parametrize("name", ["tiny", "ViT-B-32"])  # our towers, and an open_clip architecture's
def test_the_triton_kernels_give_sdpas_features_and_gradients(name, monkeypatch):
    """``model.attention=triton``: every block's attention runs in the Triton kernels (the text
    tower's causal, also at cut lengths), with SDPA's features and gradients, and the same state dict."""
    from megabatch.models import attention

    overrides, blocks = MODELS[name]
    sdpa = built([*overrides, "model.attention=sdpa"]).train()
    triton = built([*overrides, "model.attention=triton"]).train()
    assert triton.state_dict().keys() == sdpa.state_dict().keys()
    triton.load_state_dict(sdpa.state_dict())
    causal = [m.causal_mask for m in triton.modules() if isinstance(m, DirectAttentionBlock)]
    assert len(causal) == blocks and any(causal) and not all(causal)  # the text blocks, not the image blocks
    calls = record_calls(monkeypatch, attention, "packed_attention", lambda qkv, causal: causal)
    sdpa.trim_text()
    triton.trim_text()
    pixels, texts = images(sdpa, 5), captions(sdpa, 5)
    for inputs in ((pixels, texts), (pixels[1:], sdpa.text_trim.cut(texts[1:]))):
        calls.clear()
        expected, got = features_and_grads(sdpa, *inputs), features_and_grads(triton, *inputs)
        assert sorted(calls) == sorted(causal)  # each block once, causal where its tower is
        for want, have in zip(expected, got, strict=True):
            assert rel_error(have, want) <= 1e-5


@interpreted_only
def test_auto_runs_the_kernels_where_a_backward_follows_and_sdpa_elsewhere(monkeypatch):
    """``model.attention=auto`` asks ``faster_than_sdpa`` per call: the Triton kernels in a forward
    that autograd records at the table's lengths (then the same features and gradients as SDPA);
    SDPA for shorter sequences, in a forward without autograd, at head dims above the table's and on
    devices it has no measurement for."""
    from megabatch.kernels import attention as kernels
    from megabatch.models import attention

    overrides, _ = MODELS["tiny"]
    sdpa = built([*overrides, "model.attention=sdpa"]).train()
    auto = built([*overrides, "model.attention=auto"]).train()
    auto.load_state_dict(sdpa.state_dict())
    calls = record_calls(monkeypatch, attention, "packed_attention", lambda qkv, causal: causal)
    sdpa.trim_text()
    auto.trim_text()
    pixels, texts = images(sdpa, 3), captions(sdpa, 3)
    features_and_grads(auto, pixels, texts)
    assert calls == []  # the CPU: no measurement, SDPA
    monkeypatch.setattr(kernels, "AUTO_DEVICES", ("cuda", "cpu"))  # as a GPU decides
    monkeypatch.setattr(kernels, "AUTO_MIN_LENGTH", 17)  # tiny's images (65 tokens), not its captions (16)
    expected, got = features_and_grads(sdpa, pixels, texts), features_and_grads(auto, pixels, texts)
    assert calls == [False] * 3  # the image tower's three blocks
    for want, have in zip(expected, got, strict=True):
        assert rel_error(have, want) <= 1e-5
    calls.clear()
    with torch.no_grad():  # GradCache's graph-free pass, evaluation
        auto(pixels, texts)
    assert calls == []
    monkeypatch.setattr(kernels, "AUTO_MAX_HEAD_DIM", 4)  # tiny's heads are wider than the table's
    features_and_grads(auto, pixels, texts)
    assert calls == []


def test_cross_attention_blocks_are_left_alone():
    coca = built(["model=openclip", "model.arch=coca_ViT-B-32", *SMALL_TEXT, *SMALL_IMAGE])
    use_direct_attention(coca)
    kinds = {name: type(m) for name, m in coca.named_modules() if isinstance(m, ResidualAttentionBlock)}
    crossing = [name for name, m in coca.named_modules() if hasattr(m, "ln_1_kv")]
    assert crossing and all(kinds[name] is ResidualAttentionBlock for name in crossing)
    assert any(kind is DirectAttentionBlock for kind in kinds.values())  # its self-attention blocks


def test_the_run_applies_it_by_default_and_can_turn_it_off():
    from megabatch.config.schema import validate
    from megabatch.distributed import init_distributed
    from megabatch.train.build.parts import RunParts

    from ..helpers import compose

    for setting, kind in (("true", DirectAttentionBlock), ("false", ResidualAttentionBlock)):
        parts = RunParts.build(validate(compose("eval=none", f"model.direct_attention={setting}")),
                               init_distributed("cpu"))
        assert type(parts.model.clip.transformer.resblocks[0]) is kind
        parts.close()


