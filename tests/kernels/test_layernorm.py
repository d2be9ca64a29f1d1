"""The residual add + LayerNorm kernels (``kernels/layernorm.py``) against a float64 ``s = x + y``,
``layer_norm(s)``: both outputs and the gradients of x, y, weight and bias, with a gradient flowing into
both outputs (the residual's and the norm's), at widths that are no power of two and row counts that
are no multiple of a block or of the backward's programs (CPU: through ``TRITON_INTERPRET=1``);
compiled without graph breaks (a registered custom op)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import layernorm
from megabatch.kernels.layernorm import add_layer_norm

from ..helpers import assert_compiles_whole, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: the inputs', s's and the gradients' own rounding (one bf16 ulp is 2^-8 of a value)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    width = shape[-1]
    x, y = torch.randn(*shape, generator=generator) * 2 + 1, torch.randn(*shape, generator=generator)
    weight, bias = 1 + torch.randn(width, generator=generator) / 4, torch.randn(width, generator=generator) / 4
    return ([t.to(DEVICE, dtype).requires_grad_() for t in (x, y)]
            + [t.to(DEVICE).requires_grad_() for t in (weight, bias)])  # parameters stay fp32, as under autocast


def reference(tensors, grad_s, grad_out, eps):
    x, y, weight, bias = (t.detach().double().requires_grad_() for t in tensors)
    s = (x + y).to(tensors[0].dtype).double() if tensors[0].dtype != torch.float32 else x + y  # s rounded, as stored
    if tensors[0].dtype != torch.float32:  # the rounding passes the gradient through unchanged
        s = x + y + (s - (x + y)).detach()
    out = F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    torch.autograd.backward((s, out), (grad_s.double(), grad_out.double()))
    return s.detach(), out.detach(), [t.grad for t in (x, y, weight, bias)]


@pytest.mark.parametrize("shape,dtype", [
    ((37, 48), torch.float32), ((3, 13, 80), torch.float32), ((2, 9, 100), torch.bfloat16), ((19, 768), torch.float32),
])
def test_add_layer_norm_gives_the_float64_outputs_and_gradients(shape, dtype):
    tensors = inputs(shape, dtype)
    generator = torch.Generator().manual_seed(5)
    grad_s, grad_out = (torch.randn(*shape, generator=generator).to(DEVICE, dtype) for _ in range(2))
    s, out = add_layer_norm(*tensors[:2], *tensors[2:], eps=1e-5)
    torch.autograd.backward((s, out), (grad_s, grad_out))
    want_s, want_out, want_grads = reference(tensors, grad_s, grad_out, 1e-5)
    assert s.dtype == out.dtype == dtype and s.shape == out.shape == shape
    assert rel_error(s.detach(), want_s) <= TOLERANCE[dtype] / 4
    assert rel_error(out.detach(), want_out) <= TOLERANCE[dtype]
    for name, tensor, want in zip(("x", "y", "weight", "bias"), tensors, want_grads, strict=True):
        assert tensor.grad.dtype == tensor.dtype and rel_error(tensor.grad, want) <= TOLERANCE[dtype], name


def test_the_norm_reads_the_residual_as_rounded():
    # 1024 + y in fp16 rounds to a multiple of 1 (0.5 below 1024): normalising the unrounded sum would
    # give other values (fp16: Triton's interpreter truncates to bf16 where the GPU rounds to nearest)
    y = (torch.rand(4, 40, generator=torch.Generator().manual_seed(6)) * 1.8 - 0.9).to(DEVICE, torch.float16)
    x = torch.full_like(y, 1024.0)
    weight, bias = torch.ones(40, device=DEVICE), torch.zeros(40, device=DEVICE)
    s, out = add_layer_norm(x, y, weight, bias)
    assert torch.equal(s, x + y)
    assert rel_error(out.double(), F.layer_norm(s.double(), (40,))) <= 2e-3


def test_a_gradient_into_the_norm_alone_and_many_programs_per_partial_sum(monkeypatch):
    # more rows than the backward's programs cover in one round: each program sums several blocks
    monkeypatch.setattr(layernorm, "backward_programs", lambda rows, device: 3)
    tensors = inputs((41, 24), torch.float32, seed=3)
    grad_out = torch.randn(41, 24, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _, out = add_layer_norm(*tensors, eps=1e-6)
    out.backward(grad_out)
    _, _, want_grads = reference(tensors, torch.zeros_like(grad_out), grad_out, 1e-6)
    for name, tensor, want in zip(("x", "y", "weight", "bias"), tensors, want_grads, strict=True):
        assert rel_error(tensor.grad, want) <= TOLERANCE[torch.float32], name


def test_compiled_it_is_one_graph_with_the_eager_gradients():
    def block(x, y, weight, bias):
        s, out = add_layer_norm(x, y.sin(), weight, bias)
        return (s + out.square()).sum()

    assert_compiles_whole(block, inputs((2, 11, 32), torch.float32, seed=1))


def test_bad_inputs_are_named():
    x, y, weight, bias = (t.detach() for t in inputs((5, 16), torch.float32))
    with pytest.raises(ValueError, match="x and y of one shape"):
        add_layer_norm(x, y[:, :8], weight, bias)
    with pytest.raises(ValueError, match=r"weight, bias \[16\]"):
        add_layer_norm(x, y, weight[:8], bias)
