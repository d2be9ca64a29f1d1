"""NaFlex images packed as one uint8 tensor (``model.image.naflex``): the layout the data path writes
(``data/naflex.py``, in the loader workers) and the NaFlex tower reads (``models/naflex.py``, on the device),
here below both.

A sub-batch is uint8 ``[n, L, 3 p^2 + 4]``: row ``(i, t)`` holds patch ``t`` of image ``i`` (its pixels in timm's
``(p, p, 3)`` order, ``patchify_image``'s), then its grid row and column plus one, as two big-endian bytes each; a
padding row's coordinate bytes are zero (row 0 is not a patch). One tensor, as the fixed-size path's images: it
crosses from the loader workers in shared memory, is pinned, copied, sliced into sub-batches and kept for the
replay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

COORD_BYTES = 4  # a row's grid row + 1 and column + 1, two bytes each (grids up to 65,534 patches a side)


def row_bytes(patch_size: int) -> int:
    """The bytes of one packed row: a patch's pixels and its coordinates."""
    return 3 * patch_size ** 2 + COORD_BYTES


def pack(pixels: torch.Tensor, coord: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One image's patches (uint8 ``[k, 3 p^2]``) and grid coordinates (``[k, 2]``: row, column) as uint8
    ``[seq_len, 3 p^2 + 4]`` rows, padded with zero rows after the ``k``."""
    count = pixels.shape[0]
    if count > seq_len:
        raise ValueError(f"{count} patches do not fit in a sequence of {seq_len}")
    rows = torch.zeros(seq_len, pixels.shape[1] + COORD_BYTES, dtype=torch.uint8)
    rows[:count, :-COORD_BYTES] = pixels
    shifted = coord.to(torch.int64) + 1
    rows[:count, -4], rows[:count, -3] = shifted[:, 0] // 256, shifted[:, 0] % 256
    rows[:count, -2], rows[:count, -1] = shifted[:, 1] // 256, shifted[:, 1] % 256
    return rows


def grid_example(rows: int, patch_size: int, seq_len: int) -> torch.Tensor:
    """``rows`` packed images of ``seq_len`` patches each (a grid ``side x seq_len // side``, the rest padding;
    zero pixels): inputs of the right shape for a FLOP count, a memory probe or a compile warm-up."""
    side = max(1, int(seq_len ** 0.5))
    height, width = side, seq_len // side
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    coord = torch.stack([y.reshape(-1), x.reshape(-1)], dim=1)
    pixels = torch.zeros(height * width, 3 * patch_size ** 2, dtype=torch.uint8)
    return pack(pixels, coord, seq_len).expand(rows, -1, -1).contiguous()


def unpack(packed: torch.Tensor, patch_size: int, mean: Sequence[float], std: Sequence[float]) -> dict:
    """Packed patches (uint8 ``[n, L, 3 p^2 + 4]``) as timm ``NaFlexVit``'s input: ``patches`` float
    ``[n, L, 3 p^2]`` scaled to [0, 1] and normalised per channel with ``mean`` / ``std``, ``patch_coord`` int64
    ``[n, L, 2]`` (row, column; 0 for padding), ``patch_valid`` bool ``[n, L]``."""
    n, length, row = packed.shape
    if row != row_bytes(patch_size):
        raise ValueError(f"packed patches of {row} bytes a row for {patch_size} px patches "
                         f"({row_bytes(patch_size)} expected): made for another patch size")
    coord = packed[..., -COORD_BYTES:].to(torch.int64)
    coord = torch.stack([coord[..., 0] * 256 + coord[..., 1], coord[..., 2] * 256 + coord[..., 3]], dim=-1) - 1
    valid = coord[..., 0] >= 0
    mean_t = torch.tensor(tuple(mean), dtype=torch.float32, device=packed.device)
    std_t = torch.tensor(tuple(std), dtype=torch.float32, device=packed.device)
    pixels = packed[..., :-COORD_BYTES].reshape(n, length, patch_size * patch_size, 3).float().div(255)
    pixels = ((pixels - mean_t) / std_t).reshape(n, length, -1)
    return {"patches": pixels, "patch_coord": coord.clamp(min=0), "patch_valid": valid}
