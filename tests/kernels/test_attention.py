"""The Triton attention kernels on the packed projection (``kernels/attention.py``) against a float64
reference: the output and the packed gradient's q, k and v parts, at the towers' odd lengths
(197, 257, causal 77) and head dims 64 and 80, fp32 and bf16 (CPU: through ``TRITON_INTERPRET=1``,
set in conftest); compiled without graph breaks (a registered custom op)."""

from __future__ import annotations

import math

import pytest
import torch

from megabatch.kernels import attention
from megabatch.kernels.attention import packed_attention

from ..helpers import rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(qkv: torch.Tensor, causal: bool, grad_out: torch.Tensor):
    """Softmax attention in float64 from the packed ``[b, s, 3, h, d]``: the output ``[b, s, h, d]``
    and the packed gradient."""
    x = qkv.detach().double().requires_grad_()
    q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)  # [b, h, s, d]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        length = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1),
                                    float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2)
    out.backward(grad_out.double())
    return out.detach(), x.grad


# bf16: the inputs' own rounding (2^-8) bounds what any kernel reaches against float64
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("length,head_dim,causal,dtype", [
    (197, 64, False, torch.float32), (257, 80, False, torch.float32), (77, 64, True, torch.float32),
    (197, 64, False, torch.bfloat16), (257, 64, False, torch.bfloat16), (77, 80, True, torch.bfloat16),
])
def test_packed_attention_gives_the_float64_output_and_gradients(length, head_dim, causal, dtype):
    generator = torch.Generator().manual_seed(length + head_dim)
    qkv = (torch.randn(2, length, 3, 2, head_dim, generator=generator) * 1.5).to(DEVICE, dtype).requires_grad_()
    grad_out = torch.randn(2, length, 2, head_dim, generator=generator).to(DEVICE, dtype)
    out = packed_attention(qkv, causal)
    out.backward(grad_out)
    want_out, want_grad = reference(qkv, causal, grad_out)
    assert out.shape == (2, length, 2, head_dim) and out.dtype == dtype and qkv.grad.dtype == dtype
    assert rel_error(out.detach(), want_out) <= TOLERANCE[dtype]
    for part, name in enumerate("qkv"):  # each of the packed gradient's parts on its own
        assert rel_error(qkv.grad[:, :, part], want_grad[:, :, part]) <= TOLERANCE[dtype], name


@pytest.mark.parametrize("tiles", [(16, 32), (32, 16)])
@pytest.mark.parametrize("length,causal", [(77, True), (50, False)])
def test_query_and_key_blocks_of_different_sizes_give_the_same_result(monkeypatch, tiles, length, causal):
    """The loops' split into whole and masked blocks (a causal diagonal, the block the sequence ends
    in) holds for any pair of block sizes, not only equal ones: every kernel at both tiles."""
    block_m, block_n = tiles
    monkeypatch.setattr(attention, "INTERPRETED_TILES", (block_m, block_n, 1, 1))
    monkeypatch.setattr(attention, "TILES", {kernel: {64: (block_m, block_n, 4, 2), 128: (block_m, block_n, 4, 2)}
                                             for kernel in attention.TILES})
    generator = torch.Generator().manual_seed(length)
    qkv = torch.randn(2, length, 3, 2, 64, generator=generator).to(DEVICE).requires_grad_()
    grad_out = torch.randn(2, length, 2, 64, generator=generator).to(DEVICE)
    out = packed_attention(qkv, causal)
    out.backward(grad_out)
    want_out, want_grad = reference(qkv, causal, grad_out)
    assert rel_error(out.detach(), want_out) <= 1e-5 and rel_error(qkv.grad, want_grad) <= 1e-5


# exp2 overflows where a mask then selects 0, and in dK/dV rows of keys past the sequence (never stored)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2", "ignore:invalid value encountered in matmul")
@pytest.mark.parametrize("causal", [False, True])
def test_rows_whose_every_score_is_tiny_keep_finite_gradients(causal):
    """Scores far below zero (log-sum-exps under -128 in base 2) would overflow ``exp2(-lse)`` at the
    zero keys past the sequence, and inf * 0 is NaN in dQ: those keys are masked."""
    direction = torch.nn.functional.normalize(torch.randn(64, generator=torch.Generator().manual_seed(1)), dim=0)
    qkv = torch.randn(1, 45, 3, 1, 64, generator=torch.Generator().manual_seed(2)) * 0.1
    qkv[:, :, 0, 0] += 40 * direction  # every q . k is about -1600 / 8 = -200
    qkv[:, :, 1, 0] -= 40 * direction
    qkv = qkv.to(DEVICE).requires_grad_()
    grad_out = torch.randn(1, 45, 1, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    packed_attention(qkv, causal).backward(grad_out)
    _, want = reference(qkv, causal, grad_out)
    assert torch.isfinite(qkv.grad).all() and rel_error(qkv.grad, want) <= 1e-4  # scores of -200 in fp32


def test_a_causal_kernel_differs_from_the_full_one():
    """The causal flag reaches the kernels (the first query sees only the first key)."""
    qkv = torch.randn(1, 40, 3, 1, 64, device=DEVICE)
    full, causal = packed_attention(qkv, False), packed_attention(qkv, True)
    assert torch.allclose(causal[0, 0, 0], qkv[0, 0, 2, 0], atol=1e-6)
    assert rel_error(causal, full) > 0.1


def test_compiled_it_is_one_graph_with_the_eager_gradients():
    """A registered custom op: ``torch.compile(fullgraph=True)`` traces around it (a graph break
    would raise), and forward and backward give the eager results."""
    torch._dynamo.reset()
    weight = torch.randn(3 * 64, 64, device=DEVICE) / 8

    def block(x):
        qkv = torch.nn.functional.linear(x, weight).view(x.shape[0], x.shape[1], 3, 2, 32)
        return packed_attention(qkv, True).flatten(2).square().sum()

    x = torch.randn(2, 33, 64, device=DEVICE, requires_grad=True)
    eager = block(x)
    (eager_grad,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(block, fullgraph=True)(x)
    (compiled_grad,) = torch.autograd.grad(compiled, x)
    assert rel_error(compiled.detach(), eager.detach()) <= 1e-5 and rel_error(compiled_grad, eager_grad) <= 1e-5


def test_a_strided_qkv_gets_its_gradient_in_its_own_layout():
    """A ``qkv`` that is not one contiguous tensor (here every other token of a longer one) still
    gets the float64 gradients, each in its place."""
    base = torch.randn(1, 2 * 45, 3, 2, 64, device=DEVICE, requires_grad=True)
    qkv = base[:, ::2]
    grad_out = torch.randn(1, 45, 2, 64, device=DEVICE)
    packed_attention(qkv, False).backward(grad_out)
    _, want = reference(qkv, False, grad_out)
    assert rel_error(base.grad[:, ::2], want) <= 1e-5 and base.grad[:, 1::2].abs().max() == 0


def masked_reference(qkv: torch.Tensor, lengths: torch.Tensor, grad_out: torch.Tensor):
    """``reference`` per sample on its first ``lengths[i]`` tokens; padding rows zero, their gradient zero."""
    out, grad = torch.zeros_like(qkv[:, :, 0], dtype=torch.float64), torch.zeros_like(qkv, dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        out[i, :n], grad[i, :n] = (part[0] for part in reference(qkv[i:i + 1, :n], False, grad_out[i:i + 1, :n]))
    return out, grad


@pytest.mark.parametrize("tiles", [(32, 32), (16, 32), (32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lengths_make_the_padding_invisible(monkeypatch, tiles, dtype):
    """``lengths``: each sample's padding is seen by no query, its rows are zero and get no gradient, and its
    values do not matter: the float64 attention of each sample's own tokens, at lengths that end inside a block,
    on a block's edge, fill the sequence, and leave whole blocks of padding (skipped); every kernel at each tile."""
    block_m, block_n = tiles
    monkeypatch.setattr(attention, "INTERPRETED_TILES", (block_m, block_n, 1, 1))
    monkeypatch.setattr(attention, "TILES", {kernel: {64: (block_m, block_n, 4, 2), 128: (block_m, block_n, 4, 2)}
                                             for kernel in attention.TILES})
    generator = torch.Generator().manual_seed(7)
    length, lengths = 70, torch.tensor([70, 33, 32, 5])
    qkv = (torch.randn(4, length, 3, 2, 64, generator=generator) * 1.5).to(DEVICE, dtype)
    grad_out = torch.randn(4, length, 2, 64, generator=generator).to(DEVICE, dtype)
    padding = torch.arange(length)[None, :] >= lengths[:, None]
    qkv[padding.to(DEVICE)] = 1e4  # huge padding: any query seeing it, or any use of it, shows
    qkv.requires_grad_()
    out = packed_attention(qkv, False, lengths.to(DEVICE))
    out.backward(grad_out)
    want_out, want_grad = masked_reference(qkv.detach(), lengths, grad_out)
    assert out[padding.to(DEVICE)].abs().max() == 0 and qkv.grad[padding.to(DEVICE)].abs().max() == 0
    assert rel_error(out.detach(), want_out) <= TOLERANCE[dtype]
    for part, name in enumerate("qkv"):
        assert rel_error(qkv.grad[:, :, part], want_grad[:, :, part]) <= TOLERANCE[dtype], name
    full = packed_attention(qkv.detach(), False, torch.full((4,), length, device=DEVICE))
    assert torch.equal(full, packed_attention(qkv.detach(), False))  # all valid: the kernel without lengths


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"qkv \[batch, length, 3, heads, head_dim\]"):
        packed_attention(torch.randn(2, 5, 4, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="head dims up to 128"):
        packed_attention(torch.randn(1, 5, 3, 1, 160, device=DEVICE))
    with pytest.raises(ValueError, match="one integer per sample"):
        packed_attention(torch.randn(2, 5, 3, 1, 16, device=DEVICE), lengths=torch.tensor([5]))
