"""CLIP_benchmark's datasets as users download them (``eval.<name>.format=clip_benchmark``,
``eval.<name>.root=<the dataset's folder>``): its webdataset layout, read as it is.

    <root>/test/nshards.txt                          the number of shards of the split
    <root>/test/0.tar, 1.tar, ...                    an image (webp, png, jpg) and its ``cls`` (classification)
                                                     or its ``txt`` (retrieval: one caption a line)
    <root>/classnames.txt                            one class name a line (classification)
    <root>/zeroshot_classification_templates.txt     one prompt a line, ``{c}`` for the class name
    <root>/dataset_type.txt                          optional: ``retrieval`` or ``multilabel`` (else
                                                     classification); a multi-label sample's ``npy`` holds a
                                                     0/1 vector over the classes (scored by mAP)
    <root>/train/..., <root>/val/...                 the linear probe's training and validation splits

The split is ``eval.<name>.split`` (``test``). A file the set needs and does not have is a config error naming
``eval.<name>.root`` and the file.
"""

from __future__ import annotations

import os

from ..config import ConfigError


def _root(eval_cfg) -> str:
    from ..config.schema import eval_root

    root = os.path.expanduser(str(eval_root(eval_cfg)))
    if not os.path.isdir(root):
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r} is not a folder (a CLIP_benchmark dataset: "
                          "test/nshards.txt, test/0.tar, ..., classnames.txt)")
    return root


def _read(eval_cfg, name: str, what: str) -> list[str]:
    path = os.path.join(_root(eval_cfg), name)
    if not os.path.isfile(path):
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r} has no {name} ({what}); a CLIP_benchmark "
                          "dataset holds test/nshards.txt, test/<i>.tar, classnames.txt and "
                          "zeroshot_classification_templates.txt")
    with open(path) as handle:
        return [line.strip() for line in handle.read().splitlines() if line.strip()]


def dataset_type(eval_cfg) -> str:
    """``classification``, ``retrieval`` or ``multilabel``: the set's ``dataset_type.txt``, else classification."""
    path = os.path.join(_root(eval_cfg), "dataset_type.txt")
    return open(path).read().strip().lower() if os.path.isfile(path) else "classification"


def check_task(eval_cfg) -> None:
    """The set's type and ``eval.<name>.task`` agree."""
    kind = dataset_type(eval_cfg)
    wanted = "retrieval" if kind == "retrieval" else "zeroshot"
    probes = ("linear_probe", "dense_probe")
    if eval_cfg.task not in (wanted, *(("captioning",) if kind == "retrieval" else probes)):
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r} is a {kind} set (its dataset_type.txt): "
                          f"set eval.{eval_cfg.name}.task={wanted}")
    if kind == "multilabel" and eval_cfg.task in probes:
        what = eval_cfg.task.replace("_", " ")  # the linear probe, the dense probe
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r} is a multilabel set: the {what} takes "
                          f"one class an image; set eval.{eval_cfg.name}.task=zeroshot (mean average precision)")


def classnames(eval_cfg) -> list[str]:
    return _read(eval_cfg, "classnames.txt", "one class name a line")


def templates(eval_cfg) -> list[str]:
    """The prompts with ``{}`` for the class name (CLIP_benchmark writes ``{c}``)."""
    return [t.replace("{c}", "{}") for t in
            _read(eval_cfg, "zeroshot_classification_templates.txt", "one prompt a line, {c} for the class name")]


def has_file(eval_cfg, name: str) -> bool:
    return os.path.isfile(os.path.join(_root(eval_cfg), name))


def has_split(eval_cfg, split: str) -> bool:
    return os.path.isfile(os.path.join(_root(eval_cfg), split, "nshards.txt"))


def shard_urls(eval_cfg, split: str | None = None) -> list[str]:
    """The split's shards, ``<root>/<split>/0.tar`` to ``<n - 1>.tar`` (``nshards.txt``: n); ``split``:
    ``eval.<name>.split`` unless given."""
    split = split or eval_cfg.split or "test"
    lines = _read(eval_cfg, os.path.join(split, "nshards.txt"), f"the number of the {split} split's shards")
    try:
        count = int(lines[0])
    except (IndexError, ValueError):
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r}: {split}/nshards.txt holds {lines[:1]}, "
                          "not a number of shards") from None
    root = _root(eval_cfg)
    urls = [os.path.join(root, split, f"{index}.tar") for index in range(count)]
    missing = [url for url in urls if not os.path.isfile(url)]
    if missing:
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r}: {split}/nshards.txt says {count} shards "
                          f"but {missing[0]} is missing")
    return urls


def write_folder(root, split: str, samples: list[dict], per_shard: int = 1000, **files: str) -> None:
    """The layout above, written: ``samples`` (``{"png": bytes, "cls" or "txt" or "npy": ...}``, a value that is
    not bytes written as its text) in shards of ``per_shard`` under ``root/split``, and ``files`` as
    ``root/<name>.txt`` (``classnames``, ``zeroshot_classification_templates``, ``dataset_type``). The tests and
    ``scripts/benchmarks/eval_suite.py`` make their sets with it."""
    import io
    import tarfile
    from pathlib import Path

    folder = Path(root) / split
    folder.mkdir(parents=True, exist_ok=True)
    shards = [samples[i:i + per_shard] for i in range(0, len(samples), per_shard)]
    for index, shard in enumerate(shards):
        with tarfile.open(folder / f"{index}.tar", "w") as tar:
            for number, sample in enumerate(shard):
                for ext, value in sample.items():
                    data = value if isinstance(value, bytes) else str(value).encode()
                    info = tarfile.TarInfo(f"{index:04d}{number:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (folder / "nshards.txt").write_text(f"{len(shards)}\n")
    for name, text in files.items():
        (Path(root) / f"{name}.txt").write_text(text)
