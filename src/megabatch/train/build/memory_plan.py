"""``trainer.sub_batch=auto``: the largest sub-batch that fits the GPU, from two measurements.

The Inf-CL paper's memory model (its Eq. 10) is linear in the sub-batch: an encoder's peak memory
during one forward-backward is a constant (weights, gradients, workspaces) plus a cost per sample
(activations). ``probe_peak_memory`` measures that peak at two sizes; ``plan_sub_batch`` fits the
line through them, adds what the step holds for the whole per-rank batch (GradCache's feature
buffers and their gradients, the inputs it keeps on the device, Adam's two moments, a teacher's features) and
picks the
largest divisor of the per-rank batch whose predicted peak fits ``memory_fraction`` of the GPU.
The loss's own working memory is not in the fit (the Inf-CL and local losses' is small next to the
encoders'; a vanilla loss at a large batch needs a lower ``memory_fraction``).

A NaFlex tower trained at several sequence lengths (``data.naflex.seq_lens``) is measured at each (``LengthFits``):
the plan is then a token budget, the sub-batch at the longest length times that length, under which a step of
shorter images joins the loader's sub-batches (``BatchPlan.joined``), as ``trainer.sub_batch_tokens`` would; each
length's joined sub-batch must fit, its captions included (the text tower's cost per caption does not shrink with
the images' patches, so a short length's joined sub-batch can be what limits the budget).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import ConfigError
from ...runtime.files import replace_json
from ..step.plan import joined_sub_batches
from .cache_keys import keyed_file, library_versions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryFit:
    """``peak(rows) = fixed + per_row x rows`` (bytes), fitted through two probes; ``graph_per_row``:
    what a forward's graph holds per sample until its backward (0: not measured)."""

    fixed: float
    per_row: float
    graph_per_row: float = 0.0

    @classmethod
    def through(cls, probes: list[tuple]) -> MemoryFit:
        """The line through two ``(rows, peak bytes[, graph bytes])`` probes."""
        (rows_a, peak_a, *graph_a), (rows_b, peak_b, *graph_b) = sorted(probes)
        if rows_a == rows_b:
            raise ValueError("two probes of different sizes are needed")
        per_row = max(0.0, (peak_b - peak_a) / (rows_b - rows_a))
        graph = max(0.0, (graph_b[0] - graph_a[0]) / (rows_b - rows_a)) if graph_a and graph_b else 0.0
        return cls(peak_a - per_row * rows_a, per_row, graph)

    def peak(self, rows: int) -> float:
        return self.fixed + self.per_row * rows

    def graph_bytes(self, rows: int) -> float:
        """What a forward's graph of ``rows`` samples holds until its backward: as measured (``graph_per_row``,
        eager: more than compiled towers keep), else a whole forward-backward's cost per sample (an upper bound)."""
        return (self.graph_per_row or self.per_row) * rows


@dataclass(frozen=True)
class LengthFits:
    """A NaFlex tower's ``MemoryFit`` at each sequence length, for a per-rank batch of ``rank_batch``: a sub-batch of
    ``d`` images at the longest length sets the token budget ``d x longest``, under which each length's sub-batch
    joins the loader's as ``BatchPlan.joined`` does (``rows``). ``peak(d)``: the largest of the lengths' predicted
    peaks; ``fixed``, ``per_row`` and ``graph_per_row`` are the longest length's (the log's)."""

    fits: dict[int, MemoryFit]
    rank_batch: int

    @property
    def longest(self) -> int:
        return max(self.fits)

    def token_budget(self, sub_batch: int) -> int:
        return sub_batch * self.longest

    def rows(self, sub_batch: int) -> dict[int, int]:
        """Each length's rows a sub-batch under ``sub_batch``'s token budget."""
        return {length: sub_batch * joined_sub_batches(self.rank_batch // sub_batch, sub_batch, length,
                                                       self.token_budget(sub_batch)) for length in self.fits}

    def peak(self, sub_batch: int) -> float:
        return max(self.fits[length].peak(rows) for length, rows in self.rows(sub_batch).items())

    def graph_bytes(self, sub_batch: int) -> float:
        return max(self.fits[length].graph_bytes(rows) for length, rows in self.rows(sub_batch).items())

    @property
    def fixed(self) -> float:
        return self.fits[self.longest].fixed

    @property
    def per_row(self) -> float:
        return self.fits[self.longest].per_row

    @property
    def graph_per_row(self) -> float:
        return self.fits[self.longest].graph_per_row


@dataclass(frozen=True)
class SubBatchChoice:
    """A sub-batch, its predicted peak within the budget, the fit behind it, and ``graphs_that_fit``:
    the sub-batch graphs GradCache can keep from phase 1 to the replay in what is left of the budget
    (``trainer.keep_graph=auto``; ``graphs_in``)."""

    sub_batch: int
    predicted_bytes: float
    budget_bytes: float
    fit: MemoryFit | LengthFits
    graphs_that_fit: int = 0
    fsdp_reduce: str | None = None  # under FSDP, the reduction the plan holds memory for (step: the whole gradient)

    @property
    def token_budget(self) -> int | None:
        """A NaFlex tower's patches per sub-batch (``LengthFits``: the sub-batch at the longest length's), else
        ``None``."""
        return self.fit.token_budget(self.sub_batch) if isinstance(self.fit, LengthFits) else None


def graphs_in(room_bytes: float, fit: MemoryFit | LengthFits, sub_batch: int) -> int:
    """Kept sub-batch graphs that ``room_bytes`` holds, each ``fit.graph_bytes(sub_batch)`` (a NaFlex tower's: its
    largest joined sub-batch's)."""
    graph = fit.graph_bytes(sub_batch)
    return int(max(0.0, room_bytes) // graph) if graph > 0 else 0


def plan_sub_batch(rank_batch: int, fit: MemoryFit | LengthFits, capacity_bytes: float, memory_fraction: float,
                   batch_bytes: float = 0.0) -> SubBatchChoice:
    """The largest divisor of ``rank_batch`` whose predicted peak (``fit``, plus ``batch_bytes``
    held for the whole per-rank batch) fits ``memory_fraction x capacity_bytes`` (``LengthFits``: the divisor is
    the sub-batch at the longest length, and every length's joined sub-batch fits)."""
    budget = memory_fraction * capacity_bytes - batch_bytes
    fitting = [d for d in divisors(rank_batch) if fit.peak(d) <= budget]
    if not fitting:
        raise ConfigError(
            f"trainer.sub_batch=auto: not even one sample fits: the per-rank batch {rank_batch} holds "
            f"{batch_bytes / 1e9:.1f} GB and the model {fit.fixed / 1e9:.1f} GB, against "
            f"{memory_fraction} x {capacity_bytes / 1e9:.1f} GB (trainer.memory_fraction); use "
            "trainer.offload=true, a smaller batch, or more GPUs")
    best = max(fitting)
    predicted = fit.peak(best) + batch_bytes
    return SubBatchChoice(best, predicted, memory_fraction * capacity_bytes, fit,
                          graphs_in(memory_fraction * capacity_bytes - predicted, fit, best))


def plan_sub_batch_and_reduction(rank_batch: int, fit: MemoryFit | LengthFits, capacity_bytes: float,
                                 memory_fraction: float,
                                 batch_bytes: float, step_bytes: float,
                                 fsdp_reduce: str | None) -> tuple[SubBatchChoice, str | None]:
    """``plan_sub_batch`` under FSDP's ``trainer.fsdp_reduce`` (``None``: not sharded): ``step`` holds
    the whole gradient and the gathered weights (``step_bytes``) through the step; ``auto`` reduces once per step
    unless that would halve the sub-batch per-sub-batch reduction allows (measured on ViT-bigG-14, 4
    GPUs: reducing per sub-batch of 32, 164-197 samples/s; once per step at 128, 469-484), or nothing
    fits beside the gradient. Returns the choice and the reduction (``sub_batch`` or ``step``)."""
    choice = plan_sub_batch(rank_batch, fit, capacity_bytes, memory_fraction, batch_bytes)
    if fsdp_reduce not in ("auto", "step"):
        return choice, fsdp_reduce
    try:
        stepwise = plan_sub_batch(rank_batch, fit, capacity_bytes, memory_fraction, batch_bytes + step_bytes)
    except ConfigError:
        if fsdp_reduce == "step":
            raise
        return choice, "sub_batch"
    if fsdp_reduce == "step" or 2 * stepwise.sub_batch >= choice.sub_batch:
        return stepwise, "step"
    return choice, "sub_batch"


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def batch_bytes(rank_batch: int, embed_dim: int, feature_bytes: int, kept_input_bytes_per_row: int,
                trainable_params: int) -> float:
    """What a GradCache step holds for the whole per-rank batch besides one sub-batch's encoders:
    both towers' feature buffers (``feature_bytes`` each), the loss's fp32 copies of them and their
    fp32 gradients, the inputs kept on the device for the replay, and Adam's two fp32 moments."""
    features = rank_batch * embed_dim * 2 * (feature_bytes + 4 + 4)
    return features + rank_batch * kept_input_bytes_per_row + 2 * 4 * trainable_params


def teacher_bytes(rank_batch: int, world: int, teacher_row: int, feature_bytes: int, embed_dim: int = 0) -> float:
    """What ``distill.teacher`` adds to the per-rank batch's memory (its weights are resident when the probes
    run, so the fit counts them): the teacher's image and text features of every sample (``teacher_row``
    values each: its width, times its members for a stored ensemble) in GradCache's buffers
    (``feature_bytes``) and as the loss's fp32 copies, and on several ranks every rank's teacher text features
    gathered in fp32 for the columns, with every rank's student text features (``embed_dim`` wide) and their
    fp32 gradient (the distilled loss gathers the texts where a ring would pass them round)."""
    held = rank_batch * teacher_row * 2 * (feature_bytes + 4)
    return held + (world * rank_batch * (teacher_row * 4 + embed_dim * 8) if world > 1 else 0)


def probe_peak_memory(model, rows: int, precision, device: torch.device, caption: bool = False,
                      views: bool = False, seq_len: int | None = None) -> tuple[int, int]:
    """Peak allocated bytes of one forward-backward of ``rows`` synthetic samples
    (``ClipModel.example_inputs``) under ``precision``'s autocast, and the bytes its graph held
    between the forward and the backward; the gradients are cleared after. ``caption``: with a CoCa's
    caption loss (``loss.caption_weight``), the decoder's logits over every token included; ``views``: with
    ``self_distill``'s views of the images (the student's crops and masked view, as the late steps replay them);
    ``seq_len``: a NaFlex tower's images at that many patches (default: the longest it trains at)."""
    images, texts = model.example_inputs(rows, device, seq_len=seq_len)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with precision.autocast():
        outputs = model(images, texts, **({"caption": True} if caption else {}), **({"views": True} if views else {}))
    image_features, text_features, scale = outputs[:3]
    graph = torch.cuda.memory_allocated(device) - before
    surrogate = scale.float() + (outputs[4]["caption"] if caption else 0)
    for key, logits in (outputs[4].get("views", {}) if views else {}).items():
        if key != "positions":
            surrogate = surrogate + logits.float().sum()
    for features in (image_features, text_features):
        if features.requires_grad:
            surrogate = surrogate + features.float().sum()
    surrogate.backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    del images, texts, image_features, text_features, surrogate, outputs
    torch.cuda.empty_cache()
    return peak, graph


PROBES_FORMAT = 1  # bumped when what a probe measures, or what goes into its key, changes


class ProbeCache:
    """``trainer.sub_batch=auto``'s measured peaks kept across runs (``<data.cache_dir>/probes/``): the same command
    again (a warm start, a resume, a sweep's next job of the same model) reads them instead of running the probes'
    forward-backward passes. A file per key: the model as it is measured (the ``model``, ``loss``, ``distill`` and
    ``self_distill`` sections, the trainer's precision and parallelism, the rank and world size), the GPU and its
    memory, the torch, Triton, CUDA, open_clip and timm versions, and a digest of megabatch's own source; in the file,
    what was probed (the rows, lengths and options), checked on reading. A file that does not read is measured again;
    one that cannot be written is a warning. ``MEGABATCH_PROBE_CACHE=0``: always measure."""

    def __init__(self, locate: Callable[[], Path | None] = lambda: None):
        self._locate = locate

    @functools.cached_property
    def path(self) -> Path | None:
        """The file, or None (nothing kept): found when first asked, so a run that probes nothing (a sub-batch
        given) computes no key."""
        return self._locate()

    @classmethod
    def for_run(cls, cfg, rank: int, world_size: int, device: torch.device) -> ProbeCache:
        def locate() -> Path | None:
            if not kept_measurements(cfg, device):
                return None
            return keyed_file(cfg, "probes", probe_key(cfg, rank, world_size, device), "json")

        return cls(locate)

    def read(self, asked: dict) -> dict | None:
        """``{length: [(rows, peak, graph), ...]}`` measured for ``asked``, or None."""
        if self.path is None or not self.path.is_file():
            return None
        try:
            saved = json.loads(self.path.read_text())
            if saved.get("asked") != asked:
                return None
            return {None if length == "null" else int(length): [tuple(int(v) for v in row) for row in rows]
                    for length, rows in saved["measured"].items()}
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("trainer.sub_batch=auto: the kept probes %s could not be read (%s); measuring again",
                        self.path, error)
            return None

    def write(self, asked: dict, measured: dict) -> None:
        if self.path is None:
            return
        try:
            record = {"asked": asked, "measured": {"null" if length is None else str(length): rows
                                                   for length, rows in measured.items()}}
            # ranks and nodes sharing the cache
            replace_json(self.path, record, indent=1)
        except OSError as error:
            log.warning("trainer.sub_batch=auto: the probes could not be kept in %s (%s); the next run measures "
                        "again", self.path, error)


def kept_measurements(cfg, device: torch.device) -> bool:
    """Whether a run keeps what it measures at start-up (the probes' peaks, the FLOP count) in ``data.cache_dir``: on a
    GPU, with a cache directory, unless ``MEGABATCH_PROBE_CACHE=0``."""
    return device.type == "cuda" and bool(cfg.data.cache_dir) and os.environ.get("MEGABATCH_PROBE_CACHE", "1") != "0"


def probe_key(cfg, rank: int, world_size: int, device: torch.device) -> dict:
    """What a probe's peaks depend on (``ProbeCache``), JSON-able."""
    import open_clip
    import timm
    from omegaconf import OmegaConf

    sections = {name: OmegaConf.to_container(cfg[name], resolve=True) if name in cfg else None
                for name in ("model", "loss", "distill", "self_distill")}
    trainer = {key: cfg.trainer.get(key) for key in ("precision", "feature_dtype", "parallel", "fsdp_reduce",
                                                     "fsdp_shard_size")}
    properties = torch.cuda.get_device_properties(device)
    return {"format": PROBES_FORMAT, **sections, "trainer": trainer, "rank": rank, "world_size": world_size,
            "device": torch.cuda.get_device_name(device), "memory": int(properties.total_memory),
            **library_versions(), "open_clip": open_clip.__version__, "timm": timm.__version__,
            "source": source_digest()}


@functools.cache
def source_digest() -> str:
    """A digest of megabatch's Python source: a probe kept by other code is measured again."""
    package = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]
