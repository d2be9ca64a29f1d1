"""What ``trainer.feature_dtype=bf16`` (``auto`` with bf16 towers) costs the loss: GradCache keeps the
features in bf16 between phase 1 and the loss, which then runs on them as fp32. Loss value, feature
gradients and scale gradient of the configured loss on bf16-rounded features and on fp32 features,
each against float64 on the fp32 features (the towers' output), for the softmax and sigmoid losses.

    python scripts/benchmarks/feature_dtype.py --out feature_dtype.json               # CPU: torch tiles
    python scripts/benchmarks/feature_dtype.py --device cuda --batches 32k,256k --out feature_dtype.json
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import write_results
from hydra.utils import instantiate

from megabatch.config import parse_count
from megabatch.config.compose import compose


def loss_and_grads(loss_fn, images, texts, scale, bias=None):
    inputs = [images.clone().requires_grad_(), texts.clone().requires_grad_(), scale.clone().requires_grad_()]
    if bias is not None:
        inputs.append(bias.clone().requires_grad_())
    loss = loss_fn(*inputs)
    return loss.detach(), torch.autograd.grad(loss, inputs)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="4096")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device, results = torch.device(args.device), []
    for loss_name in ("infcl", "siglip"):
        loss_fn = instantiate(compose(f"loss={loss_name}").loss)
        reference = instantiate(compose("loss=vanilla").loss) if loss_name == "infcl" else loss_fn
        for b in (parse_count(v, "--batches") for v in args.batches.split(",")):
            generator = torch.Generator().manual_seed(b)
            # matched pairs with noise: features as a trained CLIP gives them, L2-normalised
            images = F.normalize(torch.randn(b, args.dim, generator=generator, dtype=torch.float64), dim=-1)
            noise = torch.randn(b, args.dim, generator=generator, dtype=torch.float64)
            texts = F.normalize(images + 0.8 * noise, dim=-1)
            images, texts = images.float().to(device), texts.float().to(device)
            scale = torch.tensor(100.0 if loss_name == "infcl" else 10.0, device=device)
            bias = torch.tensor(-10.0, device=device) if loss_name == "siglip" else None
            truth_loss, truth = loss_and_grads(reference, images.double(), texts.double(), scale.double(),
                                               None if bias is None else bias.double())
            row = {"loss": loss_name, "batch": b, "dim": args.dim, "device": args.device,
                   "loss_float64": float(truth_loss)}
            for dtype in ("fp32", "bf16"):
                stored = (images, texts) if dtype == "fp32" else (images.bfloat16().float(), texts.bfloat16().float())
                value, grads = loss_and_grads(loss_fn, *stored, scale, bias)
                row[dtype] = {"loss_rel_error": abs(float(value) / float(truth_loss) - 1),
                              "image_grad_rel_error": rel(grads[0], truth[0]),
                              "text_grad_rel_error": rel(grads[1], truth[1]),
                              "scale_grad_rel_error": rel(grads[2], truth[2])}
            print(row, flush=True)
            results.append(row)
            write_results(args.out, results)


if __name__ == "__main__":
    main()
