"""Zero-shot top-1 on the embedded digits' held-out split from three evaluators, side by side:
megabatch's own evaluation of a checkpoint, open_clip's of its export, CLIP_benchmark's of its export.

    python scripts/export.py ckpt=runs/<name>/checkpoints/last.pt out=exports/<name>
    python scripts/compare_export.py ckpt=runs/<name>/checkpoints/last.pt export=exports/<name>

Writes ``<export>/agreement.json``. CLIP_benchmark is optional (pip install --no-deps clip-benchmark).
"""

import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    args = dict(arg.partition("=")[::2] for arg in argv)
    if set(args) != {"ckpt", "export"}:
        print("usage: python scripts/compare_export.py ckpt=<checkpoint .pt> export=<folder written by export.py>",
              file=sys.stderr)
        sys.exit(2)
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit
    from megabatch.config.compose import compose
    from megabatch.eval import agreement
    from megabatch.eval.evaluate import evaluate_checkpoint

    cache = os.path.expanduser(os.environ.get("MEGABATCH_CACHE", "~/.cache/megabatch"))
    export = Path(args["export"]).resolve()
    if not (export / "open_clip_config.json").is_file():
        raise config_error_exit(ConfigError(f"export={export} holds no open_clip_config.json: write it first with "
                                            "python scripts/export.py ckpt=<checkpoint> out=<folder>"))
    try:
        ours = evaluate_checkpoint(compose(f"ckpt={args['ckpt']}", config_name="evaluate"))["digits"]["top1"]
    except ConfigError as error:
        raise config_error_exit(error) from None
    result = {"ckpt": args["ckpt"], "export": str(export), "megabatch_top1": ours,
              "open_clip_top1": agreement.open_clip_top1(export, cache)}
    if importlib.util.find_spec("clip_benchmark") is not None:
        with tempfile.TemporaryDirectory() as tmp:
            root = agreement.digits_for_clip_benchmark(cache, Path(tmp) / "digits")
            result["clip_benchmark_top1"] = agreement.clip_benchmark_top1(export, root, Path(tmp) / "out.json")
    (export / "agreement.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    tops = {round(v, 6) for k, v in result.items() if k.endswith("_top1")}  # 100 x 37 / 360 rounds two ways
    print("the same top-1 from every evaluator" if len(tops) == 1 else "the evaluators DISAGREE", flush=True)
    sys.exit(0 if len(tops) == 1 else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
