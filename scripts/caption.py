"""Caption images with a trained CoCa (a checkpoint of a model with a caption decoder, ``loss.caption_weight``):
beam search, or top-k / top-p sampling (``megabatch/models/generate.py``: open_clip 3.3's own ``generate`` needs a
transformers older than ours) on every image of a folder or of shards,
one JSON line per image: ``{"image": <path or shard key>, "caption": <text>}``.

    python scripts/caption.py ckpt=runs/coca/checkpoints/last.pt images=photos/ out=captions.jsonl
    python scripts/caption.py ckpt=runs/coca/checkpoints/last.pt images='/data/val/{00000..00009}.tar' generation=top_p

Options (key=value): ckpt (required), images (required: a folder, searched recursively, or a shard pattern),
out=captions.jsonl, generation=beam_search|top_k|top_p, max_len=30 (tokens), batch=32, device=auto,
weights=raw or ema (the moving average, from a run with ``ema.decay``).
"""

import json
import logging
import sys
from pathlib import Path

OPTIONS = {"ckpt": None, "images": None, "out": "captions.jsonl", "generation": "beam_search", "max_len": "30",
           "batch": "32", "device": "auto", "weights": "raw"}
GENERATIONS = ("beam_search", "top_k", "top_p")


def parse(argv: list[str]) -> dict[str, str]:
    """``key=value`` arguments (as the other scripts take them); unknown, missing or bad values exit 2."""
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit, key_values

    try:
        values = key_values(argv, OPTIONS, "ckpt=runs/coca/checkpoints/last.pt images=photos/", "scripts/caption.py")
        if values["generation"] not in GENERATIONS:
            raise ConfigError(f"generation={values['generation']!r}: use one of {', '.join(GENERATIONS)}")
        for key in ("max_len", "batch"):
            if not values[key].isdigit() or int(values[key]) < 1:
                raise ConfigError(f"{key}={values[key]!r}: give a whole number >= 1")
        if values["weights"] not in ("raw", "ema"):
            raise ConfigError(f"weights={values['weights']!r}: use raw or ema")
    except ConfigError as error:
        raise config_error_exit(error) from None
    return values


def images_of(source: str):
    """``(name, encoded bytes)`` of every image in a folder (recursively, sorted) or in shards."""
    from megabatch.config import ConfigError
    from megabatch.data.samples import IMAGE_KEYS

    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_KEYS)
        if not files:
            raise ConfigError(f"images={source}: no image ({', '.join(IMAGE_KEYS)}) in that folder")
        for file in files:
            yield str(file), file.read_bytes()
        return
    import tarfile

    from megabatch.data.urls import expand_urls

    for url in expand_urls(source, "images"):
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                key, _, ext = Path(member.name).name.partition(".")
                if member.isfile() and ext.lower() in IMAGE_KEYS:
                    yield f"{Path(url).name}/{key}", tar.extractfile(member).read()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    args = parse(argv)
    import io

    import torch
    from PIL import Image
    from tqdm import tqdm

    from megabatch.checkpoint.files import load_checkpoint
    from megabatch.checkpoint.model import model_from_checkpoint
    from megabatch.config import ConfigError
    from megabatch.config.cli import config_error_exit
    from megabatch.data.transforms import eval_transform
    from megabatch.models.generate import caption_texts

    try:
        model = model_from_checkpoint(load_checkpoint(args["ckpt"]), args["weights"], "weights")
        if not model.has_decoder:
            raise ConfigError(f"ckpt={args['ckpt']}: model {model.name} has no caption decoder (train one: "
                              "model.decoder.layers=2 loss.caption_weight=1.0, or a CoCa: model=openclip "
                              "model.arch=coca_ViT-B-32 loss.caption_weight=2.0)")
        device = torch.device("cuda" if args["device"] == "auto" and torch.cuda.is_available()
                              else "cpu" if args["device"] == "auto" else args["device"])
        model = model.to(device).eval()
        transform, batch = eval_transform(model.preprocess), int(args["batch"])
        out, written = Path(args["out"]).expanduser(), 0
        out.parent.mkdir(parents=True, exist_ok=True)
        pending: list[tuple[str, torch.Tensor]] = []

        def flush(file) -> int:
            images = torch.stack([image for _, image in pending]).to(device)
            texts = caption_texts(model, images, method=args["generation"], max_len=int(args["max_len"]))
            for (name, _), text in zip(pending, texts, strict=True):
                file.write(json.dumps({"image": name, "caption": text}) + "\n")
            count = len(pending)
            pending.clear()
            return count

        with out.open("w") as file:
            for name, data in tqdm(images_of(args["images"]), desc="captions", unit="image"):
                try:
                    image = Image.open(io.BytesIO(data)).convert("RGB")
                except Exception as error:  # noqa: BLE001 - a corrupt image is skipped, named
                    logging.warning("skipping %s: undecodable image (%s)", name, error)
                    continue
                pending.append((name, transform(image)))
                if len(pending) == batch:
                    written += flush(file)
            if pending:
                written += flush(file)
    except ConfigError as error:
        raise config_error_exit(error) from None
    print(f"{written} captions -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
