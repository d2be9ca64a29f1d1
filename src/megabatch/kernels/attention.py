"""Attention for the towers' short sequences, in Triton, on the packed in-projection.

A tower's attention block projects ``x [b, s, e]`` once into ``qkv [b, s, 3e]``, viewed here as
``[b, s, 3, h, d]``. The kernels read q, k and v straight from that tensor (no head-major copies),
write the output as ``[b, s, h, d]`` (which is ``[b, s, e]``, the out-projection's input, without a
transpose), and write the gradient into one packed ``[b, s, 3, h, d]`` tensor, the in-projection
output's gradient.

Forward, ``_forward_kernel``: one program per block of query rows of one (batch, head). It walks the
key blocks (up to the diagonal with ``causal``) keeping the row maximum and sum online in fp32, and
writes the output and each row's log-sum-exp (base 2, fp32) for the backward.

Backward, as FlashAttention-2: ``delta = rowsum(dO * O)``; ``_dkdv_kernel``, one program per key
block, walks the query blocks and accumulates dK and dV; ``_dq_kernel``, one program per query
block, walks the key blocks and accumulates dQ. Each recomputes the probabilities from the saved
log-sum-exp; no atomics, so the gradients are deterministic.

Exact softmax (fp32 statistics and accumulators), bf16/fp16/fp32 inputs, any length (masked edges,
tiles of 64/128 rows: S=257 is padded to 320 or 384, not 512), head dims up to 128 (80 is padded
to 128 in registers), the text tower's causal mask. ``packed_attention`` is a registered custom op
(``torch.library``) with its backward, so ``torch.compile`` keeps whole graphs around it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_tiles import interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _tile(ptr, rows, stride_s, dims, length, head_dim, UPCAST: tl.constexpr):
    """The ``[rows, dims]`` tile of one head at ``ptr`` (its q, k, v or output gradient), zero past
    the sequence and the head dim; fp32 with ``UPCAST`` (the interpreter's numpy dot mishandles bf16)."""
    tile = tl.load(ptr + rows[:, None] * stride_s + dims[None, :],
                   mask=(rows[:, None] < length) & (dims[None, :] < head_dim), other=0.0)
    return tile.to(tl.float32) if UPCAST else tile


@triton.jit
def _valid(LENGTHS, batch, length, HAS_LENGTHS: tl.constexpr):
    """How many of the sample's leading tokens are valid: its entry of ``LENGTHS`` (``lengths=``), else all."""
    if HAS_LENGTHS:
        return tl.load(LENGTHS + batch)
    return length


@triton.jit
def _key_blocks(block_m, length, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key range a block of query rows walks, split where masking starts: ``[0, full)`` needs no
    mask, ``[full, end)`` does. Causal: the blocks wholly before the block's first row, then the
    diagonal's; otherwise the whole blocks, then the one the sequence ends in."""
    if CAUSAL:
        full = (block_m * BLOCK_M // BLOCK_N) * BLOCK_N
        end = tl.minimum(length, (block_m + 1) * BLOCK_M)
    else:
        full = (length // BLOCK_N) * BLOCK_N
        end = length
    return full, end


@triton.jit
def _forward_block(acc, l_i, m_i, q, base, rows, start, stride_s, stride_3, dims, length, head_dim, scale_log2,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """One key block's step of the online softmax: the rows' running maximum ``m_i`` and sum ``l_i``
    (base 2) and the output accumulator. ``MASKED``: the block has keys past the sequence, or (with
    ``CAUSAL``) keys after some of the rows; without it no score is compared."""
    cols = start + tl.arange(0, BLOCK_N)
    k = _tile(base + stride_3, cols, stride_s, dims, length, head_dim, UPCAST)
    v = _tile(base + 2 * stride_3, cols, stride_s, dims, length, head_dim, UPCAST)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:  # every row, also past the sequence (not stored), sees key 0: its maximum stays finite
        valid = cols[None, :] < length
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
    p = tl.exp2(qk * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _forward_kernel(QKV, OUT, LSE, LENGTHS, stride_b, stride_s, stride_3, stride_h, out_b, out_s, out_h,
                    heads, length, head_dim, scale_log2,
                    CAUSAL: tl.constexpr, HAS_LENGTHS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    block_m, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // heads, bh % heads
    valid = _valid(LENGTHS, batch, length, HAS_LENGTHS)
    base = QKV + batch.to(tl.int64) * stride_b + head * stride_h
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(base, rows, stride_s, dims, valid, head_dim, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = _key_blocks(block_m, valid, CAUSAL, BLOCK_M, BLOCK_N)
    end = tl.where(block_m * BLOCK_M < valid, end, 0)  # a block of padding rows only: no key read, rows zero
    full = tl.minimum(full, end)
    for start in range(0, full, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, base, rows, start, stride_s, stride_3, dims, valid,
                                       head_dim, scale_log2, False, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    for start in range(full, end, BLOCK_N):
        acc, l_i, m_i = _forward_block(acc, l_i, m_i, q, base, rows, start, stride_s, stride_3, dims, valid,
                                       head_dim, scale_log2, True, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    row_valid = rows < valid  # padding rows (lengths=) are zero, their log-sum-exp 0
    l_i = tl.where(row_valid, l_i, 1.0)  # padding rows saw no key (their sum 0)
    acc = tl.where(row_valid[:, None], acc / l_i[:, None], 0.0)
    row_ok = rows < length
    out = OUT + batch.to(tl.int64) * out_b + head * out_h + rows[:, None] * out_s + dims[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (dims[None, :] < head_dim))
    tl.store(LSE + bh.to(tl.int64) * length + rows, tl.where(row_valid, m_i + tl.log2(l_i), 0.0), mask=row_ok)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, out_b, out_s, out_h, heads, length, head_dim,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    block_m, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // heads, bh % heads
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    offset = batch.to(tl.int64) * out_b + head * out_h
    o = _tile(OUT + offset, rows, out_s, dims, length, head_dim, False).to(tl.float32)
    do = _tile(DO + offset, rows, out_s, dims, length, head_dim, False).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * length + rows, tl.sum(o * do, 1), mask=rows < length)


@triton.jit
def _probabilities(q, k, lse, rows, cols, length, scale_log2, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr):
    """The softmax probabilities of a (query block, key block) tile, recomputed from the rows' saved
    log-sum-exps (base 2). With ``MASKED`` (the block the sequence ends in, a causal diagonal block)
    zero for keys past the sequence and, with ``CAUSAL``, keys after their query.

    Rows past the sequence need no mask: their q and dO are zero and their log-sum-exp is read as
    0, so their probabilities are 1 and multiply zeros. Nor do keys past the sequence in dK/dV,
    whose rows are never stored; dQ masks them (``exp2(-lse)`` may overflow where k is zero)."""
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2 - lse[:, None])
    if MASKED:
        valid = cols[None, :] < length
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        p = tl.where(valid, p, 0.0)
    return p


@triton.jit
def _dkdv_block(dk, dv, k, v, base, dout, stats, start, cols, stride_s, out_s, dims, length, head_dim,
                scale_log2, LSE, DELTA, MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = start + tl.arange(0, BLOCK_M)
    q = _tile(base, rows, stride_s, dims, length, head_dim, UPCAST)
    do = _tile(dout, rows, out_s, dims, length, head_dim, UPCAST)
    lse = tl.load(LSE + stats + rows, mask=rows < length, other=0.0)
    delta = tl.load(DELTA + stats + rows, mask=rows < length, other=0.0)
    p = _probabilities(q, k, lse, rows, cols, length, scale_log2, MASKED, CAUSAL, PRECISION)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(QKV, DO, LSE, DELTA, DQKV, LENGTHS, stride_b, stride_s, stride_3, stride_h, out_b, out_s, out_h,
                 heads, length, head_dim, scale, scale_log2,
                 CAUSAL: tl.constexpr, HAS_LENGTHS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    block_n, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // heads, bh % heads
    valid = _valid(LENGTHS, batch, length, HAS_LENGTHS)
    base = QKV + batch.to(tl.int64) * stride_b + head * stride_h
    dout = DO + batch.to(tl.int64) * out_b + head * out_h
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _tile(base + stride_3, cols, stride_s, dims, valid, head_dim, UPCAST)
    v = _tile(base + 2 * stride_3, cols, stride_s, dims, valid, head_dim, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    stats = bh.to(tl.int64) * length
    if CAUSAL:  # rows above the key block see none of it; the diagonal's query blocks are masked
        first = (block_n * BLOCK_N // BLOCK_M) * BLOCK_M
        diagonal = tl.minimum(first + tl.cdiv(block_n * BLOCK_N + BLOCK_N - 1 - first, BLOCK_M) * BLOCK_M, valid)
        for start in range(first, diagonal, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, base, dout, stats, start, cols, stride_s, out_s, dims, valid,
                                 head_dim, scale_log2, LSE, DELTA, True, CAUSAL, UPCAST, PRECISION, BLOCK_M)
    else:
        diagonal = 0
    rows_end = tl.where(block_n * BLOCK_N < valid, valid, 0)  # a block of padding keys only: zero, nothing read
    for start in range(diagonal, rows_end, BLOCK_M):  # keys past the sequence are zeroed below: no mask
        dk, dv = _dkdv_block(dk, dv, k, v, base, dout, stats, start, cols, stride_s, out_s, dims, valid,
                             head_dim, scale_log2, LSE, DELTA, False, CAUSAL, UPCAST, PRECISION, BLOCK_M)
    if HAS_LENGTHS:  # padding keys (stored, unlike those past the sequence) have no gradient
        dk = tl.where(cols[:, None] < valid, dk, 0.0)
        dv = tl.where(cols[:, None] < valid, dv, 0.0)
    grad = DQKV + batch.to(tl.int64) * stride_b + head * stride_h + cols[:, None] * stride_s + dims[None, :]
    mask = (cols[:, None] < length) & (dims[None, :] < head_dim)
    tl.store(grad + stride_3, (dk * scale).to(DQKV.dtype.element_ty), mask=mask)
    tl.store(grad + 2 * stride_3, dv.to(DQKV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_block(dq, q, do, lse, delta, base, rows, start, stride_s, stride_3, dims, length, head_dim, scale_log2,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr):
    cols = start + tl.arange(0, BLOCK_N)
    k = _tile(base + stride_3, cols, stride_s, dims, length, head_dim, UPCAST)
    v = _tile(base + 2 * stride_3, cols, stride_s, dims, length, head_dim, UPCAST)
    p = _probabilities(q, k, lse, rows, cols, length, scale_log2, MASKED, CAUSAL, PRECISION)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@triton.jit
def _dq_kernel(QKV, DO, LSE, DELTA, DQKV, LENGTHS, stride_b, stride_s, stride_3, stride_h, out_b, out_s, out_h,
               heads, length, head_dim, scale, scale_log2,
               CAUSAL: tl.constexpr, HAS_LENGTHS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    block_m, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // heads, bh % heads
    valid = _valid(LENGTHS, batch, length, HAS_LENGTHS)
    base = QKV + batch.to(tl.int64) * stride_b + head * stride_h
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(base, rows, stride_s, dims, valid, head_dim, UPCAST)  # padding rows: zero q and dO, so zero dq
    do = _tile(DO + batch.to(tl.int64) * out_b + head * out_h, rows, out_s, dims, valid, head_dim, UPCAST)
    stats = bh.to(tl.int64) * length
    lse = tl.load(LSE + stats + rows, mask=rows < valid, other=0.0)
    delta = tl.load(DELTA + stats + rows, mask=rows < valid, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = _key_blocks(block_m, valid, CAUSAL, BLOCK_M, BLOCK_N)
    end = tl.where(block_m * BLOCK_M < valid, end, 0)  # a block of padding rows only
    full = tl.minimum(full, end)
    for start in range(0, full, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, base, rows, start, stride_s, stride_3, dims, valid, head_dim,
                       scale_log2, False, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    for start in range(full, end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, base, rows, start, stride_s, stride_3, dims, valid, head_dim,
                       scale_log2, True, CAUSAL, UPCAST, PRECISION, BLOCK_N)
    tl.store(DQKV + batch.to(tl.int64) * stride_b + head * stride_h + rows[:, None] * stride_s + dims[None, :],
             (dq * scale).to(DQKV.dtype.element_ty), mask=(rows[:, None] < length) & (dims[None, :] < head_dim))


# Tiles per kernel: (query rows, key rows, warps, pipeline stages), by head dim (<= 64, <= 128);
# ``scripts/benchmarks/attention.py --tune`` measures the alternatives
TILES = {
    "forward": {64: (64, 32, 4, 3), 128: (128, 32, 4, 2)},
    "dkdv": {64: (64, 64, 4, 3), 128: (64, 64, 4, 2)},  # each program owns a block of key rows
    "dq": {64: (64, 32, 4, 4), 128: (128, 64, 8, 2)},  # each program owns a block of query rows
}
INTERPRETED_TILES = (32, 32, 1, 1)  # the interpreter: small tiles keep numpy's work close to the sequence


# model.attention=auto, from scripts/benchmarks/attention.py and towers.py on an H100 (bf16; in docs/bench:
# attention_tune_h100.json, attention_h100.json, towers_attention_sdpa_vit_b16_h100.json and
# towers_attention_auto_vit_b16_h100.json). At head dim 64 the backward took 0.50-0.67x the time of SDPA
# compiled by inductor on the packed projection's views (S=197, 257, 577) and the forward 0.85-1.2x; at
# head dim 80 (S=257) 0.76x and 1.35x. Each call costs the host ~0.2-0.4 ms more per forward + backward
# (three more launches through Python). In a compiled ViT-B/16 replay the image tower (S=197) took
# 136.0 against 139.1 ms, the text tower (S=32, causal, host-bound) 33.5 against 29.0 ms. So: the
# kernels where a backward follows, at head dims up to 64 (80 gained least and has no tower measured)
# and lengths from 128; SDPA for forwards without autograd (GradCache's graph-free pass, evaluation),
# short text, head dims above 64 (ViT-bigG-14's 104: SDPA was faster both ways), and on devices
# without a measurement. End to end at batch 4k (end_to_end.py; vit_b16_4k_auto_h100.json,
# vit_l14_4k_auto_h100.json) that made steps 2.7-3.0% (ViT-B/16) and 3.7% (ViT-L/14) faster than SDPA:
# model.attention=auto is the default.
AUTO_MAX_HEAD_DIM = 64
AUTO_MIN_LENGTH = 128
AUTO_DEVICES = ("cuda",)  # on the CPU the kernels only run interpreted (tests), far slower than SDPA


def faster_than_sdpa(qkv: torch.Tensor) -> bool:
    """``model.attention=auto``: whether these kernels beat SDPA for this call of ``qkv [b, s, 3, h, d]``
    (see ``AUTO_MAX_HEAD_DIM``): on a CUDA GPU, with autograd recording (a backward follows), at head
    dims up to 64 and lengths from 128."""
    return (qkv.device.type in AUTO_DEVICES and qkv.shape[-1] <= AUTO_MAX_HEAD_DIM
            and qkv.shape[1] >= AUTO_MIN_LENGTH and qkv.requires_grad)  # recorded: a graph, so a backward


def _check(qkv: torch.Tensor) -> tuple[int, int, int, int]:
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"packed_attention takes qkv [batch, length, 3, heads, head_dim], got {tuple(qkv.shape)}")
    if qkv.stride(-1) != 1:
        raise ValueError("packed_attention needs the head dimension contiguous (a view of the in-projection)")
    if not (qkv.is_cuda or interpreting()):
        raise RuntimeError("model.attention=triton needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    batch, length, _, heads, head_dim = qkv.shape
    if head_dim > 128:
        raise ValueError(f"packed_attention supports head dims up to 128, got {head_dim}")
    return batch, length, heads, head_dim


def _tiles(kernel: str, head_dim: int) -> tuple[int, int, int, int]:
    """(query rows, key rows, warps, stages) of ``kernel`` at ``head_dim``."""
    return INTERPRETED_TILES if interpreting() else TILES[kernel][64 if head_dim <= 64 else 128]


def _upcast(qkv: torch.Tensor) -> bool:
    return interpreting() and qkv.dtype == torch.bfloat16


def _precision(qkv: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 dots (as SDPA's), not the tensor cores' TF32 (~1e-3 relative)."""
    return "ieee" if qkv.dtype == torch.float32 else "tf32"


def _lengths(lengths: torch.Tensor | None, qkv: torch.Tensor) -> torch.Tensor:
    """``lengths`` as the kernels read it (int32 on ``qkv``'s device), or a placeholder they never read."""
    if lengths is None:
        return qkv  # HAS_LENGTHS=False: the pointer is not dereferenced
    if lengths.dim() != 1 or lengths.shape[0] != qkv.shape[0] or lengths.dtype.is_floating_point:
        raise ValueError(f"packed_attention's lengths are one integer per sample ({qkv.shape[0]}), got "
                         f"{tuple(lengths.shape)} {lengths.dtype}")
    return lengths.to(device=qkv.device, dtype=torch.int32)


@torch.library.custom_op("megabatch::packed_attention", mutates_args=())
def packed_attention_op(qkv: torch.Tensor, causal: bool,
                        lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T / sqrt(d)) v`` per (batch, head) of ``qkv [b, s, 3, h, d]``: the output
    ``[b, s, h, d]`` and each row's log-sum-exp ``[b, h, s]`` (base 2, fp32) for the backward. ``lengths [b]``:
    each sample's first ``lengths[i]`` tokens are its own, the rest padding: no query sees a padding key, and
    padding rows are zero (their log-sum-exp 0)."""
    batch, length, heads, head_dim = _check(qkv)
    qkv = qkv.contiguous()  # the in-projection's view already is
    out = qkv.new_empty(batch, length, heads, head_dim)
    lse = torch.empty(batch, heads, length, device=qkv.device, dtype=torch.float32)
    block_m, block_n, warps, stages = _tiles("forward", head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    _forward_kernel[(triton.cdiv(length, block_m), batch * heads)](
        qkv, out, lse, _lengths(lengths, qkv), qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3),
        out.stride(0), out.stride(1), out.stride(2), heads, length, head_dim, scale * LOG2E,
        CAUSAL=causal, HAS_LENGTHS=lengths is not None, UPCAST=_upcast(qkv), PRECISION=_precision(qkv),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=warps,
        num_stages=stages)
    return out, lse


@packed_attention_op.register_fake
def _(qkv: torch.Tensor, causal: bool, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, _, heads, head_dim = qkv.shape
    return qkv.new_empty(batch, length, heads, head_dim), \
        qkv.new_empty(batch, heads, length, dtype=torch.float32)


@torch.library.custom_op("megabatch::packed_attention_backward", mutates_args=())
def packed_attention_backward(grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              causal: bool, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of ``packed_attention``'s output ``grad_out [b, s, h, d]`` with respect to
    ``qkv``, packed as ``qkv`` (``[b, s, 3, h, d]``); zero at padding tokens (``lengths``)."""
    batch, length, heads, head_dim = _check(qkv)
    qkv, grad_out, out = qkv.contiguous(), grad_out.contiguous(), out.contiguous()
    grad = torch.empty_like(qkv)  # laid out as qkv: the kernels index both with qkv's strides
    delta = torch.empty_like(lse)
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows = 64 if not interpreting() else 32
    _delta_kernel[(triton.cdiv(length, rows), batch * heads)](
        out, grad_out, delta, out.stride(0), out.stride(1), out.stride(2), heads, length, head_dim,
        BLOCK_M=rows, BLOCK_D=block_d)
    scale = 1.0 / math.sqrt(head_dim)
    common = (qkv, grad_out, lse, delta, grad, _lengths(lengths, qkv), qkv.stride(0), qkv.stride(1), qkv.stride(2),
              qkv.stride(3), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), heads, length, head_dim,
              scale, scale * LOG2E)
    flags = dict(CAUSAL=causal, HAS_LENGTHS=lengths is not None, UPCAST=_upcast(qkv), PRECISION=_precision(qkv))
    block_m, block_n, warps, stages = _tiles("dkdv", head_dim)
    _dkdv_kernel[(triton.cdiv(length, block_n), batch * heads)](
        *common, **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    block_m, block_n, warps, stages = _tiles("dq", head_dim)
    _dq_kernel[(triton.cdiv(length, block_m), batch * heads)](
        *common, **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    return grad


@packed_attention_backward.register_fake
def _(grad_out: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      causal: bool, lengths: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    qkv, causal, lengths = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, lengths)
    ctx.causal = causal


def _backward(ctx, grad_out, grad_lse):
    qkv, out, lse, lengths = ctx.saved_tensors
    return packed_attention_backward(grad_out, qkv, out, lse, ctx.causal, lengths), None, None


packed_attention_op.register_autograd(_backward, setup_context=_setup_context)


def packed_attention(qkv: torch.Tensor, causal: bool = False, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``qkv [b, s, 3, h, d]`` (the in-projection's output, viewed) -> ``[b, s, h, d]``;
    ``causal``: each query sees the keys up to its own position; ``lengths [b]``: each sample's tokens past
    ``lengths[i]`` are padding, seen by no query, their rows zero (a NaFlex tower's padded sequences: the
    padding's blocks are skipped, not computed). Differentiable (``qkv``'s gradient comes packed)."""
    return packed_attention_op(qkv, causal, lengths)[0]
