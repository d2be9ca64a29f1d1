"""Training images decode to uint8 RGB tensors whatever the file format, with the same pixels as
PIL gives, and anything undecodable raises (the loader then skips and counts the sample)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from megabatch.data.samples import decode_rgb
from megabatch.data.transforms import seeded, train_transform


def picture(mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buffer.getvalue()


@pytest.mark.parametrize("mode,fmt", [("RGB", "PNG"), ("RGBA", "PNG"), ("L", "PNG"), ("P", "PNG"),
                                      ("RGB", "WEBP"), ("RGB", "BMP"), ("RGB", "TIFF"), ("RGB", "JPEG"),
                                      ("L", "JPEG")])
def test_every_format_decodes_to_the_pixels_pil_gives(mode, fmt):
    data = encode(picture(mode), fmt)
    tensor = decode_rgb(data)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert tensor.dtype == torch.uint8 and tensor.shape == (3, 40, 56)
    # lossless formats match exactly; JPEG's IDCT may round differently between decoders
    tolerance = 2 if fmt == "JPEG" else 0
    assert np.abs(tensor.permute(1, 2, 0).numpy().astype(int) - expected.astype(int)).max() <= tolerance


@pytest.mark.parametrize("data", [None, b"", b"not an image at all" * 10])
def test_undecodable_bytes_raise(data):
    with pytest.raises((ValueError, OSError)):
        decode_rgb(data)


def test_a_truncated_jpeg_raises():
    data = encode(picture(), "JPEG")
    with pytest.raises((ValueError, OSError)):
        decode_rgb(data[: len(data) // 2])


def test_the_seeded_crop_is_a_pure_function_of_the_seed():
    image = decode_rgb(encode(picture(), "PNG"))
    transform = train_transform(24)
    first, again, other = (seeded(transform, image, seed) for seed in (7, 7, 8))
    assert first.dtype == torch.uint8 and first.shape == (3, 24, 24)
    assert torch.equal(first, again) and not torch.equal(first, other)
