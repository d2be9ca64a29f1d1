"""The Triton attention kernels on the packed projection (``kernels/attention.py``) against a float64
reference: the output and the packed gradient's q, k and v parts, at the towers' odd lengths
(197, 257, causal 77) and head dims 64 and 80, fp32 and bf16 (CPU: through ``TRITON_INTERPRET=1``,
set in conftest); compiled without graph breaks (a registered custom op)."""

from __future__ import annotations

import math

import pytest
import torch

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


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"qkv \[batch, length, 3, heads, head_dim\]"):
        packed_attention(torch.randn(2, 5, 4, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="head dims up to 128"):
        packed_attention(torch.randn(1, 5, 3, 1, 160, device=DEVICE))
