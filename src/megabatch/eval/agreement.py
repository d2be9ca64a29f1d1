"""Does an export score what megabatch scored? Zero-shot top-1 on the embedded digits' held-out split
from three evaluators: megabatch's own (on the checkpoint), open_clip's (its loader, transform,
tokenizer and ``build_zero_shot_classifier`` on the export) and CLIP_benchmark's command line (on the
export, the digits written in its webdataset layout). ``scripts/compare_export.py`` prints them.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import types
from pathlib import Path

import torch


def digits_test_set(cache_dir: str | Path) -> list[tuple[bytes, int]]:
    """The held-out digits as ``(png bytes, label)``, in shard order."""
    from ..data.digits import ensure_digits

    members: dict[str, dict[str, bytes]] = {}
    with tarfile.open(ensure_digits(cache_dir)["test"]) as source:
        for member in source.getmembers():
            key, _, ext = member.name.partition(".")
            members.setdefault(key, {})[ext] = source.extractfile(member).read()
    return [(parts["png"], int(json.loads(parts["json"])["label"])) for _, parts in sorted(members.items())]


def digits_for_clip_benchmark(cache_dir: str | Path, root: Path) -> Path:
    """The held-out digits in CLIP_benchmark's webdataset layout under ``root`` (``test/0.tar`` of
    ``png`` + ``cls``, ``test/nshards.txt``, ``classnames.txt``, ``zeroshot_classification_templates.txt``
    with the same prompts megabatch uses)."""
    from ..data.digits import CLASS_NAMES, EVAL_TEMPLATES

    (root / "test").mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / "test" / "0.tar", "w") as shard:
        for index, (png, label) in enumerate(digits_test_set(cache_dir)):
            for ext, payload in (("png", png), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{index:09d}.{ext}")
                info.size = len(payload)
                shard.addfile(info, io.BytesIO(payload))
    (root / "test" / "nshards.txt").write_text("1")
    (root / "classnames.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    templates = [template.replace("{}", "{c}") for template in EVAL_TEMPLATES]
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    return root


@torch.no_grad()
def open_clip_top1(export: Path, cache_dir: str | Path) -> float:
    """Zero-shot top-1 (%) of ``export`` on the held-out digits, evaluated by open_clip alone."""
    import open_clip
    from open_clip.zero_shot_classifier import build_zero_shot_classifier
    from PIL import Image

    from ..data.digits import CLASS_NAMES, EVAL_TEMPLATES

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    model.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{export}")
    classifier = build_zero_shot_classifier(model, tokenizer, CLASS_NAMES, EVAL_TEMPLATES)
    test_set = digits_test_set(cache_dir)
    images = torch.stack([preprocess(Image.open(io.BytesIO(png))) for png, _ in test_set])
    labels = torch.tensor([label for _, label in test_set])
    predictions = (model.encode_image(images, normalize=True) @ classifier).argmax(dim=1)
    return 100.0 * int((predictions == labels).sum()) / len(labels)


def clip_benchmark_top1(export: Path, dataset_root: Path, output: Path) -> float:
    """Zero-shot top-1 (%) of ``export`` from ``clip_benchmark eval`` (its command line, run in this
    process, fp32, on CUDA when there is one) on a ``digits_for_clip_benchmark`` folder. Two things
    around it, neither on the zero-shot path: its captioning metrics' dependency (pycocoevalcap,
    100 MB, unused here) is stubbed when missing, and its ``accuracy`` helper, which calls ``float()``
    on a one-element array (an error since numpy 2.3), counts the same hits with ``.item()``."""
    from clip_benchmark.metrics import zeroshot_classification

    stubbed = _stub_pycocoevalcap()
    original_accuracy, argv = zeroshot_classification.accuracy, sys.argv

    def accuracy(logits, target, topk=(1,)):
        predictions = logits.topk(max(topk), 1, True, True)[1].t()
        correct = predictions.eq(target.view(1, -1).expand_as(predictions))
        return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]

    zeroshot_classification.accuracy = accuracy
    try:
        from clip_benchmark import cli

        sys.argv = ["clip_benchmark", "eval", "--model_type", "open_clip", "--model", f"local-dir:{export}",
                    "--pretrained", "none", "--dataset", "wds/digits", "--dataset_root", str(dataset_root),
                    "--task", "zeroshot_classification", "--no_amp", "--num_workers", "0",
                    "--batch_size", "128", "--output", str(output)]
        cli.main()
    finally:
        sys.argv = argv
        zeroshot_classification.accuracy = original_accuracy
        for name in stubbed:
            sys.modules.pop(name, None)
    return 100.0 * json.loads(Path(output).read_text())["metrics"]["acc1"]


def _stub_pycocoevalcap() -> list[str]:
    """Empty stand-ins for the pycocoevalcap modules CLIP_benchmark's CLI imports at start-up (its
    captioning task only), where the package is not installed; returns the names added."""
    try:
        import pycocoevalcap  # noqa: F401
        return []
    except ImportError:
        pass
    classes = {"tokenizer.ptbtokenizer": "PTBTokenizer", "bleu.bleu": "Bleu", "meteor.meteor": "Meteor",
               "rouge.rouge": "Rouge", "cider.cider": "Cider", "spice.spice": "Spice"}
    added = []
    for module, attribute in classes.items():
        parts = ["pycocoevalcap", *module.split(".")]
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            if name not in sys.modules:
                sys.modules[name] = types.ModuleType(name)
                added.append(name)
        setattr(sys.modules[".".join(parts)], attribute, None)
    return added
