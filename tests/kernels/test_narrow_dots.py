"""fp32 features whose values are bf16's (GradCache's phase 2 upcasts its bf16 feature buffers) are
multiplied in bf16 inside the Triton kernels (``dots_dtype``, the loss's ``values_in``): the
products are exact either way, so the loss and its gradients equal the fp32 kernels' up to the order
of fp32 sums, with G' and the GEMMs still fp32. Through the interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megabatch.kernels import triton_tiles
from megabatch.losses import InfClLoss, LocalLoss, SigLipLoss, clip_loss_reference
from megabatch.train.step.gradcache import EncodedBatch, ReplayInputs, loss_and_feature_grads
from megabatch.train.step.precision import Precision

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_valued(b: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(b, c, generator=generator), dim=-1)
    texts = F.normalize(images + torch.randn(b, c, generator=generator), dim=-1)
    return images.bfloat16().float().to(DEVICE), texts.bfloat16().float().to(DEVICE)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_bf16_dots_give_the_fp32_kernels_stats_and_gradients(precision):
    rows, cols = bf16_valued(40, 24, seed=1)
    scale, weight = torch.tensor(20.0, device=DEVICE), torch.tensor(0.5, device=DEVICE)
    plain = triton_tiles.block_stats(rows, cols, scale, fp32_precision=precision)
    narrow = triton_tiles.block_stats(rows, cols, scale, fp32_precision=precision, dots_dtype=torch.bfloat16)
    for got, want in zip(narrow, plain, strict=True):
        assert relative(got, want) < 1e-6
    grads = [triton_tiles.block_grads(rows, cols, scale, *plain, weight, True, fp32_precision=precision,
                                      dots_dtype=dots) for dots in (None, torch.bfloat16)]
    for got, want in zip(grads[1], grads[0], strict=True):
        assert got.dtype == torch.float32
        assert relative(got, want) < 1e-5  # a bf16 G' would be ~1e-3 off


def test_bf16_dots_give_the_fp32_sigmoid_block():
    rows, cols = bf16_valued(36, 20, seed=2)
    scale, bias = torch.tensor(10.0, device=DEVICE), torch.tensor(-5.0, device=DEVICE)
    results = []
    for dots in (None, torch.bfloat16):
        d_rows, d_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        sums = triton_tiles.sigmoid_block(rows, cols, scale, bias, True, d_rows, d_cols, dots_dtype=dots)
        results.append((*sums, d_rows, d_cols))
    for got, want in zip(results[1], results[0], strict=True):
        assert relative(got, want) < 1e-5


def test_narrow_dots_need_fp32_inputs_and_a_narrow_dtype():
    rows, cols = bf16_valued(8, 16, seed=3)
    assert triton_tiles._dot_operands(rows, cols, None) == (rows, cols)
    assert triton_tiles._dot_operands(rows.bfloat16(), cols.bfloat16(), torch.float16)[0].dtype == torch.bfloat16
    assert triton_tiles._dot_operands(rows, cols, torch.float16)[0].dtype == torch.float16
    with pytest.raises(ValueError, match="bf16 or fp16"):
        triton_tiles._dot_operands(rows, cols, torch.int8)


def test_the_promise_reaches_the_kernels_only_when_given():
    loss = InfClLoss(impl="triton")
    assert "dots_dtype" not in loss.tile_functions(DEVICE, "block_stats")[0].keywords
    narrow = loss.tile_functions(DEVICE, "block_stats", values_in=torch.bfloat16)[0]
    assert narrow.keywords["dots_dtype"] == torch.bfloat16
    torch_impl = InfClLoss(impl="torch").tile_functions(DEVICE, "block_stats", values_in=torch.bfloat16)[0]
    assert "dots_dtype" not in torch_impl.keywords
    # fp32 buffers promise nothing
    assert "dots_dtype" not in loss.tile_functions(DEVICE, "block_stats", values_in=torch.float32)[0].keywords
    assert loss.compute_options(torch.float32) == {"values_in": None}
    assert LocalLoss().compute_options(torch.bfloat16) == {}  # a whole-matrix loss takes no hint


@pytest.mark.parametrize("loss_fn", [InfClLoss(impl="triton"), SigLipLoss(impl="triton")], ids=["infcl", "siglip"])
def test_phase_2_on_bf16_buffers_multiplies_in_bf16_and_keeps_the_gradients(loss_fn, monkeypatch):
    images, texts = bf16_valued(32, 16, seed=4)
    seen = []
    for name in ("block_stats", "block_grads", "sigmoid_block"):
        original = getattr(triton_tiles, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs.get("dots_dtype"))
            return _original(*args, **kwargs)
        monkeypatch.setattr(triton_tiles, name, spy)
    grads = {}
    for dtype in (torch.bfloat16, torch.float32):  # the same values in bf16 and in fp32 buffers
        seen.clear()
        encoded = EncodedBatch(images.to(dtype), texts.to(dtype), sub_batch=8, replays=ReplayInputs(True, True))
        precision = Precision.create("bf16", DEVICE, "bf16" if dtype == torch.bfloat16 else "fp32")
        bias = torch.tensor(-5.0, device=DEVICE) if loss_fn.uses_bias else None
        grads[dtype] = loss_and_feature_grads(loss_fn, encoded, torch.tensor(2.0, device=DEVICE), bias, precision)
        assert seen and set(seen) == {torch.bfloat16 if dtype == torch.bfloat16 else None}
    narrow, plain = grads[torch.bfloat16], grads[torch.float32]
    assert relative(narrow.loss, plain.loss) < 1e-6
    close = 1e-5 if DEVICE.type == "cpu" else 1e-3  # on a GPU, cuBLAS's TF32 rounding of G' (see below)
    assert relative(narrow.image, plain.image) < close and relative(narrow.text, plain.text) < close
    if not loss_fn.uses_bias:  # and both are the float64 loss's gradients
        reference = [images.double().requires_grad_(), texts.double().requires_grad_()]
        truth = clip_loss_reference(*reference, torch.tensor(2.0, dtype=torch.float64, device=DEVICE).exp())
        d_images, d_texts = torch.autograd.grad(truth, reference)
        assert abs(float(narrow.loss) / float(truth.detach()) - 1) < 1e-5
        bound = 2e-3 if DEVICE.type == "cuda" else 1e-4  # cuBLAS's TF32 GEMMs on a GPU, for both buffers
        assert relative(narrow.image.double(), d_images) < bound and relative(narrow.text.double(), d_texts) < bound


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels on a GPU")
@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_bf16_dots_on_the_gpu_are_as_close_to_float64_as_the_fp32_kernels(precision):
    """Compiled, the stats agree to fp32 sums' order; the gradients go through cuBLAS, whose TF32
    rounding of G' amplifies that order into TF32's own error (~1e-4): each side is held to the
    float64 gradients instead, the bf16 dots no further from them than the fp32 kernels."""
    b = 4096
    rows, cols = bf16_valued(b, 512, seed=5)
    scale, weight = torch.tensor(50.0, device="cuda"), torch.tensor(1 / (2 * b), device="cuda")
    plain = triton_tiles.block_stats(rows, cols, scale, fp32_precision=precision)
    narrow = triton_tiles.block_stats(rows, cols, scale, fp32_precision=precision, dots_dtype=torch.bfloat16)
    for got, want in zip(narrow, plain, strict=True):
        assert relative(got, want) < 1e-5
    reference = [rows.double().requires_grad_(), cols.double().requires_grad_()]
    truth = torch.autograd.grad(clip_loss_reference(*reference, scale.double()), reference)
    errors = []
    for dots in (None, torch.bfloat16):  # (the loss above is weight * block_grads' sum)
        grads = triton_tiles.block_grads(rows, cols, scale, *plain, weight, True, fp32_precision=precision,
                                         dots_dtype=dots)
        errors.append(max(relative(got.double(), want) for got, want in zip(grads[:2], truth, strict=True)))
    assert errors[1] <= 2 * errors[0] + 1e-5
    assert errors[1] < (2e-3 if precision == "tf32" else 1e-4)


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32's 10 stored mantissa bits, to nearest (as cuBLAS rounds its TF32 operands)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def test_an_fp16_g_multiplies_as_exactly_as_tf32_does(monkeypatch):
    """``G_FP16``: the backward writes G' in fp16 (scaled) and multiplies it by fp16 copies of the features, as a
    GPU does for bf16-valued fp32 features under tf32. Its gradients are as close to float64's as the TF32 GEMMs'
    on fp32 G' would be (G' rounded to TF32 here, the features being exact in TF32), and the route was taken: in the
    interpreter fp32 G' multiplies exactly (no TF32) and fp16 G' does not; on a GPU both routes round as TF32 does,
    and they differ."""
    b = 96
    rows, cols = bf16_valued(b, 32, seed=6)
    scale, weight = torch.tensor(40.0, device=DEVICE), torch.tensor(1 / (2 * b), device=DEVICE)
    lse = triton_tiles.block_stats(rows, cols, scale, dots_dtype=torch.bfloat16)
    got = {}
    for route in ("1", "0"):
        monkeypatch.setattr(triton_tiles, "G_FP16", route)
        got[route] = triton_tiles.block_grads(rows, cols, scale, *lse, weight, True, dots_dtype=torch.bfloat16)
    logits = scale.double() * rows.double() @ cols.double().T
    g = logits.softmax(1) + logits.softmax(0) - 2 * torch.eye(b, dtype=torch.float64, device=DEVICE)
    alpha = float(scale) * float(weight)
    exact = (alpha * g @ cols.double(), alpha * g.T @ rows.double())
    g_tf32 = tf32(g.float()).double()
    as_tf32 = (alpha * g_tf32 @ cols.double(), alpha * g_tf32.T @ rows.double())
    for side in range(2):
        fp16_error = relative(got["1"][side].double(), exact[side])
        assert fp16_error <= 1.5 * relative(as_tf32[side], exact[side])
        if rows.is_cuda:  # fp32 G' through cuBLAS's TF32 GEMMs (their rounding of G' is not modelled bit for bit)
            assert relative(got["0"][side].double(), exact[side]) <= 2 * relative(as_tf32[side], exact[side])
            assert not torch.equal(got["0"][side], got["1"][side])
        else:
            assert relative(got["0"][side].double(), exact[side]) < 1e-6 < fp16_error
    assert relative(got["1"][2], got["0"][2]) < 1e-6  # the scale's gradient comes from the kernel's fp32 sums


@pytest.mark.parametrize("kernel", ["sigmoid", "distill"])
def test_the_sigmoid_and_distillation_backwards_take_the_fp16_g_too(kernel, monkeypatch):
    rows, cols = bf16_valued(40, 24, seed=7)
    t_rows, t_cols = bf16_valued(40, 16, seed=8)
    scale = torch.tensor(10.0, device=DEVICE)
    results = {}
    for route in ("1", "0"):
        monkeypatch.setattr(triton_tiles, "G_FP16", route)
        d_rows, d_cols = torch.zeros_like(rows), torch.zeros_like(cols)
        if kernel == "sigmoid":
            sums = triton_tiles.sigmoid_block(rows, cols, scale, torch.tensor(-5.0, device=DEVICE), True, d_rows,
                                              d_cols, dots_dtype=torch.bfloat16)
        else:
            lse = triton_tiles.distill_stats(rows, cols, t_rows, t_cols, scale, 5.0, dots_dtype=torch.bfloat16)
            sums = triton_tiles.distill_block(rows, cols, t_rows, t_cols, scale, 5.0, *lse, 0.5, d_rows, d_cols,
                                              dots_dtype=torch.bfloat16)
        results[route] = (d_rows, d_cols, torch.stack(list(sums)))
    for side in range(2):
        error = relative(results["1"][side], results["0"][side])
        assert 1e-7 < error < 2e-3  # fp16 G: TF32's rounding, not fp32's
    # the scale's gradient is summed from the row gradients (their GEMMs' rounding); the sigmoid's loss and the
    # distillation's teacher-weighted logits are the kernel's fp32 sums, which G's format does not touch
    assert relative(results["1"][2], results["0"][2]) < 2e-3
    assert relative(results["1"][2][0], results["0"][2][0]) < 1e-6


def test_features_past_fp16s_range_keep_an_fp32_g(monkeypatch):
    rows, cols = bf16_valued(24, 16, seed=9)
    rows[3, 2] = 2.0**17  # a bf16 value fp16 cannot hold
    scale, weight = torch.tensor(0.01, device=DEVICE), torch.tensor(0.5, device=DEVICE)
    lse = triton_tiles.block_stats(rows, cols, scale, dots_dtype=torch.bfloat16)
    got = []
    for route in ("1", "0"):
        monkeypatch.setattr(triton_tiles, "G_FP16", route)
        got.append(triton_tiles.block_grads(rows, cols, scale, *lse, weight, True, dots_dtype=torch.bfloat16))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
    assert triton_tiles._g_format(rows, cols, (rows.bfloat16(), cols.bfloat16()), "tf32", 1.0)[0] == torch.float32


def test_the_fp16_g_is_taken_on_a_gpu_only_by_default():
    rows, cols = bf16_valued(8, 16, seed=10)
    dots = (rows.bfloat16(), cols.bfloat16())
    assert triton_tiles.G_FP16 == "auto"
    expected = torch.float16 if DEVICE.type == "cuda" else torch.float32
    assert triton_tiles._g_format(rows, cols, dots, "tf32", 1.0)[0] == expected
    assert triton_tiles._g_format(rows, cols, dots, "ieee", 1.0)[0] == torch.float32  # exact stays exact
    assert triton_tiles._g_format(rows, cols, None, "tf32", 1.0)[0] == torch.float32  # fp32 values: TF32's GEMMs


@pytest.mark.parametrize("sub_batch", [32, 8], ids=["one-sub-batch", "four-sub-batches"])
def test_gradcache_with_the_fp16_g_gives_the_float64_gradients_to_tf32s_error(sub_batch, monkeypatch):
    """GradCache's loss on bf16 buffers with G' in fp16 (as a GPU runs it): the loss and the features' gradients of
    the float64 loss, the gradients to TF32's error (the one-pass step's GEMMs on a GPU are TF32 on fp32 G'), for any
    sub-batch."""
    monkeypatch.setattr(triton_tiles, "G_FP16", "1")
    images, texts = bf16_valued(32, 16, seed=11)
    encoded = EncodedBatch(images.bfloat16(), texts.bfloat16(), sub_batch=sub_batch, replays=ReplayInputs(True, True))
    precision = Precision.create("bf16", DEVICE, "bf16")
    grads = loss_and_feature_grads(InfClLoss(impl="triton"), encoded, torch.tensor(2.0, device=DEVICE), None,
                                   precision)
    reference = [images.double().requires_grad_(), texts.double().requires_grad_()]
    truth = clip_loss_reference(*reference, torch.tensor(2.0, dtype=torch.float64, device=DEVICE).exp())
    d_images, d_texts = torch.autograd.grad(truth, reference)
    assert abs(float(grads.loss) / float(truth.detach()) - 1) < 1e-5
    for got, want in ((grads.image, d_images), (grads.text, d_texts)):
        assert 1e-5 < relative(got.double(), want) < 2e-3  # fp16 G' rounding (fp32 G': ~3e-7 here)
