"""Build open_clip architectures by name through megabatch (``model=openclip``), random weights, and
encode one batch of images and tokens in bf16 on the GPU; writes ``$OUT/archs_by_name.json``.

    python scripts/check_archs.py ViT-B-32 ViT-B-16-SigLIP EVA02-B-16 convnext_base coca_ViT-B-32
"""
import json
import os
import sys
import time

import torch

from megabatch.config.compose import compose
from megabatch.models import build_model

out = []
for arch in sys.argv[1:]:
    row = {"arch": arch}
    try:
        started = time.perf_counter()
        with torch.device("cuda"):
            model = build_model(compose("model=openclip", f"model.arch={arch}").model)
        size = model.image_size if isinstance(model.image_size, int) else model.image_size[0]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            features = model.encode_image(torch.randint(0, 256, (8, 3, size, size), dtype=torch.uint8, device="cuda"))
            texts = torch.randint(1, 1000, (8, model.context_length), device="cuda")
            text_features = model.encode_text(texts)
        row.update(ok=True, params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                   image=list(features.shape), text=list(text_features.shape), bias=model.logit_bias is not None,
                   preprocess={k: model.preprocess[k] for k in ("size", "mean", "interpolation", "resize_mode")},
                   seconds=round(time.perf_counter() - started, 1))
        del model
    except Exception as error:  # noqa: BLE001
        row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:200]}")
    print(json.dumps(row), flush=True)
    out.append(row)
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "archs_by_name.json"), "w"), indent=1)
