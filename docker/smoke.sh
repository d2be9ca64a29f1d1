#!/usr/bin/env bash
# A GPU machine's smoke test of megabatch: the image's health check (with --quick), and a check by hand on any
# CUDA machine, inside the image or outside it (then with the package importable: pip install -e . or PYTHONPATH=src).
#   1. the package imports; torch, Triton and CUDA versions and the GPU are printed
#   2. the Triton loss kernels compile and run once on a small batch, checked against the plain-torch tiles
#   3. (not with --quick) python train.py trainer.max_steps=5 on the embedded digits, on the GPU, loss=infcl
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import torch
import torch.nn.functional as F
import triton

import megabatch
from megabatch.losses import InfClLoss

assert torch.cuda.is_available(), "smoke test: no CUDA device visible (docker run --gpus all ...)"
print(f"megabatch {megabatch.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
generator = torch.Generator(device="cuda").manual_seed(0)
images = F.normalize(torch.randn(1000, 96, device="cuda", generator=generator), dim=-1)
texts = F.normalize(images + torch.randn(1000, 96, device="cuda", generator=generator), dim=-1)
results = {}
for impl in ("triton", "torch"):  # exact fp32 dots: the two must agree to fp32 rounding
    inputs = [images.clone().requires_grad_(), texts.clone().requires_grad_(),
              torch.tensor(30.0, device="cuda", requires_grad=True)]
    loss = InfClLoss(impl=impl, fp32_precision="ieee", tile=256)(*inputs)
    loss.backward()
    results[impl] = [loss.detach(), *(x.grad for x in inputs)]
for name, got, want in zip(("loss", "d_image", "d_text", "d_scale"), results["triton"], results["torch"]):
    error = float((got - want).norm() / want.norm())
    print(f"triton vs torch {name}: relative error {error:.1e}", flush=True)
    assert error < 1e-4, f"smoke test: the Triton kernels disagree with the torch tiles ({name})"
print("kernels ok", flush=True)
PY
if [[ "${1:-}" != "--quick" ]]; then
    run_dir=$(mktemp -d)
    python train.py trainer.max_steps=5 trainer.log_every=1 trainer.device=cuda loss=infcl \
        name=smoke run_dir="$run_dir" hydra.run.dir="$run_dir"
    test -f "$run_dir/checkpoints/last.pt"
    rm -rf "$run_dir"
    echo "train ok"
fi
echo "smoke test passed"
