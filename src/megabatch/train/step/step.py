"""One rank's share of one optimizer step, apart from the run that repeats it.

``TrainStep`` is built once from the model, the loss, the optimizer, the precision, the device and
where the replay gets its inputs (on the device, or re-decoded by an ``Offload``). ``step`` is one
whole optimizer step and returns its ``StepOutcome``; it is made of ``gradients`` (one global
batch's worth of this rank's ``SubBatch``es into gradients: a plain forward and backward for one
sub-batch, GradCache's three phases for several) and ``apply`` (clip, then step unless a value is
not finite). No run directory, config or logging: a test or a benchmark drives it directly.

    step = TrainStep(model, loss_fn, optimizer, torch.device("cuda"), precision="bf16", sub_batches=64)
    outcome = step.step(stream, lr=1e-3)   # takes 64 SubBatch of this rank's 32k / 512 from stream
    step.settle()                               # host sync: outcome's update read (step.health)

With a fused optimizer (AdamW's default on CUDA) in bf16 or fp32, nothing in ``apply`` waits for
the GPU: whether to skip is decided on the device (the optimizer's ``found_inf``, as PyTorch's
GradScaler passes it), so the host queues the next step while the GPU finishes this one. The one
place that reads that decision is ``settle``: ``step`` calls it for the previous step once its own
gradients are queued (a read one step late), and a caller that acts on a step at once (its log
line, its checkpoint, a stop) calls it first. ``health`` counts the skipped updates; ``step`` raises
``NonFiniteError`` before an update once ``max_bad_steps`` in a row were skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from ...data.offload import Offload
from ...data.samples import SubBatch
from ...data.token_groups import TokenGroups
from ...distributed.fsdp import full, gathered_through, is_sharded, no_gradient_sync, reduce_replicated
from .ema import WeightAverage
from .gradcache import GradSync, ReplayInputs, encode_without_graph, loss_and_feature_grads, replay, to_device
from .objectives import Contrastive, Objective
from .precision import Precision

log = logging.getLogger("megabatch")


class NonFiniteError(RuntimeError):
    """Too many steps in a row with a non-finite loss or gradient (``trainer.max_bad_steps``)."""

    @classmethod
    def of(cls, health: UpdateHealth) -> NonFiniteError:
        return cls(f"{health.bad_in_a_row} steps in a row had a non-finite loss or gradient: stopping "
                   f"(trainer.max_bad_steps={health.max_bad_steps}). The weights are those of the last finite step, "
                   "and so is the newest checkpoint in the run's checkpoints/ folder. Lower optim.lr, set "
                   "optim.grad_clip, or use trainer.precision=bf16 instead of fp16")


@dataclass(eq=False)
class PhaseTimes(Mapping):
    """``{phase: seconds}`` of one step without stopping the host: on CUDA an event recorded on the current
    stream at each phase boundary, read only once the times are asked for (the log reads them every
    ``trainer.log_every`` steps, after its own host sync); on the CPU the host's clock. ``lap(name, minus)``
    marks a boundary: it ends the phase ``name`` begun at the last boundary (``lap()``: the first), less the host
    seconds ``minus`` of waits that fell inside it. ``host``: seconds the host measured itself (``data``: its
    waits for the loader)."""

    cuda: bool
    host: dict[str, float] = field(default_factory=dict)
    spans: list = field(default_factory=list)  # (name, start, end, host seconds to subtract)
    opened: object = None
    resolved: dict[str, float] | None = None  # the spans' seconds, once read

    def lap(self, name: str | None = None, minus: float = 0.0) -> None:
        if self.cuda:
            point = torch.cuda.Event(enable_timing=True)
            point.record()  # on the current stream: no host sync
        else:
            point = time.perf_counter()
        if name is not None:
            self.spans.append((name, self.opened, point, minus))
            self.resolved = None
        self.opened = point

    def _resolve(self) -> dict[str, float]:
        if self.resolved is None:
            self.resolved = {}
            for name, start, end, minus in self.spans:
                if self.cuda:
                    end.synchronize()  # host sync, when read: the step's work is done by then
                    seconds = start.elapsed_time(end) / 1000.0
                else:
                    seconds = end - start
                self.resolved[name] = max(0.0, seconds - minus)
        return {**self.host, **self.resolved}

    def __getitem__(self, name: str) -> float:
        return self._resolve()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolve())

    def __len__(self) -> int:
        return len(self._resolve())


@dataclass(frozen=True)
class Applied:
    """What ``TrainStep.apply`` did: its seconds (host time where it did not wait for the GPU),
    the gradient norm (before clipping; of the true, unscaled gradient) and whether the update was
    made (``False``: skipped, a non-finite loss or gradient on some rank). ``norm`` and ``finite``
    may still be computing on the device: ``grad_norm`` and ``stepped`` wait for them."""

    seconds: float
    norm: torch.Tensor    # 0-d
    finite: torch.Tensor  # 0-d bool

    @property
    def grad_norm(self) -> float:
        return float(self.norm)  # host sync

    @property
    def stepped(self) -> bool:
        return bool(self.finite)  # host sync


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did: its number (counted from 1, the caller's), the loss, the learning
    rate, the update (``Applied``: its norm and whether it was made, on the device until
    ``TrainStep.settle`` reads it), the seconds of each phase and the host's wall time of the step."""

    number: int
    loss: torch.Tensor  # 0-d, on the device
    lr: float
    applied: Applied
    times: Mapping[str, float]  # PhaseTimes: read once the step's work is done (a host sync on CUDA)
    seconds: float
    terms: dict = field(default_factory=dict)  # the loss's terms, 0-d on the device (distill: contrastive, distill)


@dataclass
class UpdateHealth:
    """The updates skipped for a non-finite loss or gradient norm, as ``TrainStep.settle`` reads
    them: in a row and in all, and the last read gradient norm. ``diverged``: ``max_bad_steps`` in
    a row (``NonFiniteError.of`` says so)."""

    max_bad_steps: int
    bad_in_a_row: int = 0
    skipped_steps: int = 0
    grad_norm: float = float("nan")
    diverged: bool = False


class TrainStep:
    """Gradients of one step on this rank, then the optimizer update.

    ``model``: a ``ClipModel``, wrapped in DDP here when a process group of several ranks is
    initialised, unless it is already sharded by FSDP (``distributed.fsdp.shard_model``);
    ``loss_fn``: a ``ContrastiveLoss``; ``sub_batches``: how many sub-batches make this rank's
    share of a global batch (``rank_batch = sub_batches x sub_batch``); ``precision``:
    ``auto``, ``bf16``, ``fp16`` (with loss scaling) or ``fp32``, or a ``Precision`` already made
    (``feature_dtype`` then unused); ``feature_dtype``: GradCache's feature buffers (``auto``: bf16 with
    bf16 towers, else fp32);
    ``grad_clip``: max norm of the true gradient, or ``None``; ``offload``: keeps
    the image bytes and re-decodes them for the replay (``None``: inputs stay on the device);
    ``keep_graph``: GradCache's last sub-batches whose phase-1 graphs are kept instead of being
    encoded again (``True``: one, ``False``: none, or a count; with several ranks at most all but one,
    whose replay synchronises the gradients). Captions are cut to their length where
    ``model.text_trim`` is set (``trim_text``).
    ``fsdp_reduce`` (a sharded model): ``sub_batch`` reduce-scatters each replayed sub-batch's
    gradients (sharded gradients accumulate: least memory), ``step`` once per step (unsharded
    gradients accumulate until the last sub-batch: fewer collectives, a whole model's gradients held).
    ``optimizer`` may be ``None`` where only the gradients are wanted (tests). ``max_bad_steps``:
    skipped updates in a row after which ``step`` raises ``NonFiniteError``. ``ema``: the moving average
    of the weights (``WeightAverage``, ``ema.decay``), updated after each optimizer step. ``objectives``: the
    training terms and loss inputs beside the contrastive loss (``train/step/objectives``: a teacher's features, hard
    negatives, a CoCa's caption loss), whose hooks the step calls in turn; ``contrastive_weight``: the
    contrastive loss's weight (``loss.contrastive_weight``), applied in one place (``objectives/contrastive.py``).
    """

    def __init__(self, model, loss_fn, optimizer: torch.optim.Optimizer | None, device: torch.device, *,
                 precision: str | Precision = "fp32", sub_batches: int = 1, feature_dtype: str = "auto",
                 grad_clip: float | None = None, offload: Offload | None = None,
                 keep_graph: bool | int = True, fsdp_reduce: str = "sub_batch", show_progress: bool = False,
                 max_bad_steps: int = 10, ema: WeightAverage | None = None, objectives: Sequence[Objective] = (),
                 contrastive_weight: float = 1.0):
        self.model, self.loss_fn, self.optimizer, self.device = model, loss_fn, optimizer, device
        self.precision = precision if isinstance(precision, Precision) else \
            Precision.create(precision, device, feature_dtype)
        self.sub_batches, self.grad_clip, self.show_progress = sub_batches, grad_clip, show_progress
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.sharded = is_sharded(model)
        # DDP averages the gradients across ranks; GradCache's replay lets it synchronise once.
        # FSDP's hooks are on the model itself: it reduce-scatters after each backward, or once per
        # step with the others held (fsdp_reduce)
        self.wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) \
            if self.distributed and not self.sharded else model
        self.gather_once = self.sharded and fsdp_reduce == "step"  # the weights too: once per step
        if self.sharded:
            held = (lambda: no_gradient_sync(model)) if fsdp_reduce == "step" else None
            self.sync = GradSync(hold=held, kept=held)
        else:
            self.sync = GradSync.of(self.wrapped)
        # a frozen tower is encoded once and never replayed; images come back through the offload
        # owner, or stay on the device. An objective that reads both towers' outputs (a CoCa's decoder) has
        # both encoded again (a frozen one without autograd), and no sub-batch keeps its phase-1 graph
        self.objectives, self.contrastive = list(objectives), Contrastive(loss_fn, contrastive_weight)
        both = any(objective.replays_both_towers for objective in self.objectives)
        replay_images = not model.frozen("image") or both
        # captions cut to their length and grouped by it, unless an objective reads them whole, row by row with the
        # images (a caption decoder: model.decoder's reads the captions beside its sub-batch's image tokens)
        cut = all(objective.cuts_captions for objective in self.objectives)
        self.keep = ReplayInputs(images=replay_images, texts=not model.frozen("text") or both,
                                 offload=offload if replay_images else None,
                                 text_trim=model.text_trim if cut else None,
                                 kept_graphs=self.kept_graphs(keep_graph)
                                 if all(objective.keeps_graphs for objective in self.objectives) else 0)
        self.loss: torch.Tensor | None = None  # the last gradients() call's
        self.health = UpdateHealth(max_bad_steps)
        self.unsettled: StepOutcome | None = None  # the last step, its update not yet read (settle)
        self.ema = ema
        # whether apply decides on the device: a fused optimizer (it takes found_inf, as torch.amp.GradScaler
        # passes it), no fp16 scaler (its own found_inf is the optimizer's there) and an unsharded model
        self.one_pass = sub_batches == 1  # False: GradCache with its one sub-batch (scripts/benchmarks/one_pass.py)
        self.skips_on_device = (getattr(optimizer, "_step_supports_amp_scaling", False)
                                and not self.precision.scaler.is_enabled() and not self.sharded)

    def kept_graphs(self, keep_graph: bool | int) -> int:
        """How many sub-batches keep their phase-1 graphs: ``keep_graph`` (``True``: 1), at most
        all of them on one rank; with several, all but one, whose replay reduces the gradients
        across the ranks (the kept graphs' backward passes go outside DDP's bookkeeping, and under
        FSDP's held reduction)."""
        if self.sub_batches == 1:
            return 0
        return min(int(keep_graph), self.sub_batches - 1 if self.distributed else self.sub_batches)

    @property
    def teacher(self):
        """``distill.teacher``'s model or stored embeddings (its objective's), or ``None``."""
        return next((objective.teacher for objective in self.objectives if hasattr(objective, "teacher")), None)

    def step(self, stream: Iterator[SubBatch], lr: float, *, epoch: int = 0, number: int = 1) -> StepOutcome:
        """One optimizer step on this rank's share of the global batch, ``sub_batches`` taken from
        ``stream`` (``global_batch = world_size x sub_batches x sub_batch``: 1M = 2 x 1024 x 512), of
        ``epoch``: the learning rate ``lr`` set on every group (times its ``lr_scale``: ``optim.layer_decay``),
        forward, the global loss, backward (GradCache with several sub-batches), then the clipped
        update, skipped on every rank where a loss or gradient is not finite on one. ``number``: the
        step's number in the run (counted from 1), for the outcome and the warnings. Raises
        ``NonFiniteError`` before the update when ``max_bad_steps`` earlier updates in a row were
        skipped."""
        started = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        with gathered_through(self.model) if self.gather_once else contextlib.nullcontext():
            loss, times = self.gradients(stream, epoch=epoch)
        self.settle()  # host sync: the last step's update, read once this step's work is queued
        if self.health.diverged:  # too many skipped in a row: stop before this step's update
            raise NonFiniteError.of(self.health)
        applied = self.apply()
        if self.ema is not None:  # queued after the update on the device: no host sync
            ema_started = time.perf_counter()
            self.ema.step()
            times.host["ema"] = time.perf_counter() - ema_started
        times.host["optimizer"] = applied.seconds
        self.unsettled = StepOutcome(number, loss, lr, applied, times, time.perf_counter() - started,
                                     {**getattr(self.loss_fn, "terms", {}), **self.contrastive.terms})
        return self.unsettled

    def settle(self) -> UpdateHealth:
        """Read the last step's update (a host sync; the one place its flag is read): its gradient
        norm, and whether it was skipped, counted in ``health``. Nothing to read: no wait."""
        outcome, self.unsettled, health = self.unsettled, None, self.health
        if outcome is None:
            return health
        norm, finite = outcome.applied.norm, outcome.applied.finite
        if finite.device == norm.device:  # both in one copy to the host (else decided on the host already)
            norm, finite = torch.stack([norm.float().reshape(()), finite.float().reshape(())]).tolist()
        health.grad_norm = float(norm)
        if finite:
            health.bad_in_a_row = 0
            return health
        health.bad_in_a_row += 1
        health.skipped_steps += 1
        health.diverged = health.bad_in_a_row >= health.max_bad_steps
        log.warning("step %d: non-finite loss (%.4g) or gradient norm (%.4g) on some rank: update skipped "
                    "(%d in a row, %d in all; the run stops after trainer.max_bad_steps=%d in a row)",
                    outcome.number, float(outcome.loss), health.grad_norm, health.bad_in_a_row,
                    health.skipped_steps, health.max_bad_steps)
        return health

    def gradients(self, stream: Iterator[SubBatch], epoch: int = 0) -> tuple[torch.Tensor, PhaseTimes]:
        """Take ``self.sub_batches`` sub-batches from ``stream`` (this rank's share of one global batch, of
        ``epoch``), accumulate the step's gradients (DDP-averaged) into ``.grad`` and return the loss and the
        seconds of each phase: one sub-batch is one forward and backward (``data``, ``forward_backward``; unless
        ``one_pass`` is off), several are GradCache's three phases (``gradcache.py``: ``data``, ``encode``,
        ``loss``, ``replay``)."""
        for objective in self.objectives:
            objective.new_step()
        if self.one_pass:
            loss, times = self._forward_backward(next_timed(stream))
        else:
            # a token budget's step of shorter images has fewer, larger sub-batches (data/token_groups.py)
            count = stream.step_sub_batches() if isinstance(stream, TokenGroups) else self.sub_batches
            keep = self.keep if count == self.sub_batches else \
                dataclasses.replace(self.keep, kept_graphs=min(self.keep.kept_graphs, count - self.distributed))
            progress = tqdm(total=2 * count, desc="encode", leave=False, dynamic_ncols=True,
                            disable=not self.show_progress or count < 8, position=1, unit="sub-batch")
            times = PhaseTimes(self.device.type == "cuda")  # events at the phases' boundaries: no host sync
            times.lap()
            encoded = encode_without_graph(self.model, stream, count, self.precision, keep, progress,
                                           self.objectives)
            times.host["data"] = encoded.data_s
            times.lap("encode", minus=encoded.data_s)
            # the offloaded images decoded again: on the GPU starting now (the replay's first are ready after the
            # loss); the offload's worker pool starts at the replay's first request
            again = self.keep.offload.replay_images(encoded.kept, epoch) if encoded.kept else None
            bias = self.model.logit_bias
            grads = loss_and_feature_grads(self.contrastive, encoded, full(self.model.logit_scale),
                                           None if bias is None else full(bias), self.precision, self.objectives)
            for objective in self.objectives:  # a CoCa: the caption loss's factor over the global batch's tokens
                objective.before_replay(self.precision)
            times.lap("loss")
            progress.set_description("replay")
            try:
                waited = replay(self.wrapped, encoded, grads, self.precision, again, progress, self.sync,
                                self.objectives)
            finally:
                if again is not None:
                    again.close()  # its decoding stream closed: the next step's look-ahead takes every thread
            times.host["data"] += waited
            times.lap("replay", minus=waited)
            progress.close()
            loss = self.contrastive.logged(grads.loss, self.objectives)
        if self.sharded and self.distributed:
            reduce_replicated(self.model)  # the scalars FSDP leaves whole
        self.loss = loss
        return loss, times

    def apply(self) -> Applied:
        """Unscale (fp16) and clip the gradient, then step, unless the loss or the gradient norm is
        not finite on some rank: then every rank skips the update (fp16's scaler lowers its scale as
        it always does). Clear the gradients; clamp the temperature. The skip is decided on the
        device where the optimizer can take the decision from there (``skips_on_device``), else on
        the host (one sync)."""
        start, scaler = time.perf_counter(), self.precision.scaler
        for objective in self.objectives:  # an objective's own parameters: decayed only once it trains them
            if objective.owns is not None:
                for group in self.optimizer.param_groups:
                    if group.get("owner") == objective.owns:
                        group["weight_decay"] = group["decay"] if objective.trains_now else 0.0
        scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.sharded:  # the norm over every rank's shards
            norm = full(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))
            if self.grad_clip:
                torch.nn.utils.clip_grads_with_norm_(params, self.grad_clip, norm, foreach=True)
        elif self.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        else:  # the norm alone, for the finiteness check and the logs; the gradients untouched
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))  # fused
        # 1.0 where the loss or the gradient norm is not finite on some rank (0-d fp32 on the norm's device, no host
        # sync; the ranks agree, so they all skip the same steps and stay replicas)
        bad = torch.logical_not(torch.isfinite(norm)).float().reshape(1)
        if self.loss is not None:
            bad = torch.maximum(bad, torch.logical_not(torch.isfinite(self.loss.to(norm.device))).float())
        if self.distributed:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        bad = bad.reshape(())
        if self.skips_on_device:
            # the fused kernel leaves the weights and moments as they were, and its step count, where
            # found_inf is 1; clamping a temperature left as it was changes nothing
            self.optimizer.found_inf = bad
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            self.optimizer.zero_grad(set_to_none=True)
            self.model.clamp_logit_scale()
            return Applied(time.perf_counter() - start, norm.detach(), bad == 0)
        finite = bool(bad.item() == 0)  # host sync: the decision to step is made on the host
        if finite or scaler.is_enabled():  # fp16: the scaler skips by itself and lowers its scale
            scaler.step(self.optimizer)
            scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if finite:
            self.model.clamp_logit_scale()
        return Applied(time.perf_counter() - start, norm.detach(), torch.tensor(finite))  # after its host sync

    def _forward_backward(self, timed: tuple[SubBatch, float]) -> tuple[torch.Tensor, PhaseTimes]:
        """One sub-batch: encode, the global loss, backward (fp16: scaled). The loss runs on fp32
        features, so the b x b softmax never runs in half precision. Each objective adds its rows to the text
        tower's input (hard negatives), its inputs to the loss (their features, a teacher's) and its term to
        the one backward (a CoCa's caption loss)."""
        sub, data_s = timed
        images = to_device(sub.images, self.device)
        rows = len(sub.texts)
        extra = [objective.extra_texts(sub) for objective in self.objectives]  # rows after the captions, or None
        added = [texts for texts in extra if texts is not None]
        captions = torch.cat([sub.texts, *added]) if added else sub.texts  # one forward of the text tower
        # cut on the host, where the token ids are (no sync); not where an objective reads the captions whole
        cut = self.keep.text_trim if all(objective.cuts_captions for objective in self.objectives) else None
        texts = to_device(captions if cut is None else cut.cut(captions), self.device)
        for objective in self.objectives:
            objective.one_pass_start(sub)
        times = PhaseTimes(self.device.type == "cuda", {"data": data_s})
        times.lap()
        with self.precision.autocast():
            # what the objectives ask of the model's forward this step (its fifth output)
            outputs = self.wrapped(images, texts, **{key: value for objective in self.objectives
                                                     for key, value in objective.model_options_for(0).items()})
        image_features, text_features, scale, bias = outputs[:4]
        options, start_row = {}, rows
        for objective, texts in zip(self.objectives, extra, strict=True):  # each its own rows' features
            extra_features = None
            if texts is not None:
                extra_features, start_row = text_features[start_row:start_row + len(texts)], start_row + len(texts)
            options.update(objective.loss_inputs_one_pass(sub, images, extra_features, self.precision.autocast))
        contrastive = self.contrastive(image_features.float(), text_features[:rows].float(), scale.float(),
                                       *(() if bias is None else (bias.float(),)), **options)
        total = contrastive
        for objective in self.objectives:
            term = objective.one_pass_term(outputs, images)
            if term is not None:
                total = total + term
        self.precision.scaler.scale(total).backward()
        times.lap("forward_backward")
        return self.contrastive.logged(contrastive.detach(), self.objectives), times


def next_timed(items: Iterator):
    """The next item and the seconds spent waiting for it."""
    start = time.perf_counter()
    item = next(items)
    return item, time.perf_counter() - start
