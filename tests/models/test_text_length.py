"""Text at its own length: captions cut after their last token give the features of the whole
context, for the built-in shapes and open_clip's text towers; towers whose features read the padding
are left whole; GradCache with every exact option on gives the gradients of all of them off."""

from __future__ import annotations

import pytest
import torch

from megabatch.models import ClipModel, build_model
from megabatch.models.text_length import TextTrim

from ..helpers import compose, rel_error

SMALL_TEXT = ["+model.text.layers=2", "+model.text.width=64", "+model.text.heads=2"]
SMALL_IMAGE = ["+model.image.image_size=32", "+model.image.patch_size=16", "+model.image.width=64",
               "+model.image.layers=1"]
TRIMMED = {  # name -> overrides: each kind of text tower whose features ignore the padding
    "tiny": ["model=tiny"],
    "tiny_minilm (Hugging Face, mean pooling)": ["model=tiny_minilm"],
    "vit_b32": ["model=vit_b32", "model.text.layers=2"],
    "ViT-B-32 (argmax)": ["model=openclip", "model.arch=ViT-B-32", *SMALL_TEXT, *SMALL_IMAGE],
    "ViT-L-14-worldwide (eos)": ["model=openclip", "model.arch=ViT-L-14-worldwide", "+model.text.vocab_size=512",
                                 *SMALL_TEXT, *SMALL_IMAGE],
    "PE-Core-T-16-384 (TextTransformer)": ["model=openclip", "model.arch=PE-Core-T-16-384", *SMALL_TEXT],
}
UNTRIMMED = {  # name -> (overrides, why)
    "ViT-B-16-SigLIP": (["model=openclip", "model.arch=ViT-B-16-SigLIP", *SMALL_TEXT, *SMALL_IMAGE], "'last'"),
    "ViT-L-14-CLIPA": (["model=openclip", "model.arch=ViT-L-14-CLIPA", *SMALL_TEXT, *SMALL_IMAGE], "'last'"),
    "coca_ViT-B-32": (["model=openclip", "model.arch=coca_ViT-B-32", *SMALL_TEXT, *SMALL_IMAGE], "CoCa"),
}


def captions(model: ClipModel, rows: int, seed: int = 0) -> torch.Tensor:
    """``rows`` random token ids of ragged lengths (one of the whole context), padded with the
    tower's pad id after an end token that each pooling finds (the highest id for argmax)."""
    trim, generator = model.text_trim, torch.Generator().manual_seed(seed)
    tower = getattr(model.clip, "text", model.clip)
    context = model.context_length
    vocab = tower.token_embedding.num_embeddings if hasattr(tower, "token_embedding") else tower.config.vocab_size
    eos = model.model_cfg["text_cfg"].get("eos_id")
    texts = torch.full((rows, context), trim.pad_id, dtype=torch.long)
    lengths = torch.randint(2, context // 2, (rows,), generator=generator)
    lengths[0] = context
    for row, length in enumerate(lengths.tolist()):
        tokens = torch.randint(2, vocab - 2, (length,), generator=generator)
        tokens[tokens == trim.pad_id] = 3
        tokens[-1] = eos if eos is not None else vocab - 1
        texts[row, :length] = tokens
    return texts


def built(overrides: list[str]) -> ClipModel:
    torch.manual_seed(0)
    return build_model(compose(*overrides).model).eval()


@pytest.mark.parametrize("name", list(TRIMMED))
def test_cut_captions_give_the_whole_contexts_features(name):
    model = built(TRIMMED[name])
    assert model.trim_text() is None and model.text_trim is not None
    texts = captions(model, 6)
    trim = model.text_trim
    assert trim.lengths(texts).tolist()[0] == model.context_length
    with torch.no_grad():
        whole = model.encode_text(texts)
        for length in sorted({trim.bucket(n) for n in range(1, model.context_length + 1)}):
            fits = trim.lengths(texts) <= length  # every caption that ends within `length` tokens
            assert fits.sum() >= (5 if length >= model.context_length // 2 else 0)
            if fits.any():
                cut = model.encode_text(texts[fits][:, :length].contiguous())
                assert rel_error(cut, whole[fits]) <= 1e-5, length
        # the rows of a sub-batch cut to its longest caption
        short = texts[1:]
        assert trim.cut(short).shape[1] < model.context_length
        assert rel_error(model.encode_text(trim.cut(short)), whole[1:]) <= 1e-5


@pytest.mark.parametrize("name", list(UNTRIMMED))
def test_towers_that_read_the_padding_keep_their_context(name):
    overrides, why = UNTRIMMED[name]
    model = built(overrides)
    reason = model.trim_text()
    assert model.text_trim is None and why in reason, reason


def test_lengths_and_buckets():
    trim = TextTrim(pad_id=0, context_length=77)
    texts = torch.tensor([[5, 9, 7, 0, 0], [5, 0, 7, 0, 0], [0, 0, 0, 0, 0], [5, 9, 7, 4, 2]])
    assert trim.lengths(texts).tolist() == [3, 3, 0, 5]  # padding inside a caption is kept
    assert [trim.bucket(n) for n in (0, 1, 8, 9, 70, 72, 73, 77)] == [8, 8, 8, 16, 72, 72, 77, 77]
    left_padded = torch.tensor([[0, 0, 5, 9]])
    assert TextTrim(0, 4, step=2).cut(left_padded).shape[1] == 4  # nothing after the last token to cut
    assert TextTrim(0, 5, step=2).cut(texts[:3]).shape == (3, 4)


def test_trim_text_false_keeps_the_context():
    model = built(["model=tiny"])
    assert model.trim_text(False) == "model.trim_text=false" and model.text_trim is None
