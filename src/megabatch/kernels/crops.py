"""The GPU decoding path's crop-and-resize (``data/gpu_decode.py``) as one Triton kernel launch per
image size: each program cuts one sample's box out of its decoded image and resizes a tile of the
output with PyTorch's antialiased resampling (``F.interpolate(..., antialias=True,
align_corners=False)``: bicubic or bilinear; nearest without antialiasing), computing each tap's
weight in float64 as ``gpu_decode.resample_matrices`` does, accumulating in float64, then clamping
and rounding half to even to uint8 as the CPU path does.

Why a kernel: ``gpu_decode.cropped_groups`` (the plain-torch form, kept for CPUs and as this
kernel's reference) is two dense products with per-sample resampling matrices, a few hundred short
GPU calls per sub-batch. The decoding threads run the crops beside the step, and every call takes
the interpreter lock, which the step's own thread then waits for: measured on an H100, the step's
phases grew by ~9 ms a 512-image sub-batch. Here a sub-batch is a handful of calls, reads each
input pixel from its uint8 image, and keeps no float copy of the images. Only float64 arithmetic
(no matrix units): nothing depends on the process-wide TF32 switch, which the step's loss turns, and
the same inputs give the same bits (the offload replay relies on it).
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

MODES = {"nearest": 0, "bilinear": 1, "bicubic": 2}
BLOCK_I, BLOCK_J = 16, 32  # output rows and columns per program

_compiling = threading.Lock()
_compiled: set = set()


@triton.jit
def _tap(index, start, length, full, size, k, MODE: tl.constexpr):
    """Output pixels ``index`` (float64) of an axis of ``size`` resampled from the window ``start ..
    start + length`` of an axis of ``full`` pixels: tap ``k``'s weight, not yet normalised, and the
    input pixel it reads (clamped into the image: a tap past the window weighs 0)."""
    scale = length / size
    if MODE == 0:  # nearest: one tap, floor(i * scale)
        within = tl.minimum(tl.floor(index * scale), length - 1.0)
        weight = tl.full(index.shape, 1.0, tl.float64)
    else:
        half = 2.0 if MODE == 2 else 1.0  # the filter's support: 2 (bicubic), 1 (bilinear)
        shrinking = scale >= 1.0
        support = tl.where(shrinking, half * scale, half)
        invscale = tl.where(shrinking, 1.0 / scale, 1.0)
        center = scale * (index + 0.5)
        xmin = tl.maximum((center - support + 0.5).to(tl.int64).to(tl.float64), 0.0)  # (trunc)
        xmax = tl.minimum((center + support + 0.5).to(tl.int64).to(tl.float64), length)
        within = xmin + k
        x = tl.abs((within - center + 0.5) * invscale)
        if MODE == 2:  # Keys' cubic, a = -0.5, the operations in gpu_decode.resample_matrices' order
            weight = tl.where(x < 1.0, ((1.5 * x - 2.5) * x) * x + 1.0,
                              tl.where(x < 2.0, ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0, 0.0))
        else:
            weight = tl.maximum(1.0 - x, 0.0)
        weight = tl.where(within < xmax, weight, 0.0)
    column = tl.minimum(within + start, full - 1.0).to(tl.int64)
    return weight, column


@triton.jit(do_not_specialize=["height", "width", "out_h", "out_w"])  # (a 1x1 black image is one)
def _crops_kernel(src, out, table, height, width, out_h, out_w,
                  MODE: tl.constexpr, K_H: tl.constexpr, K_W: tl.constexpr,
                  BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program ``(n, pi, pj)``: output tile ``pi, pj`` of sample ``n`` of one image size: ``src
    [m, 3, height, width]`` uint8, ``table [m, 5]`` int64 (top, left, box height, box width, the
    sample's row in ``out [N, 3, out_h, out_w]``)."""
    n = tl.program_id(0).to(tl.int64)
    top = tl.load(table + n * 5).to(tl.float64)
    left = tl.load(table + n * 5 + 1).to(tl.float64)
    box_h = tl.load(table + n * 5 + 2).to(tl.float64)
    box_w = tl.load(table + n * 5 + 3).to(tl.float64)
    row = tl.load(table + n * 5 + 4)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    fi, fj = i.to(tl.float64), j.to(tl.float64)
    full_h, full_w = height.to(tl.float64), width.to(tl.float64)
    size_h, size_w = out_h.to(tl.float64), out_w.to(tl.float64)

    total_i = tl.zeros((BLOCK_I,), tl.float64)
    for a in tl.static_range(K_H):
        weight, _ = _tap(fi, top, box_h, full_h, size_h, a, MODE)
        total_i += weight
    total_j = tl.zeros((BLOCK_J,), tl.float64)
    for b in tl.static_range(K_W):
        weight, _ = _tap(fj, left, box_w, full_w, size_w, b, MODE)
        total_j += weight

    plane = height.to(tl.int64) * width
    base = src + n * 3 * plane
    red = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    green = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    blue = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    for a in tl.static_range(K_H):  # down the rows first, as the dense form's first product
        weight_i, column_i = _tap(fi, top, box_h, full_h, size_h, a, MODE)
        weight_i = tl.where(total_i != 0.0, weight_i / tl.where(total_i != 0.0, total_i, 1.0), weight_i)
        for b in tl.static_range(K_W):
            weight_j, column_j = _tap(fj, left, box_w, full_w, size_w, b, MODE)
            weight_j = tl.where(total_j != 0.0, weight_j / tl.where(total_j != 0.0, total_j, 1.0), weight_j)
            at = column_i[:, None] * width + column_j[None, :]
            both = weight_i[:, None] * weight_j[None, :]
            red += both * tl.load(base + at).to(tl.float64)
            green += both * tl.load(base + plane + at).to(tl.float64)
            blue += both * tl.load(base + 2 * plane + at).to(tl.float64)

    inside = (i[:, None] < out_h) & (j[None, :] < out_w)
    out_plane = out_h.to(tl.int64) * out_w
    target = out + row * 3 * out_plane + i[:, None] * out_w + j[None, :]
    tl.store(target, _to_uint8(red), mask=inside)
    tl.store(target + out_plane, _to_uint8(green), mask=inside)
    tl.store(target + 2 * out_plane, _to_uint8(blue), mask=inside)


@triton.jit
def _to_uint8(value):
    """Clamped to [0, 255] and rounded half to even (``torch.round``), as uint8."""
    value = tl.minimum(tl.maximum(value, 0.0), 255.0)
    rounded = tl.floor(value + 0.5)
    odd = rounded - 2.0 * tl.floor(rounded * 0.5) == 1.0
    rounded = tl.where((rounded - value == 0.5) & odd, rounded - 1.0, rounded)
    return rounded.to(tl.int32).to(tl.uint8)


def taps_bucket(taps: int) -> int:
    """Taps per output pixel rounded up to a multiple of 4 (extra taps weigh 0): few compiled
    variants, however the crop sizes vary."""
    return taps if taps == 1 else -(-taps // 4) * 4


def crop_groups(groups: list[tuple], table: torch.Tensor, size: tuple[int, int], interpolation: str,
                taps_per_group: list[tuple[int, int]]) -> torch.Tensor:
    """``[n, 3, s_h, s_w]`` uint8: for each ``(rows, pixels [m, 3, h, w])`` of ``groups`` (uint8,
    on the device), its ``m`` rows of ``table`` (on the device, groups in order: top, left, box
    height, box width, output row) cut and resized, with ``taps_per_group`` (rows, columns) taps
    per output pixel (``gpu_decode.taps``)."""
    n = len(table)
    device = groups[0][1].device if groups else table.device
    out = torch.empty((n, 3, *size), dtype=torch.uint8, device=device)
    mode = MODES[interpolation]
    done = 0
    for (_, pixels), (taps_h, taps_w) in zip(groups, taps_per_group, strict=True):
        count, _, height, width = pixels.shape
        k_h, k_w = taps_bucket(taps_h), taps_bucket(taps_w)
        grid = (count, triton.cdiv(size[0], BLOCK_I), triton.cdiv(size[1], BLOCK_J))
        args = (pixels.contiguous(), out, table[done:done + count], height, width, size[0], size[1])
        key = (device, mode, k_h, k_w)
        if key in _compiled:
            _crops_kernel[grid](*args, MODE=mode, K_H=k_h, K_W=k_w, BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J)
        else:  # the first launch of a variant compiles it: one thread at a time
            with _compiling:
                _crops_kernel[grid](*args, MODE=mode, K_H=k_h, K_W=k_w, BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J)
                _compiled.add(key)
        done += count
    return out
