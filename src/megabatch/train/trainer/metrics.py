"""The training log. ``StepLog`` owns the log line: it takes each step's outcome and every
``trainer.log_every`` steps writes one record of the interval (loss, throughput, phases, MFU,
memory, bad input) to the log, the progress bar and its sinks. ``MetricsLogger`` is those sinks:
``metrics.jsonl`` in the run directory (always), TensorBoard (``logger=tensorboard``), wandb
(``logger=wandb``) and Trackio (``logger=trackio``), several at once (``'logger=[jsonl,tensorboard,wandb]'``)."""

from __future__ import annotations

import json
import logging
import math
import resource
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ...data import gpu_decode
from ..build.startup import StartupTimes
from ..step.plan import BatchPlan
from ..step.step import StepOutcome, UpdateHealth
from ..step.utilization import ModelFlops, Peak, utilization

log = logging.getLogger(__name__)
train_log = logging.getLogger("megabatch")  # the trainer's own log lines


def finite_or_none(value):
    """A non-finite float as ``None`` (JSON ``null``): ``metrics.jsonl`` stays strict JSON."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


WANDB_ID_FILE = "wandb_id"  # in the run directory: the wandb run a resumed run continues


def wandb_run_id(run_dir: Path) -> str:
    """The id of this run directory's wandb run: made at its first start and kept in
    ``<run_dir>/wandb_id``, so that every resume (and an elastic restart) logs into the same
    wandb run (``logger.wandb.id`` overrides it)."""
    path = Path(run_dir) / WANDB_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)
    return run_id


class MetricsLogger:
    """Append one JSON object per record to ``<run_dir>/metrics.jsonl``; mirror the numbers to
    TensorBoard and wandb when ``logger_cfg`` has their sections.

    Only rank 0 should construct one with ``enabled=True``. ``resumed_step``: records after it are
    dropped (the resumed run redoes those steps), from TensorBoard's view too. ``sweep``: (the sweep's
    name, this job's number) in a Hydra multirun: wandb groups the jobs under the sweep's name.
    """

    def __init__(self, run_dir: Path, logger_cfg=None, config: dict | None = None, enabled: bool = True,
                 resumed_step: int = 0, sweep: tuple[str, str] | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = self.tensorboard = self.trackio = None
        if not enabled:
            return
        self.drop_after(resumed_step)
        wandb_cfg = logger_cfg.wandb if logger_cfg is not None else None
        tensorboard_cfg = logger_cfg.tensorboard if logger_cfg is not None else None
        trackio_cfg = logger_cfg.get("trackio") if logger_cfg is not None else None
        run_name = f"{sweep[0]}/{sweep[1]}" if sweep else Path(run_dir).name  # a sweep's jobs: <sweep>/<job>
        if wandb_cfg is not None:
            import wandb  # only imported when asked for: GPU images may lack it

            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name or run_name,
                group=wandb_cfg.group or (sweep[0] if sweep else None),
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=wandb_cfg.id or wandb_run_id(run_dir),
            )
        if trackio_cfg is not None:
            import trackio  # an optional dependency: validate names the fix without it

            # one trackio run per run directory, by its name: a resume continues it
            self.trackio = trackio.init(project=trackio_cfg.project, name=trackio_cfg.name or run_name,
                                        group=trackio_cfg.group or (sweep[0] if sweep else None),
                                        space_id=trackio_cfg.space_id, config=config, resume="allow")
        if tensorboard_cfg is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            # purge_step: events after the resumed step (written before a kill) are hidden, as they are dropped here
            self.tensorboard = SummaryWriter(log_dir=str(tensorboard_cfg.dir or Path(run_dir) / "tensorboard"),
                                             flush_secs=tensorboard_cfg.flush_secs,
                                             purge_step=resumed_step + 1 if resumed_step else None)

    def drop_after(self, step: int) -> None:
        """Forget the records of steps after ``step`` (a resumed run redoes them; each step is then
        logged once). A line cut short by a kill is dropped too."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def log(self, record: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        line = {"step": step, "time": round(time.time(), 3), **{k: finite_or_none(v) for k, v in record.items()}}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(line, allow_nan=False) + "\n")  # strict JSON: no bare NaN
        if self.wandb is not None:
            self.wandb.log(record, step=step)
        if self.trackio is not None:
            self.trackio.log(record, step=step)
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.trackio is not None:
            self.trackio.finish()
            self.trackio = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


@dataclass
class Interval:
    """The steps since the last log line: their count, phase seconds and wall time; with GPU decoding,
    the decoding streams' waits when it began (``gpu_decode.wait_seconds``: which side a data wait is on)."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    times: list = field(default_factory=list)  # each step's PhaseTimes, read when the line is written (no sync before)
    last: StepOutcome | None = None
    decode_waits: dict[str, float] = field(default_factory=lambda: dict(gpu_decode.wait_seconds))

    def decode_waits_since(self) -> dict[str, float]:
        """Seconds a step waited, by decoding stream and cause, over this interval (none: empty)."""
        return {key: (value - self.decode_waits.get(key, 0.0)) / max(1, self.steps)
                for key, value in gpu_decode.wait_seconds.items() if value > self.decode_waits.get(key, 0.0)}

    @property
    def phase_totals(self) -> dict[str, float]:
        """Each phase's seconds summed over the interval's steps (reading a step's CUDA events: a host sync, once
        its work is done)."""
        totals: dict[str, float] = {}
        for times in self.times:
            for phase, seconds in times.items():
                totals[phase] = totals.get(phase, 0.0) + seconds
        return totals


@dataclass(frozen=True)
class RunFacts:
    """What every log line of a run reads beside its steps: the batch plan, the ranks and device,
    the model FLOPs and the GPU's peak (MFU), the model's temperature, this rank's bad-input counts
    and the start-up's account (``time_to_first_step_s`` and ``startup/*`` in the first record)."""

    plan: BatchPlan
    world_size: int
    device: torch.device
    flops: ModelFlops
    peak: Peak | None
    logit_scale: Callable[[], torch.Tensor]
    bad_input: Callable[[], dict[str, int]]
    startup: StartupTimes


class StepLog:
    """The training log: ``on_step`` takes each ``StepOutcome``; every ``log_every`` steps (and when
    ``write`` is forced: a stop, the last step, a diverging run) one log line, progress-bar postfix
    and record into ``sinks`` (``MetricsLogger``: ``metrics.jsonl`` and the ``logger=`` group's
    loggers) for the steps since the last one. Rank 0 writes; every rank keeps the same counts."""

    def __init__(self, sinks: MetricsLogger, facts: RunFacts, log_every: int | None, main: bool):
        self.sinks, self.facts, self.log_every, self.main = sinks, facts, log_every, main
        self.interval = Interval()
        self.progress: tqdm | None = None
        self.first_step_s: float | None = None  # time_to_first_step_s, for the next record

    def start(self, step: int) -> None:
        """The progress bar, from ``step``; the first interval starts now."""
        plan = self.facts.plan
        self.progress = tqdm(total=plan.total_steps, initial=step, disable=not self.main, desc="train",
                             dynamic_ncols=True, mininterval=1.0, leave=False)
        self.interval = Interval()

    def on_step(self, outcome: StepOutcome, step: int, samples_seen: int, health: UpdateHealth,
                force: bool = False) -> None:
        """Count ``outcome`` (the run's step ``step``); write the interval when due, ``force``d, or the
        run diverged (``health``, as last settled)."""
        interval = self.interval
        interval.steps, interval.last = interval.steps + 1, outcome
        interval.times.append(outcome.times)
        if self.progress is not None:
            self.progress.update(1)
        if force or health.diverged or (self.log_every and step % self.log_every == 0):
            self.write(step, samples_seen, health)

    def write(self, step: int, samples_seen: int, health: UpdateHealth) -> None:
        """One log line, progress-bar postfix and record for the steps since the last one (none: nothing)."""
        interval, facts = self.interval, self.facts
        if not interval.steps:
            return
        self.interval = Interval()
        elapsed = time.perf_counter() - interval.started
        loss_value = interval.last.loss.item()  # host sync, once per log interval
        plan, steps, phase_totals, lr = facts.plan, interval.steps, interval.phase_totals, interval.last.lr
        record = {
            "loss": loss_value, "lr": lr,
            "logit_scale": facts.logit_scale().exp().item(),
            "samples_per_s": plan.global_batch * steps / elapsed,
            "samples_seen": samples_seen,
            "epoch": step / plan.steps_per_epoch,
            **{f"time/{k}": v / steps for k, v in phase_totals.items()},
            "data_wait": phase_totals.get("data", 0.0) / elapsed,  # fraction of wall time
            "grad_norm": health.grad_norm, "skipped_steps": health.skipped_steps,
        }
        # a loss of several terms (distill.teacher: contrastive and distill), unweighted, the last step's
        record.update({f"loss/{k}": v.item() for k, v in interval.last.terms.items()})
        if self.first_step_s is not None:
            record["time_to_first_step_s"], self.first_step_s = self.first_step_s, None
            record.update(facts.startup.record())
        # model TFLOP/s per GPU and MFU (utilization.py: model FLOPs counted at start-up, the GPU's bf16 peak)
        record.update(utilization(facts.flops, facts.peak, record["samples_per_s"] / facts.world_size))
        record.update({f"data/{k}": v for k, v in facts.bad_input().items() if v})
        # GPU decoding: a step's wait for its images by stream and cause (look_ahead_source: the
        # loader had not read them; look_ahead_decode: their decoding had not finished; replay_*: the
        # offload's re-decoding)
        record.update({f"data_wait_s/{k}": v for k, v in interval.decode_waits_since().items()})
        if facts.device.type == "cuda":
            record["peak_gpu_gb"] = torch.cuda.max_memory_allocated(facts.device) / 1e9
        record["peak_host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # this process; kB on Linux
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", sps=f"{record['samples_per_s']:.0f}")
        self.sinks.log(record, step)
        if self.main:
            log_line(record, step, plan.total_steps)

    def log(self, record: dict[str, Any], step: int) -> None:
        """A record of its own (an evaluation's numbers) at ``step``."""
        self.sinks.log(record, step)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None


def log_line(record: dict[str, Any], step: int, total_steps: int) -> None:
    """A training record as one line of the run's log."""
    phases = " ".join(f"{k.split('/')[1]} {v:.2f}s" for k, v in record.items() if k.startswith("time/"))
    memory = f"  peak {record['peak_gpu_gb']:.1f} GB" if "peak_gpu_gb" in record else ""
    if "model_tflops_per_gpu" in record:
        memory += f"  {record['model_tflops_per_gpu']:.0f} TFLOP/s per GPU" + (
            f", MFU {100 * record['mfu']:.1f}%" if "mfu" in record else "")
    bad = {k[5:]: v for k, v in record.items() if k.startswith("data/")}
    terms = ", ".join(f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("loss/"))
    train_log.info("step %d/%d  loss %.4f%s  lr %.3g  logit_scale %.2f  %.0f samples/s  data wait %.0f%%  "
                   "[%s]%s%s", step, total_steps, record["loss"], f" ({terms})" if terms else "",
                   record["lr"], record["logit_scale"], record["samples_per_s"], 100 * record["data_wait"], phases,
                   memory, f"  bad input: {bad}" if bad else "")
