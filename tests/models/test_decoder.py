"""``model.decoder``: a caption decoder over the image tower's tokens alone (LocCa's captioner, SigLIP 2's decoder
objective). Teacher forcing is causal; parallel prediction reads the image alone; which captions are predicted in
parallel depends on the caption and the step, not on the batch it is in; the model's description and checkpoints
rebuild it; captions generate from it; bad values are config errors naming the key. (The loss and gradients on every
path: tests/train/test_objectives_contract.py's "decoder" row.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megabatch.config import ConfigError
from megabatch.models import build_model, from_description
from megabatch.models.decoder import CaptionDecoder, DecoderCfg
from megabatch.train.step.objectives import Caption

from ..helpers import compose

DECODER = ["model.decoder.layers=2", "model.decoder.width=32", "model.decoder.heads=2"]


def decoder(parallel: float = 0.5) -> CaptionDecoder:
    torch.manual_seed(0)
    return CaptionDecoder(DecoderCfg(layers=2, width=32, heads=2, mlp_ratio=2.0, parallel=parallel), image_width=24,
                          vocab_size=50, context_length=12)


def test_teacher_forcing_is_causal_and_parallel_prediction_reads_the_image_alone():
    model = decoder().eval()
    image = torch.randn(3, 5, 24)
    tokens = torch.randint(1, 50, (3, 11))
    later = tokens.clone()
    later[:, 6:] = torch.randint(1, 50, (3, 5))
    with torch.no_grad():
        forced, forced_later = model.logits(image, tokens), model.logits(image, later)
        assert torch.equal(forced[:, :6], forced_later[:, :6])  # position t sees tokens up to t
        assert not torch.allclose(forced[:, 6:], forced_later[:, 6:])
        parallel = torch.ones(3, dtype=torch.bool)
        other = torch.randint(1, 50, (3, 11))
        alone = model.logits(image, tokens, parallel)
        torch.testing.assert_close(alone, model.logits(image, other, parallel))  # no caption token is read
        assert not torch.allclose(alone, forced)
        assert not torch.allclose(alone, model.logits(torch.randn(3, 5, 24), tokens, parallel))


def test_the_parallel_captions_are_a_share_drawn_per_caption_and_step():
    model = decoder(parallel=0.5)
    texts = torch.randint(1, 49408, (4000, 12))
    drawn = model.parallel_rows(texts)
    assert 0.45 < drawn.float().mean() < 0.55
    assert torch.equal(model.parallel_rows(texts[1000:1500]), drawn[1000:1500])  # the batch around it does not matter
    model.step.fill_(1)
    again = model.parallel_rows(texts)
    assert 0.45 < again.float().mean() < 0.55 and (again != drawn).float().mean() > 0.3  # a new draw each step
    assert not decoder(parallel=0.0).parallel_rows(texts).any()
    assert decoder(parallel=1.0).parallel_rows(texts).all()


def test_the_head_runs_at_the_predicted_tokens_alone_and_gives_the_whole_contexts_loss():
    """The head and the softmax run at each caption's tokens after the first, not at its padding: the loss and the
    gradients are the cross-entropy over the whole context with the padding ignored, in float64; the count given by
    the caption objective (read on the host) selects the same tokens as the count made on the device."""
    model = decoder().double()
    image = torch.randn(4, 5, 24, dtype=torch.float64)
    texts = torch.randint(1, 50, (4, 12))
    for row, length in enumerate((12, 3, 7, 2)):  # padded after each caption's last token, one not at all
        texts[row, length:] = 0
    seen = []
    model.head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[:-1].numel()))
    whole = nn.functional.cross_entropy(model.logits(image, texts[:, :-1], model.parallel_rows(texts)).flatten(0, 1),
                                        texts[:, 1:].flatten(), ignore_index=0, reduction="sum")
    whole_grads = torch.autograd.grad(whole, list(model.parameters()))
    objective = Caption(1.0, 0, torch.device("cpu"), model)
    objective.one_pass_start(SimpleNamespace(texts=texts))
    predicted = objective.model_options_for(0)["caption_tokens"]
    assert predicted == 11 + 2 + 6 + 1 and seen == [4 * 11]
    for count in (predicted, None):
        loss = model.loss(image, texts, count)
        assert seen[-1] == predicted  # the head saw the predicted tokens alone
        torch.testing.assert_close(loss, whole, rtol=1e-12, atol=0)
        for grad, expected in zip(torch.autograd.grad(loss, list(model.parameters()), allow_unused=True),
                                  whole_grads, strict=True):
            torch.testing.assert_close(torch.zeros_like(expected) if grad is None else grad, expected,
                                       rtol=1e-10, atol=1e-12)


def test_the_heads_loss_and_gradients_are_the_whole_ones_a_few_tokens_at_a_time(monkeypatch):
    """The head's logits exist a chunk of tokens at a time (``decoder.HEAD_BYTES``), its gradients made in the
    forward: in float64 the loss and every gradient are those of the plain head and cross-entropy, with the
    loss's incoming gradient applied; without autograd the loss alone (the logits' GEMM, not the gradients' two);
    under bf16 autocast every gradient is as close to float64's as the plain path's is (1.05x at most here; the
    head's bias 8x closer)."""
    from megabatch.models import decoder as module

    monkeypatch.setattr(module, "HEAD_BYTES", 4 * 50 * 3)  # 3 tokens a chunk: the 20 tokens in 7 chunks
    model = decoder().double()
    image = torch.randn(4, 5, 24, dtype=torch.float64)
    texts = torch.randint(1, 50, (4, 12))
    for row, length in enumerate((12, 3, 7, 2)):
        texts[row, length:] = 0
    seen = []
    model.head.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[0]))
    states = model.caption_states(image, texts)
    plain = nn.functional.cross_entropy(model.head(states).flatten(0, 1), texts[:, 1:].flatten(), ignore_index=0,
                                        reduction="sum")
    params = list(model.parameters())
    expected = torch.autograd.grad(2.5 * plain, params, allow_unused=True)
    seen.clear()
    loss = model.head_loss(model.caption_states(image, texts), texts)
    assert seen == [3] * 6 + [2]
    torch.testing.assert_close(loss, plain, rtol=1e-13, atol=0)
    for grad, want in zip(torch.autograd.grad(2.5 * loss, params, allow_unused=True), expected, strict=True):
        assert (grad is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(grad, want, rtol=1e-11, atol=1e-13)
    from torch.utils.flop_counter import FlopCounterMode

    states = model.caption_states(image, texts).detach().requires_grad_()
    for grad_mode, products in ((False, 1), (True, 3)):  # the logits; and the gradients' two GEMMs
        with torch.set_grad_enabled(grad_mode), FlopCounterMode(display=False) as counter:
            loss = model.head_loss(states, texts)
        torch.testing.assert_close(loss.detach(), plain.detach(), rtol=1e-13, atol=0)
        assert counter.get_total_flops() == products * 2 * 20 * 32 * 50  # 20 tokens, width 32, 50 in the vocabulary
    exact = [None if grad is None else grad / 2.5 for grad in expected]
    model = model.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.head(model.caption_states(image.float(), texts)).float()
        plain = nn.functional.cross_entropy(logits.flatten(0, 1), texts[:, 1:].flatten(), ignore_index=0,
                                            reduction="sum")
        rounded = torch.autograd.grad(plain, params, allow_unused=True)
        loss = model.head_loss(model.caption_states(image.float(), texts), texts)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=0)
    for grad, want, truth in zip(grads, rounded, exact, strict=True):
        if truth is not None:
            assert grad.dtype == want.dtype == torch.float32
            assert (grad.double() - truth).norm() <= 1.25 * (want.double() - truth).norm() + 1e-9 * truth.norm()


def test_the_caption_objective_counts_the_steps_and_checkpoints_the_count():
    model = decoder()
    objective = Caption(1.0, 0, torch.device("cpu"), model)
    for _ in range(3):
        objective.new_step()
    assert int(model.step) == 2 and objective.state_dict() == {"steps": 3}
    resumed = Caption(1.0, 0, torch.device("cpu"), model)
    resumed.load_state_dict(objective.state_dict())
    resumed.new_step()
    assert int(model.step) == 3
    assert Caption(1.0, 0, torch.device("cpu")).state_dict() == {}  # a CoCa's: nothing to carry


def test_the_model_carries_it_and_its_description_rebuilds_it():
    model = build_model(compose(*DECODER).model)
    assert model.has_decoder and model.decoder_module is model.decoder
    assert not any(p.requires_grad for p in model.decoder.parameters())  # until loss.caption_weight trains it
    assert any(name.startswith("decoder.") for name in model.state_dict())
    assert not any(name.startswith("decoder.") for name in model.clip.state_dict())  # export: the CLIP alone
    rebuilt = from_description(model.description())
    rebuilt.load_state_dict(model.state_dict())
    images = torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8)
    texts = torch.randint(1, 100, (2, model.context_length))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(images, texts, caption=True)[4]["caption"],
                                   model(images, texts, caption=True)[4]["caption"])
        image_features = model(images, texts)[0]
        torch.testing.assert_close(model(images, texts, caption=True)[0], image_features)  # the same features
    assert not build_model(compose().model).has_decoder  # model.decoder.layers=0: none


def test_the_export_keeps_it_when_asked_and_an_open_clip_folder_brings_it_back(tmp_path):
    from megabatch.models.export import DECODER_NAME, check_export, export_open_clip

    torch.manual_seed(0)
    model = build_model(compose(*DECODER).model)
    plain = export_open_clip(model, tmp_path / "plain")
    assert not (plain / DECODER_NAME).exists()  # the CLIP alone by default
    kept = export_open_clip(model, tmp_path / "kept", decoder=True)
    assert (kept / DECODER_NAME).is_file() and check_export(model, kept) <= 1e-6  # open_clip loads it as before
    back = build_model(compose("model=openclip", "model.arch=null", f"model.pretrained={kept}").model)
    assert back.decoder is not None and back.decoder.cfg == model.decoder.cfg
    for name, tensor in model.decoder.state_dict().items():
        torch.testing.assert_close(back.decoder.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="decoder=true"):
        export_open_clip(build_model(compose().model), tmp_path / "none", decoder=True)


def test_captions_generate_from_it():
    from megabatch.models.generate import caption_texts

    model = build_model(compose(*DECODER).model).eval()
    images = torch.randn(2, 3, 32, 32)
    for method in ("beam_search", "top_k"):
        texts = caption_texts(model, images, method=method, max_len=5)
        assert len(texts) == 2 and all(isinstance(text, str) for text in texts)


@pytest.mark.parametrize("overrides,message", [
    (["model.decoder.layers=1", "model.decoder.heads=5"], r"model\.decoder: layers=1, width=64, heads=5"),
    (["model.decoder.layers=1", "model.decoder.parallel=1.5"], r"model\.decoder\.parallel=1\.5"),
    (["model.decoder.layers=1", "+model.decoder.depth=3"], r"model\.decoder\.depth: no such key"),
    (["model=tiny_coca", "+model.decoder.layers=1"], r"model\.decoder with model tiny_coca, a CoCa"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_model(compose(*overrides).model)
