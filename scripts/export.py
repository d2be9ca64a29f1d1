"""Export a checkpoint as an open_clip model folder (``open_clip_model.safetensors`` +
``open_clip_config.json``, and a Hugging Face text tower's config and tokenizer), loadable by
open_clip and what builds on it (CLIP_benchmark):

    python scripts/export.py ckpt=runs/b32-1M/checkpoints/last.pt out=exports/b32-1M
    python -c "import open_clip; m, _, t = open_clip.create_model_and_transforms('local-dir:exports/b32-1M')"

Options (key=value): ckpt (required), out (required), overwrite=false (replace an export in out),
check=true (load the export back with open_clip and compare its embeddings with megabatch's),
weights=raw (the weights as trained) or ema (their moving average, from a run with ``ema.decay``),
license= and datasets= (the model card's metadata: an SPDX id such as mit; Hub dataset names, comma-separated),
push=<org/name> (upload the folder to the Hugging Face Hub as a model repository; needs a token, from
``huggingface-cli login`` or HF_TOKEN, checked before anything is written), decoder=false (true: keep
``model.decoder``'s caption decoder beside the CLIP, ``megabatch_decoder.safetensors``, which open_clip ignores and
``model=openclip model.pretrained=<out>`` rebuilds).

Every export holds a model card, ``README.md`` (``models/card.py``): the Hub's metadata, the architecture, the
training data, batch, steps, samples seen and objectives, the checkpoint's results table where there is one, and
how to load it.
"""

import json
import logging
import sys
from pathlib import Path

OPTIONS = {"ckpt": None, "out": None, "overwrite": "false", "check": "true", "weights": "raw", "license": "",
           "datasets": "", "push": "", "decoder": "false"}


def parse(argv: list[str]) -> dict[str, str]:
    """``key=value`` arguments (as scripts/evaluate.py takes them); unknown or missing keys exit 2."""
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit, key_values

    try:
        values = key_values(argv, OPTIONS, "ckpt=runs/<name>/checkpoints/last.pt out=exports/<name>",
                            "scripts/export.py")
        for key in ("overwrite", "check", "decoder"):
            if values[key].lower() not in ("true", "false"):
                raise ConfigError(f"{key}={values[key]!r}: use true or false")
        if values["weights"] not in ("raw", "ema"):
            raise ConfigError(f"weights={values['weights']!r}: use raw (the weights as trained) or ema (their moving "
                              "average, from a run with ema.decay)")
        if values["push"] and (values["push"].count("/") != 1 or not all(values["push"].split("/"))):
            raise ConfigError(f"push={values['push']!r}: give the Hub repository as <org or user>/<name>, "
                              "e.g. push=my-lab/vit-b32-megabatch")
    except ConfigError as error:  # one line, status 2, as the other entry points
        raise config_error_exit(error) from None
    return values


def hub_token() -> str:
    """The Hugging Face token ``push=`` uploads with; a ``ConfigError`` (before anything is written) without one."""
    from huggingface_hub import get_token

    from megabatch.config import ConfigError

    token = get_token()
    if not token:
        raise ConfigError("push=... needs a Hugging Face token: run `huggingface-cli login` (or set HF_TOKEN), then "
                          "export again; nothing was uploaded")
    return token


def push(out: Path, repo_id: str, token: str) -> str:
    """Upload the export folder ``out`` to the Hub model repository ``repo_id`` (created if missing)."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=str(out), repo_id=repo_id, repo_type="model",
                      commit_message="megabatch export (scripts/export.py)")
    return f"https://huggingface.co/{repo_id}"


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    logging.getLogger("megabatch").setLevel(logging.INFO)  # open_clip logs its loading at INFO: quiet
    args = parse(argv)
    from megabatch.checkpoint.files import load_checkpoint
    from megabatch.checkpoint.model import model_from_checkpoint
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit
    from megabatch.models.card import write_model_card
    from megabatch.models.export import check_export, export_open_clip

    try:
        token = hub_token() if args["push"] else None  # before anything is written, here or on the Hub
        state = load_checkpoint(args["ckpt"])
        model = model_from_checkpoint(state, args["weights"])
        out = export_open_clip(model, Path(args["out"]), overwrite=args["overwrite"].lower() == "true",
                               decoder=args["decoder"].lower() == "true",
                               extra={"ckpt": str(Path(args["ckpt"]).resolve()), "step": int(state["step"]),
                                      "name": model.name, "arch": model.arch, "weights": args["weights"]})
        datasets = tuple(name.strip() for name in args["datasets"].split(",") if name.strip())
        write_model_card(out, model, state, Path(args["ckpt"]), repo_id=args["push"] or None,
                         license=args["license"] or None, datasets=datasets)
    except ConfigError as error:
        raise config_error_exit(error) from None
    print(f"exported {args['ckpt']} (step {state['step']}, {args['weights']} weights) -> {out}: "
          f"open_clip.create_model_and_transforms('local-dir:{out}'), open_clip.get_tokenizer('local-dir:{out}')",
          flush=True)
    if args["check"].lower() == "true":
        error = check_export(model, out)
        print(f"open_clip loads it back: embeddings within {error:.1e} (relative) of megabatch's", flush=True)
        if error > 1e-4:
            sys.exit(f"the export does not reproduce the model (relative difference {error:.1e}); please report")
    if args["push"]:
        print(f"uploaded {out} -> {push(out, args['push'], token)}", flush=True)
    pushed = {"pushed": args["push"]} if args["push"] else {}
    print(json.dumps({"out": str(out), "step": int(state["step"]), **pushed}))


if __name__ == "__main__":
    main(sys.argv[1:])
