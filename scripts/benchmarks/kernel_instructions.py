"""The loss kernels' machine code for Hopper, counted on a machine without a GPU: each kernel compiled for sm_90 (bf16
features, tiles loaded and G stored through tensor descriptors, the tiles a GPU's ``tuned.json`` table gives it at a
width) by Triton and the ``ptxas`` it ships, disassembled with its ``nvdisasm``, for several source trees side by
side; ``name=src@MEGABATCH_LOSS_SHARED_SHIFT=checked`` compiles a tree's statistics kernels with that shared shift
(the default here: on, a branch a tile, as under the interpreter; a Hopper GPU's ``auto`` is ``checked``),
``name=src@MEGABATCH_LOSS_ACC_FLAG=1`` its block kernels with the accumulator's reset as the tensor cores' flag
(``megabatch.kernels.compile_hooks``).

    python scripts/benchmarks/kernel_instructions.py --out instructions.json
    python scripts/benchmarks/kernel_instructions.py --trees off=src@MEGABATCH_LOSS_SHARED_SHIFT=0,on=src \
        --kernels stats --out instructions.json

Per kernel and tree: the registers a thread takes, its spills (local stores and loads), how many of its tensor-core
instructions end a batch that is then waited for (``hgmma_batches_ended``: all of them, and the dots run one at a
time, as in a loop Triton could not pipeline), the instructions by opcode, and each basic block (from a branch label
to the next) with its length, exponentials and reciprocals (``MUFU``) and tensor-core instructions (``HGMMA``): a
tile's path through the loop is the blocks it runs, and ``logits_per_thread`` (the tile's logits over its threads)
turns a block's length into instructions a logit. An epilogue that issues as many instructions as the tile's GEMM
takes cycles (a warp issues one a cycle; the SM's tensor cores do 4,096 bf16 FLOP a cycle) leaves the kernel near
half the peak: these counts show where a change moves that, before any GPU time is spent. They are a proxy, not a
timing: ``loss_passes.py`` on a GPU says what the change is worth.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started

# distill_stats: the distillation statistics kernel of the trees before 03ba5c2
KERNELS = {"stats": "_stats_kernel", "grad": "_grad_kernel", "sigmoid": "_sigmoid_kernel",
           "distill_stats": "_distill_stats_kernel", "distill_grad": "_distill_grad_kernel"}
# float arguments; else int32
FLOATS = {"g_scale", "inv_g_scale", "t_scale", "t_weight", "diagonal_weight", "spread"}
DESCRIPTORS = {"rows_ptr": ["BLOCK_M", "BLOCK_K"], "t_rows_ptr": ["BLOCK_M", "BLOCK_K"],
               "cols_ptr": ["BLOCK_N", "BLOCK_K"], "t_cols_ptr": ["BLOCK_N", "BLOCK_K"],
               "g_ptr": ["BLOCK_M", "BLOCK_N"]}
FLAGS_ON = {"TMA", "G_TMA", "FAST_RCP", "WRITE_G", "SCALE_SUM", "EVEN"}  # every option on (bf16 on Hopper, whole tiles)
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_kernel(kernel: str, config: dict) -> bytes:
    """``kernel``'s cubin for sm_90 at ``config``'s tiles, bf16 operands through tensor descriptors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megabatch.kernels import triton_tiles

    fn = getattr(triton_tiles, KERNELS[kernel])
    constants = {**{k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}, "PRECISION": "tf32", "GROUP_M": 8}
    # the statistics kernels' shared shift as MEGABATCH_LOSS_SHARED_SHIFT sets it (auto: a branch a tile, as under the
    # interpreter; name checked or 0 for what a GPU runs)
    mode = getattr(triton_tiles, "SHARED_SHIFT_MODES", {}).get(getattr(triton_tiles, "SHARED_SHIFT", "1"), 1)
    constants["SHARED"] = mode if kernel == "stats" else mode > 0
    # the accumulator's reset as the tensor cores' flag, as MEGABATCH_LOSS_ACC_FLAG sets it for sm_90 (by default on
    # since 2026-12-05; an earlier tree has none, or takes no capability)
    hooks = getattr(importlib.import_module("megabatch.kernels"), "compile_hooks", None)
    try:
        flagged = hooks is not None and hooks.enabled((9, 0))
    except TypeError:
        flagged = hooks.enabled()
    if flagged:
        hooks.install()
        constants["ACC_FLAG"] = True
    types, values = {}, {}
    tma = any(param.name == "TMA" for param in fn.params)  # an earlier tree's kernels may load by thread only
    for param in fn.params:
        if param.is_constexpr:
            types[param.name] = "constexpr"
            values[param.name] = constants.get(param.name, param.name in FLAGS_ON)
        elif tma and param.name in DESCRIPTORS:
            types[param.name] = f"tensordesc<bf16{[constants[side] for side in DESCRIPTORS[param.name]]}>"
        elif param.name.endswith("_ptr"):
            types[param.name] = "*bf16" if param.name in DESCRIPTORS else "*fp32"
        else:
            types[param.name] = "fp32" if param.name in FLOATS else "i32"
    compiled = triton.compile(ASTSource(fn=fn, signature=types, constexprs=values), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    return compiled.asm["cubin"]


def count(cubin: bytes) -> dict:
    """Registers, spills, opcodes and basic blocks of one kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    opcodes, blocks, block = collections.Counter(), [], {"label": "entry", "instructions": 0, "mufu": 0, "hgmma": 0}
    # a tensor-core instruction that ends its batch (``gsb0``) is waited for; all of them so: the dots run one at a time
    waited = sum("HGMMA" in line and "gsb0" in line for line in sass.splitlines())
    for line in sass.splitlines():
        if label := LABEL.match(line):
            blocks.append(block)
            block = {"label": label.group(1), "instructions": 0, "mufu": 0, "hgmma": 0}
        elif op := OPCODE.search(line):
            opcodes[op.group(1)] += 1
            block["instructions"] += 1
            block["mufu"] += op.group(1) == "MUFU"
            block["hgmma"] += op.group(1) == "HGMMA"
    blocks.append(block)
    registers = re.search(r"REG:(\d+)", usage)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_stores": opcodes["STL"], "spill_loads": opcodes["LDL"],
            "instructions": sum(opcodes.values()), "hgmma_batches_ended": waited,
            "opcodes": dict(opcodes.most_common()),
            "blocks": [b for b in blocks if b["instructions"]]}


def measure(name: str, kernels: list[str], gpu: str, width: int) -> list[dict]:
    """Each kernel of the tree on the path, at ``gpu``'s tuned tiles for bf16 features ``width`` wide."""
    import torch

    from megabatch.kernels import triton_tiles

    table = json.loads(triton_tiles.TUNED_FILE.read_text()).get(gpu, {})
    rows = []
    for kernel in kernels:
        if not hasattr(triton_tiles, KERNELS[kernel]):  # e.g. distill_stats, gone since 03ba5c2
            rows.append({"tree": name, "kernel": kernel, "status": f"no {KERNELS[kernel]} in this tree"})
            print(f"{name} {kernel}: no {KERNELS[kernel]} in this tree", flush=True)
            continue
        key = triton_tiles.config_key(kernel, torch.bfloat16, width, "tf32")
        config = table.get(key, triton_tiles.DEFAULT_CONFIG)
        counted = count(compile_kernel(kernel, config))
        logits = config["BLOCK_M"] * config["BLOCK_N"] // (32 * config["num_warps"])
        rows.append({"tree": name, "kernel": kernel, "key": key, "config": config, "tuned": key in table,
                     "logits_per_thread": logits, **counted})
        print(f"{name} {kernel} {key} {config}: {counted['instructions']} instructions, {counted['registers']} "
              f"registers, spills {counted['spill_stores']}/{counted['spill_loads']}, tensor-core batches ended "
              f"{counted['hgmma_batches_ended']} of {counted['opcodes'].get('HGMMA', 0)}; blocks of >= {logits}: "
              + ", ".join(f"{b['label']} {b['instructions']} (MUFU {b['mufu']}, HGMMA {b['hgmma']})"
                          for b in counted["blocks"] if b["instructions"] >= logits), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="this=src", help="name=src-path pairs, comma-separated, run in turn")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--gpu", default="NVIDIA H200", help="whose tuned.json tiles (the tree's own table)")
    parser.add_argument("--width", type=int, default=512, help="the features' width (the tiles' key)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.worker:  # one tree, in a process of its own (its megabatch first on the path, no interpreter)
        name = args.worker.partition("=")[0]
        rows = measure(name, args.kernels.split(","), args.gpu, args.width)
        Path(args.out).write_text(json.dumps(rows))
        return
    os.environ["TRITON_INTERPRET"] = "0"  # compiled, not interpreted (the tests' conftest sets 1)
    from bench import run_trees, write_results

    def done(per_tree: list) -> None:
        rows = [row for result in per_tree for row in (result if isinstance(result, list) else [result])]
        write_results(args.out, rows, trees=args.trees, gpu_table=args.gpu, width=args.width, target="sm_90")

    run_trees(__file__, args.trees, args.out, done)


if __name__ == "__main__":
    main()
