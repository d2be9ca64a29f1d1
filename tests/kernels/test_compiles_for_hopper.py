"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU: Triton's own compiler and the ``ptxas`` it
ships, to a cubin. ``TRITON_INTERPRET=1`` runs a kernel's Python, which accepts what the compiler refuses (a global
that is not a ``tl.constexpr``, a branch whose two sides differ in type): this is the check the interpreted tests
cannot make, before any GPU time is spent on a kernel that does not build. The compiler runs in a process of its
own, without the interpreter the test session sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..helpers import ROOT

pytest.importorskip("triton")

KERNELS = ["_stats_kernel", "_grad_kernel", "_sigmoid_kernel", "_distill_grad_kernel"]
COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megabatch.kernels import triton_tiles

# float arguments; else int32
FLOATS = {"g_scale", "inv_g_scale", "t_scale", "t_weight", "diagonal_weight", "spread"}
OPERANDS = {"rows_ptr", "cols_ptr", "t_rows_ptr", "t_cols_ptr", "g_ptr"}
DESCRIPTORS = {"rows_ptr": ["BLOCK_M", "BLOCK_K"], "t_rows_ptr": ["BLOCK_M", "BLOCK_K"],
               "cols_ptr": ["BLOCK_N", "BLOCK_K"], "t_cols_ptr": ["BLOCK_N", "BLOCK_K"],
               "g_ptr": ["BLOCK_M", "BLOCK_N"]}
kernel, sizes = getattr(triton_tiles, sys.argv[1]), {}
for features, flags in (("bf16", True), ("fp32", False)):  # every boolean constant on (TMA too), then off
    constants = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32 if features == "fp32" else 64, "PRECISION": "tf32",
                 "GROUP_M": 8}
    types, values = {}, {}
    for param in kernel.params:
        if param.is_constexpr:
            types[param.name], values[param.name] = "constexpr", constants.get(param.name, flags)
        elif flags and param.name in DESCRIPTORS:  # TMA: the operands and G are tensor descriptors of their tiles
            block = [constants[side] for side in DESCRIPTORS[param.name]]
            types[param.name] = f"tensordesc<{features}{block}>"
        elif param.name.endswith("_ptr"):
            types[param.name] = f"*{features}" if param.name in OPERANDS else "*fp32"
        else:
            types[param.name] = "fp32" if param.name in FLOATS else "i32"
    compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=values),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    sizes[features] = len(compiled.asm["cubin"])
print(json.dumps(sizes))
"""


@pytest.mark.parametrize("name", KERNELS)
def test_the_loss_kernels_compile_for_hopper(name, tmp_path):
    """Each kernel with bf16 features and every flag on (tiles loaded and G stored through tensor descriptors), and
    with fp32 features and every flag off (per-thread loads and stores)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", COMPILE, name], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.splitlines()[-1])
    assert sizes["bf16"] > 0 and sizes["fp32"] > 0


# the other Triton kernels: the packed attention (model.attention=triton) and the GPU decoder's crop resize, each
# with the pointer dtypes, float arguments and constants its launcher gives (other scalars: int32); per variant
ATTENTION_POINTERS = {"QKV": "bf16", "OUT": "bf16", "DO": "bf16", "DQKV": "bf16", "LSE": "fp32", "DELTA": "fp32",
                      "LENGTHS": "i32"}
ATTENTION_FLAGS = [dict(CAUSAL=True, HAS_LENGTHS=False, UPCAST=False, PRECISION="tf32"),  # a text tower's
                   dict(CAUSAL=False, HAS_LENGTHS=True, UPCAST=False, PRECISION="tf32")]  # a NaFlex tower's
OTHER_KERNELS = {
    "megabatch.kernels.attention": {
        "_forward_kernel": [dict(pointers=ATTENTION_POINTERS, floats=["scale_log2"], warps=4, stages=3,
                                 constants=dict(flags, BLOCK_M=64, BLOCK_N=32, BLOCK_D=64))
                            for flags in ATTENTION_FLAGS],
        "_delta_kernel": [dict(pointers=ATTENTION_POINTERS, floats=[], warps=4, stages=3,
                               constants=dict(BLOCK_M=64, BLOCK_D=64))],
        "_dkdv_kernel": [dict(pointers=ATTENTION_POINTERS, floats=["scale", "scale_log2"], warps=4, stages=3,
                              constants=dict(flags, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64)) for flags in ATTENTION_FLAGS],
        "_dq_kernel": [dict(pointers=ATTENTION_POINTERS, floats=["scale", "scale_log2"], warps=8, stages=2,
                            constants=dict(flags, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128)) for flags in ATTENTION_FLAGS],
    },
    "megabatch.kernels.crops": {
        "_taps_kernel": [dict(pointers={"boxes": "i64", "weights": "fp64", "columns": "i32"}, floats=[], warps=4,
                              stages=3, constants=dict(MODE=mode, BLOCK=64)) for mode in (0, 1, 2)],
        "_rows_kernel": [dict(pointers={"src": "u8", "tmp": "fp64", "weights": "fp64", "columns": "i32"}, floats=[],
                              warps=2, stages=3, constants=dict(BLOCK_I=2, BLOCK_J=256))],
        "_columns_kernel": [dict(pointers={"tmp": "fp64", "out": "u8", "weights": "fp64", "columns": "i32"},
                                 floats=[], warps=2, stages=3, constants=dict(BLOCK_I=2, BLOCK_J=256))],
    },
}
COMPILE_OTHERS = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module_name, kernels = sys.argv[1], json.loads(sys.argv[2])
module, sizes = importlib.import_module(module_name), {}
for name, variants in kernels.items():
    kernel = getattr(module, name)
    for index, variant in enumerate(variants):
        types, values = {}, {}
        for param in kernel.params:
            if param.is_constexpr:
                types[param.name], values[param.name] = "constexpr", variant["constants"][param.name]
            elif param.name in variant["pointers"]:
                types[param.name] = "*" + variant["pointers"][param.name]
            else:
                types[param.name] = "fp32" if param.name in variant["floats"] else "i32"
        compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=values),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": variant["warps"], "num_stages": variant["stages"]})
        sizes[f"{name}/{index}"] = len(compiled.asm["cubin"])
print(json.dumps(sizes))
"""


@pytest.mark.parametrize("module", sorted(OTHER_KERNELS))
def test_the_other_triton_kernels_compile_for_hopper(module, tmp_path):
    """The attention kernels (causal without lengths, and bidirectional with each sample's length) and the crop
    resize's (each interpolation's taps) compile as their launchers call them."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": str(ROOT / "src")}
    kernels = OTHER_KERNELS[module]
    done = subprocess.run([sys.executable, "-c", COMPILE_OTHERS, module, json.dumps(kernels)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.splitlines()[-1])
    expected = {f"{name}/{index}" for name, variants in kernels.items() for index in range(len(variants))}
    assert set(sizes) == expected and all(size > 0 for size in sizes.values())
