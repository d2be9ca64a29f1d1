"""model.fp8: a clear error off an FP8 GPU; which layers would train in FP8."""

from __future__ import annotations

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.models import build_model
from megabatch.models.fp8 import convert_to_fp8, fp8_eligible

from ..helpers import compose


def test_fp8_on_the_cpu_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="model.fp8=false"):
        validate(compose("model.fp8=true", "trainer.device=cpu"))
    with pytest.raises(ConfigError, match="model.fp8=true.*CPU"):
        convert_to_fp8(torch.nn.Linear(16, 16), torch.device("cpu"))
    with pytest.raises(ConfigError, match="true or false"):
        validate(compose("model.fp8=maybe"))


def test_the_layers_fp8_would_convert():
    model = build_model(compose().model)
    eligible = {name for name, module in model.named_modules() if fp8_eligible(module, name)}
    assert "clip.visual.transformer.resblocks.0.mlp.c_fc" in eligible
    assert "clip.transformer.resblocks.1.attn.out_proj" in eligible
    assert not any(name.endswith("in_proj") or "conv1" in name for name in eligible)
    locked = build_model(compose("model.lock_image=true").model)
    names = {name for name, module in locked.named_modules() if fp8_eligible(module, name)}
    assert names and not any(name.startswith("clip.visual.") for name in names)  # a frozen tower keeps bf16
