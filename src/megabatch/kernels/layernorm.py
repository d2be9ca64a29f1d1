"""A transformer block's residual add and the LayerNorm after it, ``s = x + y``, ``out = LN(s)``, in
one pass each way.

Forward, ``_forward_kernel``: a block of rows per program reads ``x`` and ``y``, writes the residual
``s`` (rounded to the input dtype, as the unfused add) and ``LN(s) * weight + bias`` computed in fp32
from that rounded ``s`` (open_clip's ``LayerNorm`` under autocast: fp32 statistics, the output cast
back to the input's dtype), and each row's mean and reciprocal standard deviation for the backward.

Backward, ``_backward_kernel``: a fixed number of programs (a few per SM) each walk blocks of rows,
write the input gradient ``ds + LN'(s)^T dout`` (the residual's gradient and the norm's, which ``x``
and ``y`` share) and accumulate the weight's and bias's gradients over their rows in fp32 registers,
written once per program as partial sums that one small sum reduces: ``dweight`` and ``dbias`` come
out of the same pass that reads ``s`` and ``dout`` for ``ds``, with no atomics (deterministic).

Each pass moves the least a separate kernel pair could: forward reads two tensors and writes two,
backward reads three and writes one. ``add_layer_norm`` is a registered custom op (``torch.library``)
with its backward, so ``torch.compile`` keeps whole graphs around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tiles import interpreting


@triton.jit
def _forward_kernel(X, Y, S, OUT, W, B, MEAN, RSTD, rows, cols, eps,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    row_ok, col_ok = r < rows, c < cols
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = r[:, None].to(tl.int64) * cols + c[None, :]
    s = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32) \
        + tl.load(Y + offsets, mask=mask, other=0.0).to(tl.float32)
    s = s.to(S.dtype.element_ty)  # the residual as the unfused add rounds it; the norm reads it so
    tl.store(S + offsets, s, mask=mask)
    s = s.to(tl.float32)
    mean = tl.sum(s, 1) / cols
    centred = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 1) / cols + eps)
    w = tl.load(W + c, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + c, mask=col_ok, other=0.0).to(tl.float32)
    out = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(MEAN + r, mean, mask=row_ok)
    tl.store(RSTD + r, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(S, DOUT, DS, W, MEAN, RSTD, DX, DW, DB, rows, cols,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    c = tl.arange(0, BLOCK_C)
    col_ok = c < cols
    w = tl.load(W + c, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], tl.float32)
    db = tl.zeros([BLOCK_C], tl.float32)
    for first in range(program * BLOCK_R, rows, programs * BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        row_ok = r < rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = r[:, None].to(tl.int64) * cols + c[None, :]
        mean = tl.load(MEAN + r, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + r, mask=row_ok, other=0.0)
        s = tl.load(S + offsets, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + offsets, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        wdout = dout * w[None, :]
        c1 = tl.sum(xhat * wdout, 1) / cols
        c2 = tl.sum(wdout, 1) / cols
        dx = (wdout - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        dx += tl.load(DS + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dout * xhat, 0)
        db += tl.sum(dout, 0)
    tl.store(DW + program * cols + c, dw, mask=col_ok)
    tl.store(DB + program * cols + c, db, mask=col_ok)


# (elements per block of rows, warps) per kernel, and the backward's programs per SM: the fastest at the
# towers' widths on an H100 (``scripts/benchmarks/layernorm.py --tune``)
TILES = {"forward": (8192, 8), "backward": (2048, 4)}
BACKWARD_PROGRAMS_PER_SM = 8


def _tiles(cols: int, kernel: str) -> tuple[int, int, int]:
    """(rows per block, column block, warps) of ``kernel``; the interpreter, 2 rows and 1 warp."""
    block_c = triton.next_power_of_2(cols)
    if interpreting():
        return 2, block_c, 1
    elements, warps = TILES[kernel]
    return max(1, elements // block_c), block_c, warps


def backward_programs(rows: int, device: torch.device) -> int:
    """How many programs the backward runs (each writes one partial sum of ``dweight`` and ``dbias``):
    ``BACKWARD_PROGRAMS_PER_SM`` per SM, no more than there are rows; four in the interpreter."""
    if interpreting() or device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(BACKWARD_PROGRAMS_PER_SM * sms, rows))


def _check(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if x.shape != y.shape or x.dtype != y.dtype or weight.shape != (x.shape[-1],) or bias.shape != weight.shape:
        raise ValueError(f"add_layer_norm takes x and y of one shape and dtype and weight, bias [{x.shape[-1]}]; "
                         f"got {tuple(x.shape)} {x.dtype}, {tuple(y.shape)} {y.dtype}, {tuple(weight.shape)}, "
                         f"{tuple(bias.shape)}")
    if not (x.is_cuda or interpreting()):
        raise RuntimeError("model.fused_layernorm=true needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")


@torch.library.custom_op("megabatch::add_layer_norm", mutates_args=())
def add_layer_norm_op(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, out, mean, rstd)``: ``s = x + y`` and ``out = LN(s) * weight + bias`` in ``x``'s dtype, the
    rows' fp32 mean and reciprocal standard deviation (over the last dim)."""
    _check(x, y, weight, bias)
    cols = x.shape[-1]
    x, y = x.contiguous(), y.contiguous()
    rows = x.numel() // cols
    s, out = torch.empty_like(x), torch.empty_like(x)
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block_r, block_c, warps = _tiles(cols, "forward")
    _forward_kernel[(triton.cdiv(rows, block_r),)](x, y, s, out, weight, bias, mean, rstd, rows, cols, eps,
                                                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return s, out, mean, rstd


@add_layer_norm_op.register_fake
def _(x, y, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(rows, dtype=torch.float32), \
        x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("megabatch::add_layer_norm_backward", mutates_args=())
def add_layer_norm_backward(dout: torch.Tensor, ds: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                            mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` for the gradients ``dout`` of ``out`` and ``ds`` of ``s``; ``dx`` is
    also ``y``'s gradient."""
    cols = s.shape[-1]
    rows = s.numel() // cols
    dout, ds = dout.contiguous(), ds.contiguous()
    dx = torch.empty_like(s)
    programs = backward_programs(rows, s.device)
    dw = torch.empty(programs, cols, device=s.device, dtype=torch.float32)
    db = torch.empty_like(dw)
    block_r, block_c, warps = _tiles(cols, "backward")
    _backward_kernel[(programs,)](s, dout, ds, weight, mean, rstd, dx, dw, db, rows, cols,
                                  BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype)


@add_layer_norm_backward.register_fake
def _(dout, ds, s, weight, mean, rstd):
    return torch.empty_like(s), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    _, _, weight, _, _ = inputs
    s, _, mean, rstd = output
    ctx.save_for_backward(s, weight, mean, rstd)


def _backward(ctx, ds, dout, dmean, drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    if ds is None:
        ds = torch.zeros_like(s)
    if dout is None:
        dout = torch.zeros_like(s)
    dx, dw, db = add_layer_norm_backward(dout, ds, s, weight, mean, rstd)
    return dx, dx, dw, db, None


add_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def add_layer_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, out)``: the residual ``s = x + y`` and ``LayerNorm(s)`` with ``weight`` and ``bias`` (fp32
    statistics, ``out`` in ``x``'s dtype) over the last dim, differentiable in all four inputs."""
    s, out, _, _ = add_layer_norm_op(x, y, weight, bias, eps)
    return s, out
