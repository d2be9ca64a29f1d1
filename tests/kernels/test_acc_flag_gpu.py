"""On a Hopper GPU, ``MEGABATCH_LOSS_ACC_FLAG`` changes no bit of the loss kernels' results: the backward's and the
sigmoid loss's outputs with the accumulator's reset as the tensor-core instruction's flag (``1``) are the same tensors
as with the zeroed accumulator (``0``). Each setting runs in a process of its own (the setting is read at import, and
the compile hook is installed once a process) with its own Triton cache. Skipped without an sm_90 GPU and a Triton
that has the pass."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ..helpers import ROOT

pytest.importorskip("triton")

RUN = """
import sys
import torch
from megabatch.kernels import compile_hooks, triton_tiles

torch.manual_seed(0)
out, capability = {}, torch.cuda.get_device_capability()
out["enabled"] = compile_hooks.enabled(capability)
for m, n in ((4096, 4096), (4000, 3968)):  # tiles covering the block (EVEN), and ragged blocks (masks)
    rows = torch.nn.functional.normalize(torch.randn(m, 512, device="cuda"), dim=1).bfloat16()
    cols = torch.nn.functional.normalize(torch.randn(n, 512, device="cuda"), dim=1).bfloat16()
    scale, bias, weight = (torch.tensor(v, device="cuda") for v in (30.0, -10.0, 1.0 / m))
    s = scale * (rows.float() @ cols.float().T)
    row_lse, col_lse = s.logsumexp(1), s.logsumexp(0)
    d_rows, d_cols, d_scale = triton_tiles.block_grads(rows, cols, scale, row_lse, col_lse, weight, m == n)
    out[f"grad/{m}x{n}"] = (d_rows, d_cols, d_scale)
    g_rows = torch.zeros(m, 512, device="cuda")
    g_cols = torch.zeros(n, 512, device="cuda")
    sums = triton_tiles.sigmoid_block(rows, cols, scale, bias, m == n, g_rows, g_cols)
    out[f"sigmoid/{m}x{n}"] = (*sums, g_rows, g_cols)
torch.save({k: v if isinstance(v, bool) else tuple(t.cpu() for t in v) for k, v in out.items()}, sys.argv[1])
"""


def _hopper() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    from megabatch.kernels import compile_hooks

    return compile_hooks.available()


@pytest.mark.skipif(not _hopper(), reason="an sm_90 GPU and a Triton with optimize_accumulator_init")
def test_the_accumulator_flag_changes_no_bit(tmp_path):
    results = {}
    for setting in ("0", "1"):
        env = {**os.environ, "TRITON_INTERPRET": "0", "MEGABATCH_LOSS_ACC_FLAG": setting,
               "TRITON_CACHE_DIR": str(tmp_path / f"triton{setting}"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
        path = tmp_path / f"out{setting}.pt"
        subprocess.run([sys.executable, "-c", RUN, str(path)], env=env, check=True, timeout=600)
        results[setting] = torch.load(path)
    off, on = results["0"], results["1"]
    assert (off.pop("enabled"), on.pop("enabled")) == (False, True)
    assert off.keys() == on.keys() and len(off) == 4
    for key in off:
        for a, b in zip(off[key], on[key], strict=True):
            assert torch.equal(a, b), key
