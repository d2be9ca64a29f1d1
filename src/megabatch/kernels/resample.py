"""PyTorch's antialiased resampling (``F.interpolate(..., antialias=True, align_corners=False)``: bicubic or
bilinear; nearest without antialiasing) as per-sample matrices computed on the device: the plain-torch form of the
GPU decoding's crop-and-resize (``data/gpu_decode.py``; ``kernels/crops.py`` computes each tap's weight in the same
operations) and the resize of a NaFlex tower's learned position embeddings to each image's grid
(``models/naflex.py: PositionsOnDevice``)."""

from __future__ import annotations

import torch


def taps(lengths: torch.Tensor, out: int | torch.Tensor, interpolation: str) -> int:
    """The most input pixels one output pixel reads along an axis, for crops of ``lengths`` (CPU)
    resized to ``out`` (or each to its own, a CPU tensor): the filter's support, widened by the scale when
    shrinking, both sides."""
    if interpolation == "nearest" or len(lengths) == 0:
        return 1
    half = 2.0 if interpolation == "bicubic" else 1.0
    scale = float((lengths.double() / out.double()).max()) if torch.is_tensor(out) else int(lengths.max()) / out
    return int(2 * half * max(scale, 1.0)) + 2


def resample_matrices(start: torch.Tensor, length: torch.Tensor, full: int, out: int | torch.Tensor,
                      interpolation: str, dtype: torch.dtype = torch.float64, taps_per_pixel: int | None = None,
                      rows: int | None = None) -> torch.Tensor:
    """``[m, out, full]``: row ``i`` of sample ``k`` holds the weights that output pixel ``i`` gives
    the input pixels ``start[k] .. start[k] + length[k]`` along one axis (zero elsewhere): PyTorch's
    antialiased resampling (``aten/src/ATen/native/cpu/UpSampleKernel.cpp``, ``align_corners=False``):
    the filter widened by the scale when shrinking, cut to the window ``[xmin, xmax)``, normalised.
    The weights are computed in float64 over each output pixel's window only (``taps_per_pixel``
    input pixels, ``taps``: from the CPU's copy of the lengths, so nothing waits for the GPU) and
    scattered into the matrix of ``dtype``. ``out`` a tensor ``[m]``: each sample's own output length, the
    matrices ``rows`` long (rows past a sample's ``out`` are zero) and ``taps_per_pixel`` given (nothing is read
    to the host: a NaFlex tower's position embeddings, ``models/naflex.py``)."""
    device = start.device
    start, length = start.double()[:, None], length.double()[:, None]  # [m, 1]
    if torch.is_tensor(out):
        out, rows = out.double()[:, None], rows
    else:
        rows = out
    scale = length / out
    i = torch.arange(rows, device=device, dtype=torch.float64)[None, :]  # [1, rows]
    if interpolation == "nearest":  # F.interpolate's nearest: source floor(i * scale)
        within = torch.minimum(torch.floor(i * scale), length - 1)[..., None]  # [m, out, 1]
        weights = torch.ones_like(within)
    else:
        half = 2.0 if interpolation == "bicubic" else 1.0  # the filter's support: 2 (bicubic), 1 (bilinear)
        shrinking = scale >= 1.0
        support = torch.where(shrinking, half * scale, torch.full_like(scale, half))
        invscale = torch.where(shrinking, 1.0 / scale, torch.ones_like(scale))
        center = scale * (i + 0.5)  # [m, out]
        xmin = torch.clamp(torch.trunc(center - support + 0.5), min=0.0)
        xmax = torch.minimum(torch.trunc(center + support + 0.5), length)
        if taps_per_pixel is None:
            taps_per_pixel = taps(length.cpu(), out, interpolation)
        within = xmin[..., None] + torch.arange(taps_per_pixel, device=device, dtype=torch.float64)  # [m, out, K]
        x = ((within - center[..., None] + 0.5) * invscale[..., None]).abs()
        if interpolation == "bicubic":  # Keys' cubic with a = -0.5, as PIL and PyTorch's antialiasing
            a = -0.5
            weights = torch.where(x < 1.0, ((a + 2) * x - (a + 3)) * x * x + 1,
                                  torch.where(x < 2.0, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, torch.zeros_like(x)))
        else:
            weights = torch.clamp(1.0 - x, min=0.0)
        weights = torch.where(within < xmax[..., None], weights, torch.zeros_like(weights))
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total != 0, weights / total, weights)
    columns = (within + start[..., None]).clamp_(max=full - 1).long()  # taps past the window weigh 0
    matrices = torch.zeros((len(start), rows, full), dtype=dtype, device=device)
    return matrices.scatter_add_(2, columns, weights.to(dtype))
