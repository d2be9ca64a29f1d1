"""``model.gelu=tanh``: the model with ``nn.GELU(approximate="tanh")`` in its blocks, the same with
and without autograd; bad values and removed options (``model.fused_mlp``, ``model.fused_layernorm``)
named with the fix."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.models import from_description
from megabatch.models.mlp import TanhGeluMlp

from ..helpers import compose, rel_error
from .test_attention import features_and_grads, images
from .test_text_length import built, captions


@pytest.mark.parametrize("overrides,message", [
    (["model.gelu=relu"], r"model\.gelu='relu': give erf"),
    (["+model.fused_mlp=true"], r"model\.fused_mlp is gone: the fused MLP kernels measured slower"),
    (["+model.fused_layernorm=true"], r"model\.fused_layernorm is gone"),
])
def test_where_it_cannot_run_the_config_says_so(overrides, message):
    """A bad value, and the options removed after their measurements, named with the fix."""
    from megabatch.config.schema import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


def test_tanh_gelu_is_the_model_with_tanh_gelus():
    exact = built(["model=tiny"]).train()
    tanh = built(["model=tiny", "model.gelu=tanh"]).train()
    assert sum(isinstance(m, TanhGeluMlp) for m in tanh.modules()) == 5
    assert tanh.state_dict().keys() == exact.state_dict().keys()
    tanh.load_state_dict(exact.state_dict())
    exact.trim_text()
    tanh.trim_text()
    reference = copy.deepcopy(exact)
    for module in reference.modules():
        if isinstance(module, torch.nn.GELU):
            module.approximate = "tanh"
    pixels, texts = images(exact, 3), captions(exact, 3)
    want = features_and_grads(reference, pixels, texts)
    for expected, have in zip(want, features_and_grads(tanh, pixels, texts), strict=True):
        assert rel_error(have, expected) <= 1e-6
    assert rel_error(features_and_grads(exact, pixels, texts)[0], want[0]) > 1e-5  # not the exact GELU's
    with torch.no_grad():  # the graph-free pass (cuBLASLt's epilogue on a GPU) gives the same features
        assert rel_error(tanh(pixels, texts)[0], want[0]) <= 1e-6
    # a checkpoint's description (scripts/evaluate.py, an export read by open_clip) rebuilds the tanh GELU
    rebuilt = from_description(tanh.description())
    rebuilt.load_state_dict(tanh.state_dict())
    gelus = [m for m in rebuilt.modules() if isinstance(m, torch.nn.GELU)]
    assert len(gelus) == 5 and all(m.approximate == "tanh" for m in gelus)
    rebuilt.trim_text()
    with torch.no_grad():
        assert rel_error(rebuilt(pixels, texts)[0], want[0]) <= 1e-6


def test_tanh_gelu_on_a_model_without_gelu_mlps_is_refused():
    with pytest.raises(ConfigError, match="no GELU MLP to change"):
        built(["model=tiny", "model.quick_gelu=true", "model.gelu=tanh"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's GELU epilogue runs on a GPU")
def test_tanh_gelu_without_autograd_is_cublaslts_epilogue_of_the_same_function():
    from megabatch.models.mlp import use_tanh_gelu

    mlp = torch.nn.Module()
    mlp.mlp = torch.nn.Sequential(OrderedDict([("c_fc", torch.nn.Linear(64, 256)), ("gelu", torch.nn.GELU()),
                                               ("c_proj", torch.nn.Linear(256, 64))])).cuda()
    assert use_tanh_gelu(mlp) == 1
    x = torch.randn(3, 50, 64, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        with torch.no_grad():
            fast = mlp.mlp(x)
        graph = mlp.mlp(x.requires_grad_())
    assert fast.dtype == graph.dtype == torch.bfloat16
    assert rel_error(fast.float(), graph.detach().float()) <= 1e-2


def test_writing_embeddings_with_the_tanh_gelu_moves_them_little_and_keeps_the_models_config():
    """``make_shards.py --gelu``: ``for_inference(model, "tanh")`` gives the blocks the tanh GELU (cuBLASLt's fused
    epilogue on a GPU) without recording it in the model's config (the features belong to the exact model); its
    features are near the exact ones (1e-3 relative; ViT-L/14's in bf16 on an H200: cosine 0.99996 at the least,
    as inductor's autotuned GEMMs give with the exact GELU), though not equal."""
    from megabatch.train.step.teacher import for_inference, writing_gelu

    exact = built(["model=tiny"]).eval()
    pixels = images(exact, 8)
    with torch.no_grad():
        reference = exact.encode_image(pixels)
        erf = for_inference(copy.deepcopy(exact), "erf")
        tanh = for_inference(copy.deepcopy(exact), "tanh")
        assert not any(isinstance(m, TanhGeluMlp) for m in erf.modules())
        assert sum(isinstance(m, TanhGeluMlp) for m in tanh.modules()) == 5
        assert tanh.model_cfg == exact.model_cfg  # what a description rebuilds: the exact GELU
        assert rel_error(erf.encode_image(pixels), reference) <= 1e-5
        moved = rel_error(tanh.encode_image(pixels), reference)
    assert 1e-6 < moved < 1e-3, moved
    assert writing_gelu("auto", torch.device("cpu")) == "erf" and writing_gelu("auto", torch.device("cuda")) == "tanh"
    assert writing_gelu("erf", torch.device("cuda")) == "erf"
    with pytest.raises(ValueError, match="tanh or erf"):
        for_inference(copy.deepcopy(exact), "fast")
