"""Both builders take one type, ``ModelSpec``: an unknown key is named with its nearest option, and a key that is
the other builder's is refused with the fix; the built-in shape's defaults are CLIP's."""

from __future__ import annotations

import math

import pytest
from hydra.utils import instantiate

from megabatch.config import ConfigError
from megabatch.models import build_clip, build_openclip
from megabatch.models.clip import builder_node
from megabatch.models.spec import ModelSpec

from ..helpers import compose


def test_both_builders_read_one_spec_and_name_what_is_not_theirs():
    tiny = compose().model
    with pytest.raises(ConfigError, match=r"model\.embed_dims: no such option; did you mean model\.embed_dim\?"):
        build_clip(name="tiny", embed_dims=32, image={}, text={})
    with pytest.raises(ConfigError, match=r"model\.arch='ViT-B-32' is not build_clip's: .* model=openclip"):
        build_clip(name="tiny", embed_dim=32, arch="ViT-B-32")
    with pytest.raises(ConfigError, match=r"model\.multimodal=.* is not build_openclip's: .*coca_ViT-B-32"):
        build_openclip(arch="ViT-B-32", multimodal={"width": 64})
    with pytest.raises(ConfigError, match=r"model\.embed_dim is not set: build_clip needs it"):
        build_clip(name="tiny", image=dict(tiny.image), text=dict(tiny.text))
    model = instantiate(builder_node(tiny), _convert_="all")  # the builder's keys: the spec's fields
    assert set(builder_node(tiny)) - {"_target_"} <= set(ModelSpec.__dataclass_fields__)
    assert math.isclose(float(model.clip.logit_scale), math.log(1 / 0.07), rel_tol=1e-6)  # CLIP's temperature
