"""The GPU decoding path's crop-and-resize (``data/gpu_decode.py``) as two Triton passes: each crop
resized down its rows, then along its columns, with PyTorch's antialiased resampling
(``F.interpolate(..., antialias=True, align_corners=False)``: bicubic or bilinear; nearest without
antialiasing). Each tap's weight is computed in float64 as ``kernels/resample.py: resample_matrices``
computes it, the sums are float64 (the first pass's result is kept in float64 between the passes),
and the result is clamped and rounded half to even to uint8, as the CPU path does. Only float64
arithmetic on the vector units: nothing depends on the process-wide TF32 switch (which the step's
loss turns while the decoding threads run this beside it), and the same inputs give the same bits,
which the offload replay relies on.

Why separable passes: an output pixel reads only the few taps of its filter (~6 along an axis for
256 px shrunk to 224, bicubic). The plain-torch form, kept for CPUs and as this one's reference
(``gpu_decode.cropped_groups`` with ``kernel=False``), is two dense float64 products with per-sample
``[out, full]`` resampling matrices, ~97% zeros, plus float64 copies of the images: an order of
magnitude more CPU time per sub-batch than these two passes, for the same pixels
(``scripts/benchmarks/decode.py --crops``; the figures are in docs/performance.md). Computing each
tap's weight inline costs registers (the kernel spills) and gathering all ``K x K`` taps of an
output pixel in one pass reads each input pixel many times, so the taps' weights and input pixels
are tables (``_taps_kernel``, once per image size), and a program covers few rows.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

MODES = {"nearest": 0, "bilinear": 1, "bicubic": 2}
# output rows, and columns (input columns in the first pass), per program; warps: the fastest of
# the shapes tried (scripts/benchmarks/decode.py --crops)
BLOCK_I, BLOCK_J, WARPS = 2, 256, 2
TAPS_BLOCK = 64  # output pixels per program of the taps' weights

_compiling = threading.Lock()
_compiled: set = set()


@triton.jit
def _tap(index, start, length, full, size, k, MODE: tl.constexpr):
    """Output pixels ``index`` (float64) of an axis of ``size`` resampled from the window ``start ..
    start + length`` of an axis of ``full`` pixels: tap ``k``'s weight, not yet normalised (0 for a
    tap past the window), and the input pixel it reads (clamped into the image)."""
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
        if MODE == 2:  # Keys' cubic, a = -0.5, the operations in resample_matrices' order
            weight = tl.where(x < 1.0, ((1.5 * x - 2.5) * x) * x + 1.0,
                              tl.where(x < 2.0, ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0, 0.0))
        else:
            weight = tl.maximum(1.0 - x, 0.0)
        weight = tl.where(within < xmax, weight, 0.0)
    column = tl.minimum(within + start, full - 1.0).to(tl.int64)
    return weight, column


@triton.jit(do_not_specialize=["stride", "first", "full", "size", "K"])
def _taps_kernel(boxes, stride, first, full, size, weights, columns, K, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(n, p)``: output pixels ``p * BLOCK ..`` of sample ``n`` along one axis of ``size``
    pixels, from the window whose start and length are at columns ``first`` and ``first + 2`` of
    ``boxes [m, stride]`` (int64) in an axis of ``full`` pixels: each of the ``K`` taps' normalised
    weight into ``weights [m, size, K]`` (float64; 0 past the window) and its input pixel into
    ``columns [m, size, K]`` (int32)."""
    n = tl.program_id(0).to(tl.int64)
    start = tl.load(boxes + n * stride + first).to(tl.float64)
    length = tl.load(boxes + n * stride + first + 2).to(tl.float64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    fi, full_f, size_f = i.to(tl.float64), full.to(tl.float64), size.to(tl.float64)
    total = tl.zeros((BLOCK,), tl.float64)
    for k in range(K):
        weight, _ = _tap(fi, start, length, full_f, size_f, k, MODE)
        total += weight
    total = tl.where(total != 0.0, total, 1.0)  # (all taps 0: left as they are)
    at = (n * size + i) * K
    for k in range(K):
        weight, column = _tap(fi, start, length, full_f, size_f, k, MODE)
        tl.store(weights + at + k, weight / total, mask=i < size)
        tl.store(columns + at + k, column.to(tl.int32), mask=i < size)


@triton.jit(do_not_specialize=["height", "width", "out_h", "K"])  # (a 1x1 black image is one)
def _rows_kernel(src, tmp, weights, columns, height, width, out_h, K,
                 BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program ``(n, pi, pj)``: rows ``pi * BLOCK_I ..`` of sample ``n``'s crop resized to ``out_h``
    rows, input columns ``pj * BLOCK_J ..``, the three channels: ``src [m, 3, height, width]``
    uint8 into ``tmp [m, 3, out_h, width]`` float64, with the taps (``_taps_kernel``'s) of ``weights``
    and ``columns [m, out_h, K]``."""
    n = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    x = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    rows, within = i < out_h, x[None, :] < width
    plane = height.to(tl.int64) * width
    base = src + n * 3 * plane + x[None, :]
    taps = (n * out_h + i) * K
    red = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    green = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    blue = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    for k in range(K):
        weight = tl.load(weights + taps + k, mask=rows, other=0.0)[:, None]
        at = base + tl.load(columns + taps + k, mask=rows, other=0).to(tl.int64)[:, None] * width
        red += weight * tl.load(at, mask=within, other=0).to(tl.float64)
        green += weight * tl.load(at + plane, mask=within, other=0).to(tl.float64)
        blue += weight * tl.load(at + 2 * plane, mask=within, other=0).to(tl.float64)
    out_plane = out_h.to(tl.int64) * width
    target = tmp + n * 3 * out_plane + i[:, None].to(tl.int64) * width + x[None, :]
    inside = rows[:, None] & within
    tl.store(target, red, mask=inside)
    tl.store(target + out_plane, green, mask=inside)
    tl.store(target + 2 * out_plane, blue, mask=inside)


@triton.jit(do_not_specialize=["width", "out_h", "out_w", "K"])
def _columns_kernel(tmp, out, weights, columns, width, out_h, out_w, K,
                    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Program ``(n, pi, pj)``: the output tile ``pi, pj`` of sample ``n``, the three channels:
    ``tmp [m, 3, out_h, width]`` (``_rows_kernel``'s) resized along its columns into ``out [m, 3,
    out_h, out_w]`` uint8, clamped and rounded half to even, with the taps of ``weights`` and
    ``columns [m, out_w, K]``."""
    n = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
    rows, outputs = i[:, None] < out_h, j < out_w
    plane = out_h.to(tl.int64) * width
    base = tmp + n * 3 * plane + i[:, None].to(tl.int64) * width
    taps = (n * out_w + j) * K
    red = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    green = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    blue = tl.zeros((BLOCK_I, BLOCK_J), tl.float64)
    for k in range(K):
        weight = tl.load(weights + taps + k, mask=outputs, other=0.0)[None, :]
        at = base + tl.load(columns + taps + k, mask=outputs, other=0)[None, :]
        red += weight * tl.load(at, mask=rows, other=0.0)
        green += weight * tl.load(at + plane, mask=rows, other=0.0)
        blue += weight * tl.load(at + 2 * plane, mask=rows, other=0.0)
    out_plane = out_h.to(tl.int64) * out_w
    target = out + n * 3 * out_plane + i[:, None].to(tl.int64) * out_w + j[None, :]
    inside = rows & outputs[None, :]
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


def _launch(kernel, grid: tuple, args: tuple, key: tuple, **constants) -> None:
    """``kernel[grid](*args, **constants)``; the first launch of a variant compiles it, one thread
    at a time (the decoding threads call this side by side)."""
    if key in _compiled:
        kernel[grid](*args, **constants)
        return
    with _compiling:
        kernel[grid](*args, **constants)
        _compiled.add(key)


def resize_crops(pixels: torch.Tensor, boxes: torch.Tensor, out: torch.Tensor, interpolation: str,
                 taps_h: int, taps_w: int, chunk: int | None = None) -> None:
    """Writes ``out [m, 3, s_h, s_w]`` (uint8): the images ``pixels [m, 3, h, w]`` (uint8), each cut
    to its row of ``boxes [m, 4+]`` (int64: top, left, height, width; all on the device) and
    resized, with ``taps_h`` and ``taps_w`` (``gpu_decode.taps``) input pixels per output pixel
    along the rows and the columns; ``chunk`` images at a time (all: ``None``), each holding ``3 *
    s_h * w`` float64 between the passes."""
    m, _, height, width = pixels.shape
    if m == 0:
        return
    out_h, out_w = out.shape[2:]
    pixels, boxes, device = pixels.contiguous(), boxes.contiguous(), pixels.device
    assert out.is_contiguous() and out.dtype == torch.uint8 and len(out) == len(boxes) == m
    mode = MODES[interpolation]
    tables = []  # each axis' taps, for all the images at once
    for axis, full, size, taps in ((0, height, out_h, taps_h), (1, width, out_w, taps_w)):
        weights = torch.empty((m, size, taps), dtype=torch.float64, device=device)
        columns = torch.empty((m, size, taps), dtype=torch.int32, device=device)
        _launch(_taps_kernel, (m, triton.cdiv(size, TAPS_BLOCK)),
                (boxes, boxes.stride(0), axis, full, size, weights, columns, taps), ("taps", device, mode),
                MODE=mode, BLOCK=TAPS_BLOCK)
        tables.append((weights, columns))
    (along_h, rows_from), (along_w, columns_from) = tables
    chunk = m if chunk is None else max(1, chunk)
    tmp = torch.empty((min(chunk, m), 3, out_h, width), dtype=torch.float64, device=device)
    blocks = {"BLOCK_I": BLOCK_I, "BLOCK_J": BLOCK_J, "num_warps": WARPS}
    for start in range(0, m, chunk):
        part = slice(start, min(start + chunk, m))
        count = part.stop - start
        _launch(_rows_kernel, (count, triton.cdiv(out_h, BLOCK_I), triton.cdiv(width, BLOCK_J)),
                (pixels[part], tmp, along_h[part], rows_from[part], height, width, out_h, taps_h), ("rows", device),
                **blocks)
        _launch(_columns_kernel, (count, triton.cdiv(out_h, BLOCK_I), triton.cdiv(out_w, BLOCK_J)),
                (tmp, out[part], along_w[part], columns_from[part], width, out_h, out_w, taps_w), ("columns", device),
                **blocks)
