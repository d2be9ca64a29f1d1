"""The training run: set-up, resume, the step loop, checkpoints, logs, evaluation.

What one rank trains with is built by ``RunParts`` (``parts.py``); the work of one step is
``TrainStep``'s (``step.py``); the sub-batches come from ``RunInputs`` (``inputs.py``). ``Trainer``
owns what outlives a step: the run directory, resuming, the checkpoints, the metrics and the
evaluations.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ..bytecode import write_missing_bytecode
from ..checkpoint import (
    capture_rng,
    load_checkpoint,
    load_resume,
    load_sharded_state,
    load_whole_state,
    restore_rng,
    run_checkpoints,
    write_run_checkpoint,
    write_sharded_checkpoint,
)
from ..config import ConfigError, parse_duration
from ..config.schema import recipe_warning, validate
from ..distributed import DistEnv, init_distributed
from ..distributed.fsdp import is_sharded, local
from ..distributed.health import FAILED, RankLost, describe, is_communication_error
from ..distributed.once import on_rank_zero
from ..eval import headline, run_zeroshot, summary
from ..processes import ignore_stop_signals
from ..report import RunStatus
from ..report.runs import failure
from .backends import configure_backends
from .metrics import MetricsLogger
from .parts import RunParts
from .preemption import Preempted, StopRequests
from .run_lock import RunLock
from .startup import StartupTimes, run_ended
from .step import Applied
from .utilization import utilization

log = logging.getLogger("megabatch")


class NonFiniteError(RuntimeError):
    """Too many steps in a row with a non-finite loss or gradient (``trainer.max_bad_steps``)."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: its number (counted from 1), the loss and the learning rate,
    the update (``Applied``: its norm and whether it was made, still on the device until read), the
    seconds of each phase and the host's wall time of the whole step."""

    step: int
    loss: torch.Tensor  # 0-d, on the device
    lr: float
    applied: Applied
    times: dict[str, float]
    seconds: float


@dataclass
class Interval:
    """The steps since the last log line: their count, phase seconds and wall time."""

    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    phase_totals: dict[str, float] = field(default_factory=dict)
    last: StepResult | None = None

    def add(self, result: StepResult) -> None:
        self.steps, self.last = self.steps + 1, result
        for phase, seconds in result.times.items():
            self.phase_totals[phase] = self.phase_totals.get(phase, 0.0) + seconds


def run(cfg: DictConfig) -> float:
    """Train as configured; return the final zero-shot top-1 (or the last loss without eval)."""
    validate(cfg)  # every value, before a process group, a model or a loader exists
    env = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend, cfg.trainer.dist_timeout_s)
    trainer, ended = None, "failed"
    try:
        trainer = Trainer(cfg, env)
        result = trainer.fit()
        trainer.status.end("completed" if trainer.step >= trainer.plan.total_steps else "stopped", result=result)
        ended = "finished"
        return result
    except Preempted as stopped:
        trainer.status.end("stopped", error=str(stopped))
        ended = "stopped"
        raise
    except BaseException as error:  # status.json says why, for a sweep's summary
        named = name_lost_rank(env, error)
        ended = f"{FAILED}: {failure(named)}"  # the other ranks name this one in their errors
        if trainer is not None:
            trainer.status.fail(named)
        if named is not error:
            raise named from error
        raise
    finally:
        if env.peers is not None:
            env.peers.end(ended)
        if trainer is not None:
            trainer.close()
        if ended == "stopped":  # the checkpoint is down: a late signal (torchrun's) must not change the exit status
            ignore_stop_signals()
        if dist.is_initialized():
            dist.destroy_process_group()
        run_ended()  # a multirun's next job counts its start-up from here


def name_lost_rank(env: DistEnv, error: BaseException) -> BaseException:
    """A failed collective becomes a ``RankLost`` naming the rank that went (or failed), when the
    heartbeats tell; any other error stays as it is."""
    if env.peers is None or not is_communication_error(error):
        return error
    lost = env.peers.lost_peers()
    if not lost:
        return error
    message = f"{describe(lost)}; rank {env.rank} stops too ({type(error).__name__}: {str(error)[:300]})"
    log.error("%s", message)
    return RankLost(message)


def resolve_run_dir(cfg: DictConfig, env: DistEnv) -> Path:
    """``cfg.run_dir`` if set, else Hydra's output dir; rank 0's choice wins on every rank."""
    run_dir = cfg.run_dir
    if not run_dir:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    if env.distributed:
        holder = [str(run_dir)]
        dist.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    return Path(run_dir)


def sweep_job() -> tuple[str, str] | None:
    """(the sweep's name, this job's number) in a Hydra multirun, else ``None``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra = HydraConfig.get()
    return Path(hydra.sweep.dir).name, str(hydra.job.num)


def agreed_resume(resume: str | None, run_dir: Path, rank: int) -> tuple[Path, dict] | None:
    """What to resume from (``checkpoint.load_resume``), chosen by rank 0 for every rank: a
    filesystem may show ranks different newest files (a checkpoint just renamed, NFS attribute
    caching). Another rank loads that file or fails naming it."""
    chosen: dict = {}

    def choose() -> str | None:
        chosen["found"] = load_resume(resume, run_dir)
        return None if chosen["found"] is None else str(chosen["found"][0])

    path = on_rank_zero(choose)
    if path is None or "found" in chosen:
        return chosen.get("found")
    try:
        return Path(path), load_checkpoint(path, weights=False)
    except ConfigError as error:
        raise ConfigError(f"rank {rank}: rank 0 resumes from {path}, which this rank cannot load ({error}); every "
                          "rank must see the run directory's files alike (a shared filesystem)") from None


def warn_if_torchrun_may_cut(seconds: float) -> bool:
    """Warn (and return ``True``) when a checkpoint takes more than half of what torchrun waits after
    forwarding a signal (its ``--shutdown-timeout``, 30 s unless ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
    says otherwise): its SIGKILL would cut the stop's checkpoint when torchrun itself is signalled."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    patience = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or os.environ.get("PET_SHUTDOWN_TIMEOUT") or 30)
    if seconds > 0.5 * patience:
        log.warning("a checkpoint took %.0f s; torchrun kills its workers %.0f s after it forwards a stop signal, "
                    "which would cut the stop's checkpoint: launch with torchrun --shutdown-timeout=%d (or "
                    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=%d) above a step plus a checkpoint", seconds, patience,
                    int(4 * seconds) + 60, int(4 * seconds) + 60)
        return True
    return False


class Trainer:
    """A run of ``RunParts`` (``parts.py``): ``fit`` runs the step loop in ``run_dir``, resuming
    from and writing checkpoints, logging metrics and evaluating."""

    def __init__(self, cfg: DictConfig, env: DistEnv):
        self.startup = StartupTimes()  # where the start-up goes, from the process's start to the first step
        self.cfg, self.env = validate(cfg), env
        self.main = env.rank == 0
        self.run_dir = resolve_run_dir(cfg, env)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.lock = self._lock_run_dir()  # before anything is built: a second run stops at once
        self.status = RunStatus(self.run_dir, enabled=self.main)  # status.json: running, then how it ended
        self.status.start()
        if self.main and (warning := recipe_warning(cfg)):
            log.warning(warning)
        self.parts: RunParts | None = None
        try:
            self._build()
        except BaseException as error:  # a failed start leaves no workers, spill file or lock behind
            self.status.fail(error)
            if self.parts is not None:
                self.parts.close()
            if self.lock is not None:
                self.lock.release()
            raise

    def _build(self) -> None:
        cfg, env = self.cfg, self.env
        with self.startup.phase("backends"):
            settings = configure_backends(cfg, env.device)  # process-wide, once, before anything is built
        for setting in settings:
            if self.main:
                log.info("backends: %s", setting)
        # model.compile: the towers compile in fit(), while the loader's workers start reading
        self.parts = RunParts.build(cfg, env, warm_up=False, times=self.startup)
        self.model, self.plan, self.stepper = self.parts.model, self.parts.plan, self.parts.step
        self.sharded = is_sharded(self.model)  # FSDP across several ranks
        self.sharded_ckpt = cfg.trainer.parallel == "fsdp"  # DCP folders, also on one rank
        self.step = self.samples_seen = 0
        self.bad_in_a_row = self.skipped_steps = 0  # steps whose update a non-finite value skipped
        self.grad_norm = float("nan")
        self.unsettled: StepResult | None = None  # the last step, its update's flag not yet read (settle)
        self.interval = Interval()  # the steps since the last log line
        self.unlogged_first_step_s: float | None = None  # time_to_first_step_s, for the next log record
        self.progress: tqdm | None = None  # the steps' progress bar, in fit
        self.warned_shutdown = False  # that checkpoints outlast torchrun's patience after a signal
        with self.startup.phase("resume"):
            self._resume()
        # steps after the checkpoint are redone: each logged once
        self.metrics = MetricsLogger(self.run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True), self.main,
                                     resumed_step=self.step, sweep=sweep_job())
        self.stops = StopRequests(parse_duration(cfg.trainer.time_limit), env.distributed, env.control_group)

    def _lock_run_dir(self) -> RunLock | None:
        """Rank 0 locks the run directory; every rank learns whether it could (and fails alike)."""
        lock, error = (RunLock(self.run_dir), None) if self.main else (None, None)
        if lock is not None:
            try:
                lock.acquire()
            except ConfigError as failed:
                error = str(failed)
        if self.env.distributed:
            holder = [error]
            dist.broadcast_object_list(holder, src=0)
            error = holder[0]
        if error is not None:
            raise ConfigError(error)
        return lock

    def _resume(self) -> None:
        found = agreed_resume(self.cfg.resume, self.run_dir, self.env.rank)
        if found is None:
            existing = run_checkpoints(self.ckpt_dir)
            if existing and not self.cfg.overwrite:
                raise ConfigError(
                    f"{self.ckpt_dir} holds checkpoints ({existing[0].name} ...): continue that run with "
                    "resume=latest, start a new one with name=<new name>, or pass overwrite=true"
                )
            return
        path, state = found
        if path.is_dir():  # a sharded checkpoint (any number of ranks wrote it): each rank reads its part
            load_sharded_state(path, self.model, self.parts.optimizer)
        elif self.sharded:  # a whole-model .pt (a DDP run's): each rank keeps its shard of it
            load_whole_state(state, self.model, self.parts.optimizer)
        else:
            self.model.load_state_dict(state["model"])
            self.parts.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.stepper.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        # samples seen so far (checkpoints before it was stored: the steps at the checkpoint's batch)
        self.samples_seen = int(state.get("samples_seen", self.step * int(state["global_batch"])))
        if int(state["global_batch"]) != self.plan.global_batch:
            log.warning("checkpoint trained with batch=%s, resuming with %s: the data order "
                        "within the epoch changes", state["global_batch"], self.plan.global_batch)
        rng = state["rng"]
        if len(rng) == self.env.world_size:
            restore_rng(rng[self.env.rank])
        self._log_data_order_on_resume(len(rng), state.get("loader_slots"))
        log.info("resumed from %s at step %d", path, self.step)

    def _log_data_order_on_resume(self, ranks_before: int, slots_before: int | None) -> None:
        """Say whether the resumed run reads what the uninterrupted one would have (rank 0)."""
        train, ranks, split = self.cfg.data.train, self.env.world_size, self.parts.data.split
        slots = ranks * max(1, int(self.cfg.data.num_workers))
        if not self.main:
            return
        if split == "shard" and (train.mode == "resampled" or slots_before not in (None, slots)):
            log.warning("data.train.split=shard deals the shards to ranks x loader workers = %d slots (%s before "
                        "this resume): the rest of the run reads %s. data.train.split=indexed reads the same "
                        "samples in the same order on any number of GPUs and workers", slots,
                        slots_before or "unknown", "other shard draws" if train.mode == "resampled" else
                        "this epoch in another order, some samples twice and some not at all")
        elif ranks_before != ranks:
            log.info("resumed on %d ranks (%d before): the same samples in the same steps, each augmented as "
                     "before (data.train.split=%s); only the towers' random draws (dropout, patch dropout), "
                     "per rank, start from new seeds", ranks, ranks_before, split)

    def _weights_finite(self) -> bool:
        """Whether every weight is finite (the same answer on every rank: replicas agree, and
        FSDP's shards are checked together)."""
        finite = torch.stack([torch.isfinite(local(p)).all() for p in self.model.parameters()]).all()
        if self.sharded and self.env.distributed:
            flag = finite.float().reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = flag[0] > 0
        return bool(finite)

    def _checkpoint(self, numbered: bool) -> None:
        started = time.perf_counter()
        self._write_checkpoint(numbered)
        if self.main and not self.warned_shutdown:  # once a run
            self.warned_shutdown = warn_if_torchrun_may_cut(time.perf_counter() - started)

    def _write_checkpoint(self, numbered: bool) -> None:
        if not self._weights_finite():
            log.error("step %d: the weights are not finite; no checkpoint written (the last finite ones in %s "
                      "are kept)", self.step, self.ckpt_dir)
            return
        rng = capture_rng()
        if self.env.distributed:  # every rank's RNG, so a resumed run continues each exactly
            gathered = [None] * self.env.world_size
            dist.all_gather_object(gathered, rng)
            rng = gathered
        else:
            rng = [rng]
        meta = {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "global_batch": self.plan.global_batch,
            "loader_slots": self.env.world_size * max(1, int(self.cfg.data.num_workers)),  # the shard split's
            "rng": rng,
            "config": OmegaConf.to_yaml(self.cfg, resolve=True),
            "open_clip": self.model.description(),  # architecture and preprocessing, for evaluation and export
        }
        if self.stepper.scaler.is_enabled():
            meta["scaler"] = self.stepper.scaler.state_dict()
        keep = self.cfg.trainer.keep_ckpts
        if self.sharded_ckpt:  # every rank writes its shards
            write_sharded_checkpoint(self.ckpt_dir, self.model, self.parts.optimizer, meta if self.main else None,
                                     self.step, numbered, keep)
        elif self.main:
            payload = {"model": self.model.state_dict(), "optimizer": self.parts.optimizer.state_dict(), **meta}
            write_run_checkpoint(self.ckpt_dir, payload, self.step, numbered, keep)

    def evaluate(self, final: bool) -> dict[str, dict[str, float]]:
        """Evaluate the sets due now (``eval.<name>.at_end`` when ``final``, else those whose
        ``every`` divides the step), each logged under ``eval/<name>/``. Rank 0 evaluates alone,
        set after set, while the other ranks wait at the next collective: together the sets must
        finish within ``trainer.dist_timeout_s``. A sharded model (FSDP) is evaluated by every rank
        together (each forward gathers the weights from all of them); rank 0 reports."""
        due = [s for s in self.cfg.eval.values() if (s.at_end if final else s.every and self.step % s.every == 0)]
        if not due or not (self.main or self.sharded):
            return {}
        started, results = time.perf_counter(), {}
        for eval_cfg in due:
            result = run_zeroshot(self.model, self.parts.tokenize, eval_cfg, self.cfg.data, self.env.device)
            if not self.main:
                continue
            log.info("eval %s at step %d: %s", eval_cfg.name, self.step,
                     ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
            self.metrics.log({f"eval/{eval_cfg.name}/{k}": v for k, v in result.items()}, self.step)
            results[eval_cfg.name] = result
        seconds = time.perf_counter() - started
        if self.env.distributed and not self.sharded and seconds > 0.5 * self.cfg.trainer.dist_timeout_s:
            log.warning("evaluation took %.0f s on rank 0, more than half of trainer.dist_timeout_s=%s that the "
                        "other ranks wait: raise trainer.dist_timeout_s or evaluate less (eval.<name>.every)",
                        seconds, self.cfg.trainer.dist_timeout_s)
        return results

    def fit(self) -> float:
        cfg, plan, env = self.cfg, self.plan, self.env
        if self.main:
            log.info("run dir %s; %d steps of batch %d (%d ranks x %d sub-batches x %d) = %s samples, %d steps "
                     "per epoch, %s", self.run_dir, plan.total_steps, plan.global_batch, env.world_size,
                     plan.sub_batches, plan.sub_batch, f"{plan.total_steps * plan.global_batch:,}",
                     plan.steps_per_epoch, self.stepper.precision)
        # trainer.stop_at_step ends this invocation early (a time-limited job); resume=latest
        # continues it as if it had never stopped.
        stop = min(plan.total_steps, cfg.trainer.stop_at_step or plan.total_steps)
        with self.startup.phase("loader start"):
            sub_batches = self.parts.inputs(self.step)  # the loader's workers start reading now
        try:
            if cfg.model.compile:
                with self.startup.phase("compile"):
                    self.parts.warm_up()  # while the workers read the first sub-batches
            self.progress = tqdm(total=plan.total_steps, initial=self.step, disable=not self.main,
                                 desc="train", dynamic_ncols=True, mininterval=1.0, leave=False)
            # SIGTERM, SIGINT, SIGUSR1: stop after the step, checkpoint, exit 3; the handlers stay until
            # close(), so that a signal during a failure's report (torchrun ending the ranks) is counted
            self.stops.install()
            self.interval = Interval()
            loss = self._loop(sub_batches, stop)
        finally:
            if self.progress is not None:
                self.progress.close()
            sub_batches.close()  # the loader's workers and read-ahead thread
        return self._finish(loss, numbered_just_written=self._due(cfg.trainer.ckpt_every))

    def _loop(self, sub_batches, stop: int) -> torch.Tensor:
        """Steps until ``stop``; returns the last loss. A step, then what the trainer does with it."""
        loss, first_step, started = torch.zeros(()), self.step + 1, time.perf_counter()
        while self.step < stop:
            result = self.train_step(sub_batches)
            loss = result.loss
            if result.step == first_step:
                self.first_step_done(result, started)
            self.interval.add(result)
            self.progress.update(1)
            # a signal or trainer.time_limit: stop after this step, the same one on every rank
            stop_reason = self.stops.reason(result.seconds)
            if stop_reason or self.step == stop or self._due(self.cfg.trainer.log_every) \
                    or self._due(self.cfg.trainer.ckpt_every):
                self.settle()  # the loop acts on this step now: its update counts
            self.maybe_log(force=bool(stop_reason) or self.step == stop)
            self.maybe_stop()
            checkpointed = self.maybe_checkpoint()
            self.maybe_evaluate()
            if stop_reason:
                self.stop_here(stop_reason, checkpointed)
        self.stops.drain()
        return loss

    def train_step(self, sub_batches) -> StepResult:
        """One optimizer step on this rank's share of the global batch, ``world_size x sub_batches x
        sub_batch`` (1M = 2 x 1024 x 512): the learning rate, the data, forward, the global loss,
        backward (GradCache with several sub-batches), then the clipped update, skipped on every rank
        where a loss or gradient is not finite on one. The update's flag stays on the device: the
        last step's is read (``settle``) once this step's work is queued, so that the host does not
        wait for the GPU at the end of every step."""
        started = time.perf_counter()
        lr = self.parts.peak_lr * self.parts.schedule(self.step)
        for group in self.parts.optimizer.param_groups:
            group["lr"] = lr
        loss, times = self.stepper.gradients(sub_batches, epoch=self.step // self.plan.steps_per_epoch)
        self.settle()
        self.maybe_stop()  # too many skipped in a row: stop before this step's update
        applied = self.stepper.apply()
        times["optimizer"] = applied.seconds
        self.step += 1
        self.samples_seen += self.plan.global_batch
        self.unsettled = StepResult(self.step, loss, lr, applied, times, time.perf_counter() - started)
        return self.unsettled

    def first_step_done(self, result: StepResult, loop_started: float) -> None:
        """This invocation's first step (``result``; the loop started at ``loop_started``) has finished, its update
        read (a host sync): how long after the process started and where that time went, in the log,
        ``status.json`` and the next ``metrics.jsonl`` record (``time_to_first_step_s``, ``startup/*_s``)."""
        self.settle()
        step_s = time.perf_counter() - loop_started
        seconds, waited = self.startup.elapsed(), result.times.get("data", 0.0)
        self.startup.add("first batch wait", waited)  # what the loader had not read by then
        self.startup.add("first step", step_s - waited)
        if self.main:
            log.info("first step finished %.1f s after the start (model.compile: %s); start-up: %s",
                     seconds, f"{self.parts.compile_s:.1f} s of compiling" if self.cfg.model.compile else "off",
                     self.startup.describe())
        self.unlogged_first_step_s = seconds  # in the next log record
        self.status.note(time_to_first_step_s=round(seconds, 2), startup_s=self.startup.record())
        if self.env.local_rank == 0 and (compiling := write_missing_bytecode()):
            log.info("bytecode: the %d modules imported without it compile into %s in the background, for the "
                     "next start (MEGABATCH_PYCACHE=0: off)", compiling, sys.pycache_prefix)

    def settle(self) -> None:
        """Read the last step's update (a host sync; the one place its flag is read): its gradient
        norm, and whether it was skipped, counted and logged (``maybe_stop`` ends the run after too
        many in a row)."""
        result, self.unsettled = self.unsettled, None
        if result is None:
            return
        self.grad_norm = result.applied.grad_norm
        if result.applied.stepped:
            self.bad_in_a_row = 0
            return
        self.bad_in_a_row += 1
        self.skipped_steps += 1
        log.warning("step %d: non-finite loss (%.4g) or gradient norm (%.4g) on some rank: update skipped "
                    "(%d in a row, %d in all; the run stops after trainer.max_bad_steps=%d in a row)",
                    result.step, float(result.loss), self.grad_norm, self.bad_in_a_row, self.skipped_steps,
                    self.cfg.trainer.max_bad_steps)

    def _due(self, every: int | None) -> bool:
        """Whether a task done every ``every`` steps (0 or ``None``: never) falls on this step."""
        return bool(every) and self.step % every == 0

    def maybe_log(self, force: bool = False) -> None:
        """The log line of the steps since the last one: every ``trainer.log_every`` steps, at a stop
        (``force``) and before the run ends on non-finite steps."""
        diverged = self.bad_in_a_row >= self.cfg.trainer.max_bad_steps
        if self.interval.steps and (force or diverged or self._due(self.cfg.trainer.log_every)):
            self._log_interval(self.interval)
            self.interval = Interval()

    def maybe_stop(self) -> None:
        """End the run after ``trainer.max_bad_steps`` skipped updates in a row, logged first."""
        limit = self.cfg.trainer.max_bad_steps
        if self.bad_in_a_row < limit:
            return
        self.maybe_log()
        raise NonFiniteError(
            f"{self.bad_in_a_row} steps in a row (to step {self.step}) had a non-finite loss or "
            f"gradient: stopping (trainer.max_bad_steps={limit}). The weights are those of the last "
            f"finite step; the newest checkpoint is in {self.ckpt_dir}. Lower optim.lr, set "
            "optim.grad_clip, or use trainer.precision=bf16 instead of fp16")

    def maybe_checkpoint(self) -> bool:
        """A numbered checkpoint every ``trainer.ckpt_every`` steps; whether one was written."""
        if not self._due(self.cfg.trainer.ckpt_every):
            return False
        self._checkpoint(numbered=True)
        return True

    def maybe_evaluate(self) -> None:
        """The sets whose ``eval.<name>.every`` divides the step (the final evaluation is ``_finish``'s)."""
        if self.step < self.plan.total_steps:
            self.evaluate(final=False)

    def stop_here(self, reason: str, checkpointed: bool) -> None:
        """A signal or ``trainer.time_limit``: ``last.pt`` (unless this step's numbered checkpoint was
        just written), every rank waits for it, then ``Preempted`` ends the run (exit 3)."""
        if not checkpointed:
            self._checkpoint(numbered=False)
        self._checkpoint_on_disk()  # no rank exits (and lets torchrun end the writer) before it
        self.stops.drain()
        log.warning("stopped after step %d (%s); last.pt written: continue with resume=latest name=%s",
                    self.step, reason, self.run_dir.name)
        raise Preempted(reason, self.step, self.ckpt_dir / "last.pt")

    def _checkpoint_on_disk(self) -> None:
        """Every rank waits here until rank 0 has written the step's checkpoint: a rank that exited
        first would let torchrun end the others (rank 0 mid-write among them). The wait has no
        timeout while rank 0 is alive (a 30 GB checkpoint may take longer than any collective's)."""
        if not self.env.distributed:
            return
        key = f"checkpoint_written/{self.step}"
        if self.env.peers is None:  # a process group made by the caller (tests): a barrier
            dist.barrier()
        elif self.main:
            self.env.peers.post(key)
        else:
            self.env.peers.wait_for(key, owner=0)

    def _log_interval(self, interval: Interval) -> None:
        """One log line, progress-bar postfix and metrics.jsonl record for the steps of ``interval``."""
        plan, env = self.plan, self.env
        steps, phase_totals, lr = interval.steps, interval.phase_totals, interval.last.lr
        elapsed = time.perf_counter() - interval.started
        loss_value = interval.last.loss.item()  # host sync, once per log interval
        record = {
            "loss": loss_value, "lr": lr,
            "logit_scale": self.model.logit_scale.exp().item(),
            "samples_per_s": plan.global_batch * steps / elapsed,
            "samples_seen": self.samples_seen,
            "epoch": self.step / plan.steps_per_epoch,
            **{f"time/{k}": v / steps for k, v in phase_totals.items()},
            "data_wait": phase_totals.get("data", 0.0) / elapsed,  # fraction of wall time
            "grad_norm": self.grad_norm, "skipped_steps": self.skipped_steps,
        }
        if self.unlogged_first_step_s is not None:
            record["time_to_first_step_s"], self.unlogged_first_step_s = self.unlogged_first_step_s, None
            record.update(self.startup.record())
        # model TFLOP/s per GPU and MFU (utilization.py: model FLOPs counted at start-up, the GPU's bf16 peak)
        record.update(utilization(self.parts.flops, self.parts.peak, record["samples_per_s"] / env.world_size))
        record.update({f"data/{k}": v for k, v in self.parts.inputs.bad_input_counts().items() if v})
        if env.device.type == "cuda":
            record["peak_gpu_gb"] = torch.cuda.max_memory_allocated(env.device) / 1e9
        record["peak_host_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # this process; kB on Linux
        self.progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", sps=f"{record['samples_per_s']:.0f}")
        self.metrics.log(record, self.step)
        if self.main:
            phases = " ".join(f"{k.split('/')[1]} {v:.2f}s" for k, v in record.items() if k.startswith("time/"))
            memory = f"  peak {record['peak_gpu_gb']:.1f} GB" if "peak_gpu_gb" in record else ""
            if "model_tflops_per_gpu" in record:
                memory += f"  {record['model_tflops_per_gpu']:.0f} TFLOP/s per GPU" + (
                    f", MFU {100 * record['mfu']:.1f}%" if "mfu" in record else "")
            bad = {k[5:]: v for k, v in record.items() if k.startswith("data/")}
            log.info("step %d/%d  loss %.4f  lr %.3g  logit_scale %.2f  %.0f samples/s  data wait %.0f%%  "
                     "[%s]%s%s", self.step, plan.total_steps, loss_value, lr, record["logit_scale"],
                     record["samples_per_s"], 100 * record["data_wait"], phases, memory,
                     f"  bad input: {bad}" if bad else "")

    def close(self) -> None:
        """Release what the run holds (offload workers and spill file, the wandb run, the run
        directory's lock), also after an error; put the signal handlers back."""
        self.stops.restore()
        self.parts.close()
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()

    def _finish(self, loss, numbered_just_written: bool) -> float:
        """Last checkpoint, final evaluation; the value a sweeper optimises."""
        plan = self.plan
        if self.main:
            bad = {k: v for k, v in self.parts.inputs.bad_input_counts().items() if v}
            log.info("bad input on rank 0: %s", bad or "none")
        if not numbered_just_written:
            self._checkpoint(numbered=False)
        if self.step < plan.total_steps:
            log.info("stopped at step %d of %d (trainer.stop_at_step); continue with "
                     "resume=latest name=%s", self.step, plan.total_steps, self.run_dir.name)
            return float(loss)
        results = self.evaluate(final=True)
        for name, result in results.items():
            print(summary(name, result), flush=True)
        if results:  # the first set's headline number is what a sweeper optimises
            return headline(next(iter(results.values())))
        return float(loss)
