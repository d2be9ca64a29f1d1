"""A shape's first forward-backward through the Triton attention kernels, as a cold start's first probe meets it:
each row a fresh process with an empty Triton cache (its kernels compiled in the call), with the backward's kernels
compiled beside the forward's (``MEGABATCH_ATTENTION_AHEAD=1``, the default: ``kernels.attention.compile_ahead``) and
without (``0``: each at its first launch), the two taking turns.

    python scripts/benchmarks/first_call.py --shape 32x197x12x64 --rounds 3 --out first_call.json

A row's ``first_s`` is the first call's forward and backward (synchronised), ``second_s`` the same call again (no
compiling): their difference is the compiling the call paid for. The shape is ``batch x length x heads x head_dim``
(``c`` at the end: causal), bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench import write_results

ONE = """
import json, sys, time
import torch
from megabatch.kernels.attention import packed_attention
shape = sys.argv[1]
causal = shape.endswith("c")
batch, length, heads, head_dim = (int(x) for x in shape.rstrip("c").split("x"))
qkv = torch.randn(batch, length, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
torch.cuda.synchronize()
times = []
for _ in range(2):
    start = time.perf_counter()
    packed_attention(qkv, causal).float().square().sum().backward()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps({"first_s": times[0], "second_s": times[1]}))
"""


def one(shape: str, ahead: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "MEGABATCH_ATTENTION_AHEAD": ahead, "TRITON_CACHE_DIR": cache,
               "TRITON_HOME": cache}
        started = time.perf_counter()
        ran = subprocess.run([sys.executable, "-c", ONE, shape], env=env, capture_output=True, text=True,
                             timeout=300)
        wall = time.perf_counter() - started
    if ran.returncode != 0:
        return {"shape": shape, "ahead": ahead == "1", "error": ran.stderr[-2000:]}
    return {"shape": shape, "ahead": ahead == "1", "process_s": wall, **json.loads(ran.stdout.splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="32x197x12x64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for turn in range(args.rounds):
        for ahead in ("1", "0") if turn % 2 == 0 else ("0", "1"):
            rows.append(one(args.shape, ahead))
            print(json.dumps(rows[-1])[:300], flush=True)
    write_results(args.out, rows)
    for ahead in (True, False):
        firsts = sorted(r["first_s"] for r in rows if r["ahead"] == ahead and "first_s" in r)
        if firsts:
            print(f"ahead={ahead}: first call {firsts[len(firsts) // 2]:.2f} s (median of {len(firsts)})")


if __name__ == "__main__":
    main()
