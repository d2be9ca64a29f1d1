"""The fused MLP (``kernels/mlp.py``: exact GELU in the first GEMM's epilogue, its derivative in the
epilogue of the GEMM giving the hidden gradient) against a float64 ``c_proj(gelu(c_fc(x)))``: the
output and every input's gradient, at sizes that are no multiple of any tile (CPU: through
``TRITON_INTERPRET=1``); compiled without graph breaks (a registered custom op)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import mlp
from megabatch.kernels.mlp import fused_mlp

from ..helpers import assert_compiles_whole, record_calls, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: the inputs' and z's own rounding


def inputs(rows: int, width: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(rows, width, generator=generator), torch.randn(hidden, width, generator=generator) / 4,
               torch.randn(hidden, generator=generator), torch.randn(width, hidden, generator=generator) / 8,
               torch.randn(width, generator=generator)]
    return [t.to(DEVICE, dtype).requires_grad_() for t in tensors]


def reference(tensors, grad):
    x, w1, b1, w2, b2 = (t.detach().double().requires_grad_() for t in tensors)
    y = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    y.backward(grad.double())
    return y.detach(), [t.grad for t in (x, w1, b1, w2, b2)]


@pytest.mark.parametrize("rows,width,hidden,dtype", [
    (37, 48, 96, torch.float32), (70, 40, 72, torch.float32), (37, 48, 96, torch.bfloat16),
])
def test_fused_mlp_gives_the_float64_output_and_gradients(rows, width, hidden, dtype):
    tensors = inputs(rows, width, hidden, dtype)
    grad = torch.randn(rows, width, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    y = fused_mlp(*tensors)
    y.backward(grad)
    want_y, want_grads = reference(tensors, grad)
    assert y.shape == (rows, width) and y.dtype == dtype
    assert rel_error(y.detach(), want_y) <= TOLERANCE[dtype]
    for name, tensor, want in zip(("x", "w1", "b1", "w2", "b2"), tensors, want_grads, strict=True):
        assert tensor.grad.dtype == dtype and rel_error(tensor.grad, want) <= TOLERANCE[dtype], name


def test_without_autograd_it_gives_the_same_output_without_storing_z(monkeypatch):
    tensors = inputs(37, 48, 96, torch.float32, seed=2)
    want = reference(tensors, torch.zeros(37, 48, device=DEVICE))[0]
    stored = record_calls(monkeypatch, mlp, "_gemm", lambda *args, **kwargs: kwargs.get("store_z", True))
    with torch.no_grad():
        y = fused_mlp(*tensors)
    plain = fused_mlp(*(t.detach() for t in tensors))  # no input requires a gradient
    assert y.grad_fn is None and plain.grad_fn is None and stored == [False, False]
    assert rel_error(y, want) <= TOLERANCE[torch.float32] and rel_error(plain, want) <= TOLERANCE[torch.float32]


def test_compiled_it_is_one_graph_with_the_eager_gradients():
    def block(x, w1, b1, w2, b2):
        return (x + fused_mlp(torch.layer_norm(x, (32,)), w1, b1, w2, b2)).square().sum()

    assert_compiles_whole(block, inputs(33, 32, 64, torch.float32, seed=1))


def test_bad_inputs_are_named():
    x, w1, b1, w2, b2 = (t.detach() for t in inputs(5, 16, 32, torch.float32))
    with pytest.raises(ValueError, match=r"x \[M, E\], w1 \[H, E\]"):
        fused_mlp(x, w1.t(), b1, w2, b2)
    with pytest.raises(ValueError, match="one dtype"):
        fused_mlp(x.double(), w1, b1, w2, b2)
