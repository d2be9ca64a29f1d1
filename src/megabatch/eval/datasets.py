"""Evaluation sets: where the images are, their class names and prompt templates.

Class names and templates are named sets (``digits``; ``imagenet`` with the ``openai`` 80-prompt
and ``simple`` 7-prompt ensembles, taken from open_clip's package data, so nothing is downloaded)
or explicit lists in the config. Images come from webdataset shards (``format: wds``: ``cls`` or
``json.label`` + image), an ImageFolder (``format: folder``: ``root/<class folder>/*``, class
index = sorted folder order, as ImageNet's wnids) or an ObjectNet release (``format: objectnet``:
its 113 ImageNet-overlapping classes, named by their ObjectNet labels) or a CLIP_benchmark dataset folder
(``format: clip_benchmark``: its shards, class names and templates, ``eval/clip_benchmark.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence

from torch.utils.data import Dataset, IterableDataset

from ..config import ConfigError
from ..config.schema import embedded_digits, eval_root

log = logging.getLogger(__name__)


def _imagenet():
    from open_clip import zero_shot_metadata

    return zero_shot_metadata


def _wnids(source: str) -> list[str]:
    """ImageNet wnids in class-index order: the sorted class folders of an ImageNet train/val
    folder, or the lines of a text file (1000 wnids, in order)."""
    import os

    path = os.path.expanduser(str(source))
    if os.path.isdir(path):
        return sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    if os.path.isfile(path):
        return [line.strip() for line in open(path) if line.strip()]
    raise ConfigError(f"subset_wnids_from={source!r}: neither an ImageNet folder nor a wnid list")


def subset_indices(eval_cfg) -> list[int] | None:
    """For sets over a subset of ImageNet's classes (ImageNet-R: 200 wnid folders): the ImageNet
    class index of each of ``eval.root``'s class folders (sorted), from ``eval.subset_wnids_from``."""
    source = eval_cfg.subset_wnids_from
    if not source:
        return None
    full = _wnids(source)
    if len(full) != 1000:
        raise ConfigError(f"eval.{eval_cfg.name}.subset_wnids_from={source!r} lists {len(full)} wnids, "
                          "not ImageNet's 1000")
    mine = _wnids(eval_cfg.root)
    unknown = [w for w in mine if w not in full]
    if unknown:
        raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r}: class folders {unknown[:3]}... are not "
                          "ImageNet wnids")
    return [full.index(w) for w in mine]


def objectnet_classes(root: str) -> list[tuple[str, str]]:
    """``(folder, ObjectNet label)`` of the ObjectNet classes that overlap ImageNet-1k (113 in the
    release), sorted by label: the class order of ``format: objectnet``.

    Read from the release's ``mappings/folder_to_objectnet_label.json`` (folder -> label) and
    ``mappings/objectnet_to_imagenet_1k.json`` (label -> ImageNet classes; only its keys are used).
    """
    import json
    import os

    root = os.path.expanduser(str(root))
    files = [os.path.join(root, "mappings", name)
             for name in ("folder_to_objectnet_label.json", "objectnet_to_imagenet_1k.json")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ConfigError(f"eval.root={root!r} is not an ObjectNet release folder: {missing[0]} is missing "
                          "(eval.root must hold images/ and mappings/)")
    folder_to_label = json.load(open(files[0]))
    overlapping = set(json.load(open(files[1])))
    classes = sorted(((folder, label) for folder, label in folder_to_label.items() if label in overlapping),
                     key=lambda pair: pair[1])
    if not classes:
        raise ConfigError(f"eval.root={root!r}: no ObjectNet folder maps to an ImageNet class")
    return classes


def classnames(eval_cfg) -> list[str]:
    if eval_cfg.format == "objectnet":  # the overlapping ObjectNet labels themselves
        return [label for _, label in objectnet_classes(eval_root(eval_cfg))]
    if eval_cfg.format == "clip_benchmark" and not eval_cfg.classnames:  # its classnames.txt
        from . import clip_benchmark

        return clip_benchmark.classnames(eval_cfg)
    names = _named_classnames(eval_cfg)
    subset = subset_indices(eval_cfg)
    return names if subset is None else [names[i] for i in subset]


def _named_set(eval_cfg, key: str, sets: dict) -> list[str]:
    """``eval.<key>``: an explicit list, or the name of one of ``sets`` (name -> loader)."""
    value = getattr(eval_cfg, key) or eval_cfg.name
    if not isinstance(value, str):
        return list(value)
    if value not in sets:
        raise ConfigError(f"eval.{eval_cfg.name}.{key}={value!r}: use one of {sorted(sets)} or a list")
    return list(sets[value]())


def _digits(attribute: str):
    from ..data import digits

    return getattr(digits, attribute)


def _named_classnames(eval_cfg) -> list[str]:
    return _named_set(eval_cfg, "classnames", {
        "digits": lambda: _digits("CLASS_NAMES"),
        "imagenet": lambda: _imagenet().IMAGENET_CLASSNAMES,
    })


def templates(eval_cfg) -> list[str]:
    """Prompt templates with ``{}`` for the class name (open_clip's are callables: rendered)."""
    if eval_cfg.format == "clip_benchmark" and not eval_cfg.templates:  # its zeroshot_classification_templates.txt
        from . import clip_benchmark

        return clip_benchmark.templates(eval_cfg)
    openai = lambda: [t("{}") for t in _imagenet().OPENAI_IMAGENET_TEMPLATES]  # noqa: E731
    return _named_set(eval_cfg, "templates", {
        "digits": lambda: _digits("EVAL_TEMPLATES"),
        "openai": openai,
        "imagenet": openai,
        "simple": lambda: [t("{}") for t in _imagenet().SIMPLE_IMAGENET_TEMPLATES],
    })


def eval_batches(eval_cfg, data_cfg, transform, num_classes: int, ranks=None, split: str | None = None) -> Iterator:
    """``(images [n, 3, s, s], (labels [n], indices [n]))`` batches of the evaluation set (``labels [n, classes]``
    of a multi-label set; ``indices``: each image's place in the set): with several ``ranks``, this rank's every
    world-th image, decoded by ``eval.<name>.num_workers`` loader workers. ``split``: another split of a
    CLIP_benchmark folder (the linear probe's ``train``) than ``eval.<name>.split``."""
    from ..data.urls import expand_urls
    from .ranks import Ranks

    ranks = ranks or Ranks()
    batch_size = eval_cfg.batch_size
    if eval_cfg.format == "objectnet":
        return _objectnet_batches(eval_cfg, transform, batch_size, ranks)
    if eval_cfg.format == "clip_benchmark":
        from . import clip_benchmark

        clip_benchmark.check_task(eval_cfg)
        return labelled_images(clip_benchmark.shard_urls(eval_cfg, split), transform, batch_size, ranks,
                               multilabel=clip_benchmark.dataset_type(eval_cfg) == "multilabel",
                               workers=eval_cfg.num_workers)
    if eval_cfg.format == "folder":
        from torchvision.datasets import ImageFolder

        root = eval_root(eval_cfg) if split is None else os.path.join(eval_root(eval_cfg), split)
        class NumericAwareFolder(ImageFolder):
            """ImageNet-V2 names its class folders 0..999: order those by number, not as text."""

            def find_classes(self, directory):
                classes, _ = super().find_classes(directory)
                if all(c.isdigit() for c in classes):
                    classes = sorted(classes, key=int)
                return classes, {c: i for i, c in enumerate(classes)}

        try:
            dataset = NumericAwareFolder(str(root), transform=transform)
        except (FileNotFoundError, OSError) as error:
            raise ConfigError(f"eval.{eval_cfg.name}.root={root!r}: not a readable ImageFolder ({error})") from error
        if num_classes and len(dataset.classes) != num_classes:
            raise ConfigError(
                f"eval.{eval_cfg.name}.root={root!r} has {len(dataset.classes)} class folders but the class names "
                f"has {num_classes} names; they must match one to one (sorted folder order)"
            )
        return _indexed(dataset, ranks, batch_size, eval_cfg.num_workers)
    urls = eval_cfg.urls if split is None else getattr(eval_cfg, f"{split}_urls", None)
    if not urls and embedded_digits(eval_cfg):
        from ..data.digits import ensure_digits

        urls = ensure_digits(data_cfg.cache_dir)["test" if split is None else split]
    key = f"eval.{eval_cfg.name}.{'urls' if split is None else split + '_urls'}"
    if not urls:
        raise ConfigError(f"{key} is not set for eval={eval_cfg.name} (shards with cls + image)")
    return labelled_images(expand_urls(urls, key), transform, batch_size, ranks, workers=eval_cfg.num_workers)


def _indexed(dataset, ranks, batch_size: int, workers: int) -> Iterator:
    """A map-style set's batches of this rank's every world-th item, with each item's index."""
    import torch
    from torch.utils.data import DataLoader, Subset

    indices = range(ranks.rank, len(dataset), ranks.world)
    workers = _capped(workers)
    loader = DataLoader(Subset(dataset, indices), batch_size=batch_size, num_workers=workers,
                        multiprocessing_context=_forked(workers))
    for number, (images, labels) in enumerate(loader):  # a map-style loader keeps the order
        yield images, (labels, torch.tensor(indices[number * batch_size:number * batch_size + len(labels)]))


def labelled_images(urls: list[str], transform, batch_size: int, ranks=None, multilabel: bool = False,
                    workers: int = 0, labelled: bool = True) -> Iterator:
    """Evaluation batches ``(images [n, 3, s, s], (labels [n], indices [n]))`` from shards whose ``json`` (or
    ``cls``) holds the class index (``multilabel``: whose ``npy`` holds a 0/1 vector over the classes, as
    CLIP_benchmark's multi-label sets); ``indices``: each sample's place in the shards. With several ``ranks``,
    this rank's every world-th sample; ``workers`` loader processes decode every workers-th of those each (the
    others' samples are read past, not decoded), so batches come in the workers' turn: ``Ranks.in_order`` puts
    rows back in the set's order. Corrupt images are skipped and counted, as are samples without a label
    (``labelled=False``: every label 0, for a retrieval set's images)."""
    from torch.utils.data import DataLoader

    from .ranks import Ranks

    ranks = ranks or Ranks()
    dataset = _LabelledShards(urls, transform, ranks.rank, ranks.world, multilabel, labelled)
    workers = _capped(workers)
    for images, labels, indices in DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                              collate_fn=_collate, multiprocessing_context=_forked(workers)):
        yield images, (labels, indices)


def mapped_images(items: Sequence, load: Callable, batch_size: int, workers: int = 0) -> Iterator:
    """Batches of ``load(item)`` (image tensors) over ``items``, in their order, made by ``workers`` forked loader
    processes (image files of a retrieval or selection set: opened and transformed beside the GPU's work)."""
    from torch.utils.data import DataLoader

    workers = _capped(workers)
    yield from DataLoader(_Mapped(items, load), batch_size=batch_size, num_workers=workers,
                          multiprocessing_context=_forked(workers))


class _Mapped(Dataset):
    def __init__(self, items: Sequence, load: Callable):
        self.items, self.load = items, load

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.load(self.items[index])


def _capped(workers: int) -> int:
    """No more loader workers than this process may run on (2 on a 2-core machine, whatever the set asks)."""
    return min(workers, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _forked(workers: int):
    """Evaluation's loader workers are forked from this process, whatever started it: a process started by a
    fork server (a rank of a test, say) would start each worker through that server, importing torch again
    (seconds a worker, for every set)."""
    import multiprocessing

    return multiprocessing.get_context("fork") if workers > 0 else None


def _collate(rows: list) -> tuple:
    import torch

    images, labels, indices = zip(*rows, strict=True)
    stacked = torch.stack(labels) if isinstance(labels[0], torch.Tensor) else torch.tensor(labels)
    return torch.stack(images), stacked, torch.tensor(indices)


class _LabelledShards(IterableDataset):
    """``(image, label, index)`` of one rank's samples of ``urls``, split again over the loader's workers."""

    def __init__(self, urls, transform, rank: int, world: int, multilabel: bool, labelled: bool = True):
        self.urls, self.transform, self.rank, self.world, self.multilabel = urls, transform, rank, world, multilabel
        self.labelled = labelled

    def __iter__(self):
        import io
        import json

        import numpy as np
        import torch
        import webdataset as wds
        from torch.utils.data import get_worker_info

        from ..data.samples import Stats, decode_pair

        worker = get_worker_info()
        workers, number = (worker.num_workers, worker.id) if worker else (1, 0)
        stride, mine = self.world * workers, self.rank + self.world * number
        stats, unlabelled, multilabel, urls = Stats(), 0, self.multilabel, self.urls
        for index, raw in enumerate(wds.tarfile_to_samples(handler=wds.warn_and_continue)(iter([{"url": u}
                                                                                                 for u in urls]))):
            if index % stride != mine:
                continue
            try:
                if not self.labelled:
                    label = 0
                elif multilabel:
                    label = torch.from_numpy(np.load(io.BytesIO(raw["npy"])).astype(np.float32).reshape(-1))
                elif "cls" in raw:
                    label = int(raw["cls"])
                else:
                    label = int(json.loads(raw["json"])["label"])
            except (KeyError, ValueError):
                unlabelled += 1
                continue
            raw.setdefault("txt", b"")
            pair = decode_pair(raw, stats)
            if pair is None:
                continue
            yield self.transform(pair[1]), label, index
        if stats.corrupt_image or unlabelled:
            log.warning("skipped %d corrupt images and %d samples without a label (%s) in %s ...",
                        stats.corrupt_image, unlabelled, "npy" if multilabel else "cls or json label", urls[0])


def _objectnet_image(path: str):
    """ObjectNet images carry a 1-pixel red border: open, convert, crop it off."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
    return image.crop((1, 1, image.width - 1, image.height - 1))


def _objectnet_batches(eval_cfg, transform, batch_size: int, ranks) -> Iterator:
    """Images of the ImageNet-overlapping ObjectNet classes, labelled in ``objectnet_classes``
    order; the other classes' folders are not read."""
    import os

    from torchvision.datasets import ImageFolder

    root = eval_root(eval_cfg)
    classes = objectnet_classes(root)
    images = os.path.join(os.path.expanduser(str(root)), "images")

    class ObjectNetFolder(ImageFolder):
        def find_classes(self, directory):
            present = [folder for folder, _ in classes if os.path.isdir(os.path.join(directory, folder))]
            if len(present) != len(classes):
                raise ConfigError(f"eval.{eval_cfg.name}.root={eval_cfg.root!r}: "
                                  f"{len(classes) - len(present)} mapped class "
                                  "folders are missing under images/")
            return present, {folder: index for index, folder in enumerate(present)}

    dataset = ObjectNetFolder(images, transform=transform, loader=_objectnet_image)
    return _indexed(dataset, ranks, batch_size, eval_cfg.num_workers)


def resolve_eval_set(eval_cfg) -> tuple[list[str], list[str]]:
    """``(class names, templates)`` of ``eval_cfg``, checked before any image is encoded: both given, each
    template with a place for the class name, and a CLIP_benchmark folder's own class list as long as the
    names in use (its labels index its ``classnames.txt``)."""
    key = f"eval.{eval_cfg.name}"
    names, prompts = classnames(eval_cfg), templates(eval_cfg)
    if not names or not prompts:
        raise ConfigError(f"eval={eval_cfg.name} needs class names and templates")
    unplaced = [prompt for prompt in prompts if "{}" not in prompt]
    if unplaced:
        raise ConfigError(f"{key}.templates: {unplaced[0]!r} has no {{}} (or {{c}}) where the class name goes; every "
                          "template needs one, e.g. 'a photo of a {}.'")
    if eval_cfg.format == "clip_benchmark" and eval_cfg.classnames:
        from . import clip_benchmark

        own = clip_benchmark.classnames(eval_cfg) if clip_benchmark.has_file(eval_cfg, "classnames.txt") else None
        if own is not None and len(own) != len(names):
            raise ConfigError(f"{key}.classnames={_shown(eval_cfg.classnames)} gives {len(names)} class names but the "
                              f"folder's classnames.txt has {len(own)}, and its labels index that list: set "
                              f"{key}.classnames=null (and {key}.templates=null) to use the folder's")
    return names, prompts


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else f"[{len(value)} names]"


def labels_within(batches: Iterator, num_classes: int, eval_cfg) -> Iterator:
    """``batches`` as they come, each batch's labels checked against the ``num_classes`` class names in use
    before it is encoded: a label outside them (shards labelled for another class list) would count as a
    miss, a silent wrong accuracy; a multi-label vector must have one entry a class."""
    key = f"eval.{eval_cfg.name}"
    for images, (labels, indices) in batches:
        if labels.dim() == 2:
            if labels.shape[1] != num_classes:
                raise ConfigError(f"{key}: the samples' label vectors have {labels.shape[1]} entries but "
                                  f"{num_classes} class names are in use: give the set's own class names "
                                  f"({key}.classnames)")
        elif len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):  # CPU tensors: no sync
            bad = int(labels.max()) if int(labels.max()) >= num_classes else int(labels.min())
            raise ConfigError(f"{key}: a sample's label {bad} is outside the {num_classes} class names in use "
                              f"({key}.classnames={_shown(eval_cfg.classnames or eval_cfg.name)}): the labels "
                              f"index another class list; use the set's own (for a CLIP_benchmark folder "
                              f"{key}.classnames=null), or shards labelled 0..{num_classes - 1}")
        yield images, (labels, indices)
