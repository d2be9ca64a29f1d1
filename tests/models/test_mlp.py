"""``model.fused_mlp``: the blocks' MLPs through the fused GELU GEMMs give the features and gradients
of open_clip's ``c_fc -> nn.GELU -> c_proj`` (fp32, rounding only), keep the state dict, leave other
MLPs alone, and are refused where they cannot run. ``model.gelu=tanh``: the model with
``nn.GELU(approximate="tanh")`` in its blocks, the same with and without autograd."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.models import from_description
from megabatch.models.mlp import FusedMlp, TanhGeluMlp

from ..helpers import compose, interpreted_only, rel_error
from .test_attention import features_and_grads, images
from .test_text_length import SMALL_IMAGE, SMALL_TEXT, built, captions

MODELS = {  # name -> (overrides, MLPs fused)
    "tiny": (["model=tiny"], 5),
    "ViT-B-32": (["model=openclip", "model.arch=ViT-B-32", *SMALL_TEXT, *SMALL_IMAGE], 3),
}


@interpreted_only
@pytest.mark.parametrize("name", list(MODELS))
def test_the_fused_mlp_gives_the_modules_features_and_gradients(name):
    overrides, count = MODELS[name]
    plain = built(overrides).train()
    fused = built([*overrides, "model.fused_mlp=true"]).train()
    assert sum(isinstance(m, FusedMlp) for m in fused.modules()) == count
    assert fused.state_dict().keys() == plain.state_dict().keys()
    fused.load_state_dict(plain.state_dict())
    plain.trim_text()
    fused.trim_text()
    pixels, texts = images(plain, 3), captions(plain, 3)
    for want, have in zip(features_and_grads(plain, pixels, texts), features_and_grads(fused, pixels, texts),
                          strict=True):
        assert rel_error(have, want) <= 1e-5
    with torch.autocast("cpu", torch.bfloat16):  # autocast's casts: the parameters' gradients stay fp32
        image = fused(pixels, texts)[0]
    image.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for m in fused.modules() if isinstance(m, FusedMlp)
               for p in m.parameters())


def test_quick_gelu_and_tanh_mlps_are_left_alone():
    quick = built(["model=tiny", "model.quick_gelu=true", "model.fused_mlp=true"])
    assert not any(isinstance(m, FusedMlp) for m in quick.modules())


@pytest.mark.parametrize("overrides,message", [
    (["model.fused_mlp=true", "trainer.device=cpu"], "on the CPU"),
    (["model.fused_mlp=true", "model.fp8=true"], "set one of them to false"),
    (["model.fused_mlp=yes"], r"model\.fused_mlp"),
    (["model.gelu=relu"], r"model\.gelu='relu': give erf"),
    (["model.gelu=tanh", "model.fused_mlp=true"], "set model.fused_mlp=false or model.gelu=erf"),
])
def test_where_it_cannot_run_the_config_says_so(overrides, message, monkeypatch):
    from megabatch.config.schema import validate

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tests' interpreter runs it on the CPU

    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))


@interpreted_only
def test_compiled_under_autocast_it_is_one_graph():
    """``FusedMlp``'s autocast casts trace (no graph break): the op sees one dtype, the parameters'
    gradients come back in theirs."""
    from megabatch.models.mlp import use_fused_mlp

    torch._dynamo.reset()
    block = torch.nn.Module()
    block.mlp = torch.nn.Sequential(OrderedDict([("c_fc", torch.nn.Linear(32, 64)), ("gelu", torch.nn.GELU()),
                                                 ("c_proj", torch.nn.Linear(64, 32))]))
    plain = copy.deepcopy(block.mlp)
    assert use_fused_mlp(block) == 1
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", torch.bfloat16):
        got, want = torch.compile(block.mlp, fullgraph=True)(x), plain(x)
    assert got.dtype == want.dtype == torch.bfloat16 and rel_error(got.detach().float(), want.detach().float()) <= 1e-2
    got.float().sum().backward()
    assert block.mlp.c_fc.weight.grad.dtype == torch.float32


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
