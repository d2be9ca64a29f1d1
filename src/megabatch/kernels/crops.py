"""The GPU decoding path's resampling matrices (``data/gpu_decode.py``) built by one Triton launch:
for each sample of a chunk, the ``[out, full]`` matrix whose row ``i`` holds the weights that output
pixel ``i`` gives the input pixels of the sample's crop window along one axis, as
``gpu_decode.resample_matrices`` computes them in plain torch (PyTorch's antialiased resampling:
bicubic or bilinear; nearest without antialiasing), in float64.

Why a kernel: the plain-torch form is ~30 short GPU calls per matrix, two matrices per chunk, run
by the decoding threads beside the step. Measured on an H100 (512 images of 256 px to 224, bicubic):
the whole crop-and-resize takes 1.7 ms of CPU and 4.2 ms of GPU with this kernel, 6.2 and 6.2 ms
with the plain-torch matrices. The products stay cuBLAS's float64 ones (no TF32: a process-wide
switch the step's loss turns). A first form that resampled each output pixel in the kernel itself,
gathering every tap's input pixel, took 157 ms of GPU a sub-batch and was dropped.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

MODES = {"nearest": 0, "bilinear": 1, "bicubic": 2}

_compiling = threading.Lock()
_compiled: set = set()


@triton.jit
def _tap(index, start, length, full, size, k, MODE: tl.constexpr):
    """Output pixels ``index`` (float64) of an axis of ``size`` resampled from the window ``start ..
    start + length`` of an axis of ``full`` pixels: tap ``k``'s weight, not yet normalised, and the
    input pixel it reads (clamped into the image), and whether the tap is inside the window (a tap
    past it weighs 0)."""
    scale = length / size
    if MODE == 0:  # nearest: one tap, floor(i * scale)
        within = tl.minimum(tl.floor(index * scale), length - 1.0)
        weight = tl.full(index.shape, 1.0, tl.float64)
        inside = index >= 0.0
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
        inside = within < xmax
        weight = tl.where(inside, weight, 0.0)
    column = tl.minimum(within + start, full - 1.0).to(tl.int64)
    return weight, column, inside


@triton.jit(do_not_specialize=["full", "size", "stride"])
def _matrix_kernel(matrix, boxes, stride, first, full, size, MODE: tl.constexpr, K: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program ``(n, p)``: rows ``p * BLOCK ..`` of sample ``n``'s matrix ``[size, full]`` (float64,
    zeros), the window's start and length at columns ``first`` and ``first + 2`` of ``boxes [m,
    stride]`` (int64): each tap's normalised weight stored in its column (taps past the window, which
    weigh 0, are not stored: clamped into the image, they could land on a column inside it)."""
    n = tl.program_id(0).to(tl.int64)
    start = tl.load(boxes + n * stride + first).to(tl.float64)
    length = tl.load(boxes + n * stride + first + 2).to(tl.float64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    fi = i.to(tl.float64)
    full_f, size_f = full.to(tl.float64), size.to(tl.float64)
    total = tl.zeros((BLOCK,), tl.float64)
    for k in tl.static_range(K):
        weight, _, _ = _tap(fi, start, length, full_f, size_f, k, MODE)
        total += weight
    row = matrix + n * size * full + i.to(tl.int64) * full
    for k in tl.static_range(K):
        weight, column, inside = _tap(fi, start, length, full_f, size_f, k, MODE)
        weight = tl.where(total != 0.0, weight / tl.where(total != 0.0, total, 1.0), weight)
        tl.store(row + column, weight, mask=inside & (i < size))


def taps_bucket(taps: int) -> int:
    """Taps per output pixel rounded up to a multiple of 4 (extra taps weigh 0): few compiled
    variants, however the crop sizes vary."""
    return taps if taps == 1 else -(-taps // 4) * 4


BLOCK = 64  # matrix rows per program


def resample_matrix(boxes: torch.Tensor, axis: int, full: int, size: int, interpolation: str,
                    taps: int) -> torch.Tensor:
    """``[m, size, full]`` float64 on ``boxes``' device: ``gpu_decode.resample_matrices`` for the
    crop windows along ``axis`` (0: rows, from columns top and height; 1: columns, from left and
    width) of ``boxes [m, 4+]`` (int64, on the device), ``taps`` (``gpu_decode.taps``) per pixel."""
    m = len(boxes)
    matrix = torch.zeros((m, size, full), dtype=torch.float64, device=boxes.device)
    if m == 0:
        return matrix
    boxes = boxes.contiguous()
    k = taps_bucket(taps)
    key = (boxes.device, MODES[interpolation], k)
    grid = (m, triton.cdiv(size, BLOCK))
    args = (matrix, boxes, boxes.stride(0), axis, full, size)
    if key in _compiled:
        _matrix_kernel[grid](*args, MODE=MODES[interpolation], K=k, BLOCK=BLOCK)
    else:  # the first launch of a variant compiles it: one thread at a time
        with _compiling:
            _matrix_kernel[grid](*args, MODE=MODES[interpolation], K=k, BLOCK=BLOCK)
            _compiled.add(key)
    return matrix
