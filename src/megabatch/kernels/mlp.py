"""A transformer block's MLP, ``c_proj(gelu(c_fc(x)))``, with the exact (erf) GELU inside the GEMMs.

Forward, one GEMM with the ``GELU`` epilogue: ``z = x W1^T + b1`` accumulated in fp32, rounded to
the input dtype (as ``c_fc``'s output is), and ``h = gelu(z)`` written beside it in the same pass;
no separate GELU kernel reads ``z`` back. ``c_proj`` is cuBLAS (``F.linear``).

Backward, the same kernel with the ``GELU_GRAD`` epilogue: the hidden gradient ``dh = dy W2`` is
multiplied by ``gelu'(z)`` before it is stored, so ``dz`` leaves the GEMM and ``dh`` is never
written. The weight and input gradients (``dz^T x``, ``dz W1``, ``dy^T h``) and the bias sums are
cuBLAS and torch. Saved for the backward: ``x``, ``z`` and ``h``, what the unfused module saves; a
forward without autograd writes no ``z``.

Measured on an H100 (``scripts/benchmarks/mlp.py --tune``, docs/performance.md): slower than cuBLAS
plus inductor's GELU kernels. The GEMM with the epilogues reaches about 300 TFLOP/s against cuBLAS's
700 for the GEMM alone, and a persistent TMA version tried beside it was no faster; so
``model.fused_mlp`` stays off by default.

``fused_mlp`` is a registered custom op (``torch.library``) with its backward, so ``torch.compile``
keeps whole graphs around it. Inputs bf16, fp16 or fp32 (fp32: exact fp32 dots), fp32 accumulation,
any sizes (masked edges).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_tiles import interpreting

GELU, GELU_GRAD = 0, 1  # the GEMM's epilogues


@triton.jit
def _gelu(z):
    """Exact GELU, ``z * Phi(z)`` (``nn.GELU()``), in fp32."""
    return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))


@triton.jit
def _gelu_grad(z):
    """``d gelu / dz = Phi(z) + z * phi(z)``, in fp32."""
    return 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)


@triton.jit
def _gemm_kernel(A, B, BIAS, AUX, OUT, OUT2, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 stride_om, stride_on, EPILOGUE: tl.constexpr, STORE_Z: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``acc = A [M, K] @ B [K, N]`` per ``[BLOCK_M, BLOCK_N]`` tile (tiles grouped by ``GROUP_M`` rows
    of tiles so that neighbouring programs share B in L2), then the epilogue:
    ``GELU``: ``OUT2 = z = acc + BIAS`` (rounded to OUT's dtype; stored only if ``STORE_Z``: a forward
    that no backward follows needs none) and ``OUT = gelu(z)``;
    ``GELU_GRAD``: ``OUT = acc * gelu'(AUX)``."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    tile_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    b_ptr = B + rk[:, None] * stride_bk + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b = tl.load(b_ptr, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptr += BLOCK_K * stride_ak
        b_ptr += BLOCK_K * stride_bk
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offsets = rm[:, None].to(tl.int64) * stride_om + rn[None, :] * stride_on
    if EPILOGUE == 0:  # GELU
        z = (acc + tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]).to(OUT2.dtype.element_ty)
        if STORE_Z:
            tl.store(OUT2 + offsets, z, mask=mask)
        tl.store(OUT + offsets, _gelu(z.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)
    else:  # GELU_GRAD
        z = tl.load(AUX + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offsets, (acc * _gelu_grad(z)).to(OUT.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): the fastest forward + backward of 14 candidates at
# ViT-B/16, ViT-L/14 and text-tower shapes on an H100 (``scripts/benchmarks/mlp.py --tune``)
TILES = (64, 128, 64, 8, 4, 4)
INTERPRETED_TILES = (32, 32, 32, 4, 1, 1)


def _gemm(a: torch.Tensor, b: torch.Tensor, epilogue: int, bias: torch.Tensor | None = None,
          aux: torch.Tensor | None = None, store_z: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``a [M, K] @ b [K, N]`` (any strides) with ``epilogue``: ``(gelu(z), z)`` (``z`` None unless
    ``store_z``) or ``(acc * gelu'(aux), None)``."""
    if not (a.is_cuda or interpreting()):
        raise RuntimeError("model.fused_mlp=true needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    (m, k), n = a.shape, b.shape[1]
    out = a.new_empty(m, n)
    store_z = store_z and epilogue == GELU
    out2 = a.new_empty(m, n) if store_z else out
    block_m, block_n, block_k, group_m, warps, stages = INTERPRETED_TILES if interpreting() else TILES
    _gemm_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
        a, b, bias if bias is not None else out, aux if aux is not None else out, out, out2, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        EPILOGUE=epilogue, STORE_Z=store_z, UPCAST=interpreting() and a.dtype == torch.bfloat16,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=warps, num_stages=stages)
    return out, (out2 if store_z else None)


def _check(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> None:
    if x.dim() != 2 or w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != x.shape[1] or w2.shape[1] != w1.shape[0] \
            or b1.shape != (w1.shape[0],) or b2.shape != (w2.shape[0],):
        raise ValueError(f"fused_mlp takes x [M, E], w1 [H, E], b1 [H], w2 [E', H], b2 [E']; got {tuple(x.shape)}, "
                         f"{tuple(w1.shape)}, {tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}")
    if len({t.dtype for t in (x, w1, b1, w2, b2)}) != 1:
        raise ValueError("fused_mlp takes its inputs in one dtype (cast them as autocast would)")


@torch.library.custom_op("megabatch::fused_mlp", mutates_args=())
def fused_mlp_op(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                 b2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, z, h)``: ``z = x w1^T + b1``, ``h = gelu(z)`` (exact), ``y = h w2^T + b2``."""
    _check(x, w1, b1, w2, b2)
    h, z = _gemm(x, w1.t(), GELU, bias=b1)
    return torch.addmm(b2, h, w2.t()), z, h


@fused_mlp_op.register_fake
def _(x, w1, b1, w2, b2):
    return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(x.shape[0], w1.shape[0]), \
        x.new_empty(x.shape[0], w1.shape[0])


@torch.library.custom_op("megabatch::fused_mlp_inference", mutates_args=())
def fused_mlp_inference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                        b2: torch.Tensor) -> torch.Tensor:
    """``fused_mlp``'s ``y`` where no backward follows (GradCache's graph-free pass, evaluation): ``z``
    is not written."""
    _check(x, w1, b1, w2, b2)
    h, _ = _gemm(x, w1.t(), GELU, bias=b1, store_z=False)
    return torch.addmm(b2, h, w2.t())


@fused_mlp_inference.register_fake
def _(x, w1, b1, w2, b2):
    return x.new_empty(x.shape[0], w2.shape[0])


@torch.library.custom_op("megabatch::fused_mlp_backward", mutates_args=())
def fused_mlp_backward(dy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, z: torch.Tensor,
                       h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``fused_mlp``'s ``y`` for ``dy``: ``(dx, dw1, db1, dw2, db2)``; ``dz = (dy w2) *
    gelu'(z)`` comes out of one GEMM."""
    dz, _ = _gemm(dy, w2, GELU_GRAD, aux=z)
    return dz @ w1, dz.t() @ x, dz.sum(0), dy.t() @ h, dy.sum(0)


@fused_mlp_backward.register_fake
def _(dy, x, w1, w2, z, h):
    return torch.empty_like(x), torch.empty_like(w1), w1.new_empty(w1.shape[0]), torch.empty_like(w2), \
        w2.new_empty(w2.shape[0])


def _setup_context(ctx, inputs, output) -> None:
    x, w1, _, w2, _ = inputs
    _, z, h = output
    ctx.save_for_backward(x, w1, w2, z, h)


def _backward(ctx, dy, dz, dh):
    x, w1, w2, z, h = ctx.saved_tensors
    return fused_mlp_backward(dy.contiguous(), x, w1, w2, z, h)


fused_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def fused_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """``gelu(x w1^T + b1) w2^T + b2`` for ``x [M, E]`` (exact GELU), differentiable in every input.
    Without autograd (no grad mode, or no input that requires a gradient) ``z`` is not stored."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2, b2)):
        return fused_mlp_op(x, w1, b1, w2, b2)[0]
    return fused_mlp_inference(x, w1, b1, w2, b2)
