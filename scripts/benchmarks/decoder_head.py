"""The caption decoder's head (``model.decoder``'s projection to the vocabulary and the cross-entropy at the predicted
tokens, ``CaptionDecoder.head_loss``): peak memory and seconds of its forward and backward per count of tokens, on the
GPU or the CPU, for several source trees side by side.

    python scripts/benchmarks/decoder_head.py --trees before=runs/before/src,after=src --tokens 7005,14010 \
        --out decoder_head.json

``--tokens``: the predicted tokens of one sub-batch (web-like captions predict ~14 tokens each: ~7,000 at a sub-batch
of 512). The head of a decoder of width 512 over open_clip's 49,408-token vocabulary, under bf16 autocast, on random
states of captions of 15 predicted tokens. Peak memory: on a GPU, torch's peak allocated above what was allocated
before the call; on the CPU, the process's peak resident memory above its start, each count in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench, however the script is started

CAPTION = 15  # predicted tokens a caption
WIDTH, VOCAB = 512, 49408


def measure(tokens: int, device: str, repeats: int) -> dict:
    """One count of tokens in this process (``megabatch`` from the tree first on the path)."""
    import torch

    from megabatch.models.decoder import CaptionDecoder, DecoderCfg

    torch.manual_seed(0)
    rows = -(-tokens // CAPTION)
    decoder = CaptionDecoder(DecoderCfg(layers=1, width=WIDTH, heads=8), image_width=768, vocab_size=VOCAB,
                             context_length=77).to(device)
    texts = torch.randint(1, VOCAB, (rows, CAPTION + 1), device=device)
    texts[-1, CAPTION + 1 - (rows * CAPTION - tokens):] = 0  # the last caption shorter: exactly ``tokens`` predicted
    states = torch.randn(rows, CAPTION, WIDTH, device=device, requires_grad=True)
    cuda = device == "cuda"

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = decoder.head_loss(states, texts, tokens)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    if cuda:
        step()  # warm
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = min(step() for _ in range(repeats))
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"tokens": tokens, "device": device, "seconds": seconds, "peak_gb": (peak - before) / 2**30,
            "peak_is": "peak allocated above the start" if cuda else "peak resident memory above the start"}


def worker(tokens: list[int], device: str, repeats: int) -> list[dict]:
    """Every count of tokens, on the CPU each in a process of its own (the peak resident memory is a process's)."""
    if device == "cuda":
        return [measure(count, device, repeats) for count in tokens]
    rows = []
    for count in tokens:
        ran = subprocess.run([sys.executable, __file__, "--measure", str(count), "--device", device,
                              "--repeats", str(repeats), "--out", "-"], capture_output=True, text=True, check=True)
        rows.append(json.loads(ran.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", default="this=src", help="name=src-path pairs, comma-separated, run in turn")
    parser.add_argument("--tokens", default="7005,14010")
    parser.add_argument("--device", default="auto", help="auto (cuda where there is one), cuda or cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokens = [int(count) for count in args.tokens.split(",")]
    if args.measure is not None:  # one count, printed
        print(json.dumps(measure(args.measure, args.device, args.repeats)))
        return
    if args.worker:  # one tree, in a process of its own
        import torch

        device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        name = args.worker.partition("=")[0]
        rows = [{"tree": name, **row} for row in worker(tokens, device, args.repeats)]
        Path(args.out).write_text(json.dumps(rows))
        return
    from bench import run_trees, write_results

    def done(per_tree: list) -> None:  # a tree's rows, or its failure
        rows = [row for result in per_tree for row in (result if isinstance(result, list) else [result])]
        write_results(args.out, rows, trees=args.trees)
        for row in rows[-len(tokens):]:
            print(row, flush=True)

    run_trees(__file__, args.trees, args.out, done)


if __name__ == "__main__":
    main()
