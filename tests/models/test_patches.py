"""``model.patch_gemm``: a ViT's patch embedding as a GEMM on its patches gives the convolution's
features and gradients (fp32, rounding only) and keeps the state dict."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megabatch.models.patches import PatchGemm, use_patch_gemm

from ..helpers import rel_error
from .test_attention import features_and_grads, images
from .test_text_length import SMALL_IMAGE, SMALL_TEXT, built, captions

MODELS = {
    "tiny": ["model=tiny"],
    "vit_b32": ["model=vit_b32", "model.text.layers=2", "model.image.layers=2"],
    "ViT-B-16": ["model=openclip", "model.arch=ViT-B-16", *SMALL_TEXT, *SMALL_IMAGE[:-1],
                 "+model.image.layers=2"],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_patch_gemm_gives_the_convolutions_features_and_gradients(name):
    conv = built([*MODELS[name], "model.patch_gemm=false"]).train()
    gemm = copy.deepcopy(conv)
    assert type(conv.clip.visual.conv1) is nn.Conv2d
    assert use_patch_gemm(gemm) == 1
    assert use_patch_gemm(gemm) == 0  # applied once
    assert type(gemm.clip.visual.conv1) is PatchGemm
    assert gemm.state_dict().keys() == conv.state_dict().keys()
    conv.trim_text()  # the captions' padding id
    pixels, texts = images(conv, 5), captions(conv, 5)
    expected, got = features_and_grads(conv, pixels, texts), features_and_grads(gemm, pixels, texts)
    for want, have in zip(expected, got, strict=True):
        assert rel_error(have, want) <= 1e-6
    conv.load_state_dict(gemm.state_dict())  # a state dict of one loads into the other


def test_a_size_that_is_not_a_whole_number_of_patches_drops_the_rest_as_the_convolution_does():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, kernel_size=(4, 6), stride=(4, 6), bias=True)
    gemm = copy.deepcopy(conv)
    gemm.__class__ = PatchGemm
    x = torch.randn(2, 3, 18, 25)  # 4 x 4 whole patches, with 2 rows and 1 column left over
    assert rel_error(gemm(x), conv(x)) <= 1e-6
    assert gemm(x).shape == conv(x).shape == (2, 8, 4, 4)


def test_the_run_applies_it_by_default_and_can_turn_it_off():
    from megabatch.config.schema import validate
    from megabatch.distributed import init_distributed
    from megabatch.train.build.parts import RunParts

    from ..helpers import compose

    for setting, kind in (("true", PatchGemm), ("false", nn.Conv2d)):
        parts = RunParts.build(validate(compose("eval=none", f"model.patch_gemm={setting}")),
                               init_distributed("cpu"))
        assert type(parts.model.clip.visual.conv1) is kind
        parts.close()
