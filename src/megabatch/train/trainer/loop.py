"""The training run: set-up, resume, the step loop, checkpoints, logs, evaluation.

What one rank trains with is built by ``RunParts`` (``parts.py``); one step and its outcome are
``TrainStep.step``'s (``step.py``); the sub-batches come from ``RunInputs`` (``inputs.py``).
``Trainer`` owns what outlives a step: the run directory, the counters (``TrainState``), and the
hooks after each step: the log (``StepLog``), the checkpoints (``Checkpointer``: every part saves its
own state), the evaluations and the stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from ...checkpoint.checkpointer import Checkpointer, RngStates, TrainState, legacy_parts
from ...checkpoint.files import load_checkpoint, load_resume, run_checkpoints
from ...config import ConfigError
from ...config.schema import recipe_warning, validate
from ...data.loading import configure_loading
from ...distributed import DistEnv, init_distributed
from ...distributed.fsdp import is_sharded
from ...distributed.health import FAILED, RankLost, describe, is_communication_error
from ...distributed.once import on_rank_zero
from ...eval import headline, result_name, run_zeroshot, summary, weights_to_evaluate
from ...eval.results import results_table, write_results
from ...report import RunStatus
from ...report.runs import failure
from ...runtime.bytecode import write_missing_bytecode
from ...runtime.process import configure_backends
from ...runtime.signals import end_children, ignore_stop_signals
from ..build.parts import RunParts
from ..build.startup import StartupTimes, run_ended
from ..step.objectives import States
from ..step.step import NonFiniteError, StepOutcome
from .lock import RunLock
from .metrics import MetricsLogger, RunFacts, StepLog
from .stops import Preempted, StopRequests

__all__ = ["NonFiniteError", "Trainer", "run"]

log = logging.getLogger("megabatch")


def run(cfg: DictConfig) -> float:
    """Train as configured; return the final zero-shot top-1 (or the last loss without eval)."""
    validate(cfg)  # every value, before a process group, a model or a loader exists
    env = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend, cfg.trainer.dist_timeout_s)
    trainer, ended = None, "failed"
    try:
        trainer = Trainer(cfg, env)  # cfg validated above
        result = trainer.fit()
        trainer.status.end("completed" if trainer.state.step >= trainer.plan.total_steps else "stopped", result=result)
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
        if ended.startswith(FAILED):
            end_children()  # workers not yet ended (a loader's, the offload's): killed after a bounded wait
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


def resumed_step(found: tuple[Path, dict] | None) -> int:
    """The step a run resuming from ``found`` (``agreed_resume``'s) starts at: 0 where it starts fresh."""
    return 0 if found is None else int(legacy_parts(found[1])["train_state"]["step"])


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
    from and writing checkpoints (``Checkpointer``), logging metrics (``StepLog``) and evaluating.
    ``cfg``: validated (``config.schema.validate``, which ``run`` calls before the process group exists)."""

    def __init__(self, cfg: DictConfig, env: DistEnv):
        self.startup = StartupTimes()  # where the start-up goes, from the process's start to the first step
        self.cfg, self.env = cfg, env
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
        self.metrics: StepLog | None = None
        self.checkpointer: Checkpointer | None = None
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
            # process-wide, once, before anything is built
            done = configure_backends(cfg, env.device) + configure_loading(cfg.data, env.device)
        for setting in done:
            if self.main:
                log.info("backends: %s", setting)
        with self.startup.phase("resume"):  # before the build: the loader starts reading at the step resumed from
            found = self._find_resume()
        # the loader's workers read from the plan on, while the step is built and (model.compile) the towers compile
        # in fit()
        self.parts = parts = RunParts.build(cfg, env, warm_up=False, times=self.startup,
                                            read_from=resumed_step(found))
        self.model, self.plan, self.step, self.settings = parts.model, parts.plan, parts.step, parts.settings
        self.state = TrainState()  # steps done, samples seen
        # each part saves and loads its own state; a new part is one more entry
        self.checkpointer = Checkpointer(
            self.ckpt_dir, self.model, parts.optimizer,
            {"train_state": self.state, "scaler": self.step.precision.scaler, "schedule": parts.schedule,
             "data_position": parts.inputs, "rng": RngStates(env.rank, env.world_size),
             **({"ema": self.step.ema} if self.step.ema is not None else {}),
             **({"objectives": objective_states} if (objective_states := States(self.step.objectives)).any else {})},
            header=self._checkpoint_header, sharded=self.settings.trainer.parallel == "fsdp",
            keep=self.settings.trainer.keep_ckpts, main=self.main, distributed=env.distributed,
            asynchronous=self.settings.trainer.ckpt_async)
        self.warned_shutdown = False  # that checkpoints outlast torchrun's patience after a signal
        with self.startup.phase("resume"):
            self._resume(found)
        # steps after the checkpoint are redone: each logged once
        sinks = MetricsLogger(self.run_dir, cfg.logger, OmegaConf.to_container(cfg, resolve=True), self.main,
                              resumed_step=self.state.step, sweep=sweep_job())
        facts = RunFacts(self.plan, env.world_size, env.device, parts.flops, parts.peak,
                         logit_scale=lambda: self.model.logit_scale, bad_input=parts.inputs.bad_input_counts,
                         startup=self.startup)
        self.metrics = StepLog(sinks, facts, self.settings.trainer.log_every, self.main)
        self.stops = StopRequests(self.settings.trainer.time_limit_s, env.distributed, env.control_group)

    def _checkpoint_header(self) -> dict:
        """What a checkpoint's readers need beside the parts: the batch (the report's samples), the config
        and the model's architecture and preprocessing (evaluation and export)."""
        return {"global_batch": self.plan.global_batch, "config": OmegaConf.to_yaml(self.cfg, resolve=True),
                "open_clip": self.model.description()}

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

    def _find_resume(self) -> tuple[Path, dict] | None:
        """The checkpoint this run resumes from (``agreed_resume``), or None for a fresh start, which a run directory
        holding checkpoints allows only with ``overwrite=true``."""
        found = agreed_resume(self.cfg.resume, self.run_dir, self.env.rank)
        if found is None:
            existing = run_checkpoints(self.ckpt_dir)
            if existing and not self.cfg.overwrite:
                raise ConfigError(
                    f"{self.ckpt_dir} holds checkpoints ({existing[0].name} ...): continue that run with "
                    "resume=latest, start a new one with name=<new name>, or pass overwrite=true"
                )
        return found

    def _resume(self, found: tuple[Path, dict] | None) -> None:
        if found is None:
            return
        path, state = found
        self.checkpointer.load(path, state)
        log.info("resumed from %s at step %d", path, self.state.step)

    def evaluate(self, due: list) -> dict[str, dict[str, float]]:
        """Evaluate the sets ``due`` (``eval.<name>``: those whose ``every`` divides the step, or at the end those
        with ``at_end``), each logged under ``eval/<name>/``. Every rank evaluates together, set after set: each
        encodes its share of the set and the numbers are the whole set's (``eval/ranks.py``). A sharded model
        (FSDP) runs under the run's autocast, as it trains: FSDP hands the blocks' outputs on in bf16 to norms it
        keeps in fp32; rank 0 reports."""
        step, sharded = self.state.step, is_sharded(self.model)
        results, ema = {}, self.step.ema
        for eval_cfg in due:
            for weights in weights_to_evaluate(eval_cfg.weights, ema is not None):
                started = time.perf_counter()
                with self.step.precision.autocast() if sharded else contextlib.nullcontext(), \
                        ema.swapped() if weights == "ema" else contextlib.nullcontext():
                    result = run_zeroshot(self.model, self.parts.tokenize, eval_cfg, self.settings.data,
                                          self.env.device)
                if not self.main:
                    continue
                name = result_name(eval_cfg.name, weights)
                log.info("eval %s at step %d (%.1f s, %d ranks): %s", name, step, time.perf_counter() - started,
                         self.env.world_size, ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
                self.metrics.log({f"eval/{name}/{k}": v for k, v in result.items()}, step)
                results[name] = result
        return results

    def fit(self) -> float:
        plan, env = self.plan, self.env
        if self.main:
            log.info("run dir %s; %d steps of batch %d (%d ranks x %d sub-batches x %d) = %s samples, %d steps "
                     "per epoch, %s", self.run_dir, plan.total_steps, plan.global_batch, env.world_size,
                     plan.sub_batches, plan.sub_batch, f"{plan.total_steps * plan.global_batch:,}",
                     plan.steps_per_epoch, self.step.precision)
        # trainer.stop_at_step ends this invocation early (a time-limited job); resume=latest
        # continues it as if it had never stopped.
        stop = min(plan.total_steps, self.settings.trainer.stop_at_step or plan.total_steps)
        sub_batches, self.parts.reading = self.parts.reading, None  # started by the build at the step resumed from
        if sub_batches is None:
            with self.startup.phase("loader start"):
                sub_batches = self.parts.inputs(self.state.step)  # the loader's workers start reading now
        try:
            if self.settings.model.compile:
                with self.startup.phase("compile"):
                    self.parts.warm_up()  # while the workers read the first sub-batches
            # SIGTERM, SIGINT, SIGUSR1: stop after the step, checkpoint, exit 3; the handlers stay until
            # close(), so that a signal during a failure's report (torchrun ending the ranks) is counted
            self.stops.install()
            self.metrics.start(self.state.step)
            try:
                loss = self._loop(sub_batches, stop)
            except (Preempted, NonFiniteError):  # the steps since the last log line are logged too
                self.metrics.write(self.state.step, self.state.samples_seen, self.step.settle())
                raise
        finally:
            self.metrics.close()
            sub_batches.close()  # the loader's workers and read-ahead thread
        return self._finish(loss)

    def _loop(self, sub_batches, stop: int) -> torch.Tensor:
        """Steps until ``stop``; returns the last loss. The step, then the hooks: log, checkpoint,
        evaluation, stop. Each reads the trainer's state alone and may run in any order."""
        # one counter: self.state.step, the steps done (the schedule's and the epoch's position before a step, the
        # step's number after it)
        loss, first_step, started = torch.zeros(()), self.state.step + 1, time.perf_counter()
        while self.state.step < stop:
            lr = self.parts.peak_lr * self.parts.schedule(self.state.step)
            outcome = self.step.step(sub_batches, lr, epoch=self.state.step // self.plan.steps_per_epoch,
                                     number=self.state.step + 1)
            self.state.step += 1
            self.state.samples_seen += self.plan.global_batch
            loss = outcome.loss
            # a signal or trainer.time_limit: stop after this step, the same one on every rank
            stop_reason = self.stops.reason(outcome.seconds)
            last = self.state.step == stop
            log_every, ckpt_every = self.settings.trainer.log_every, self.settings.trainer.ckpt_every
            if stop_reason or last or (log_every and self.state.step % log_every == 0) or \
                    (ckpt_every and self.state.step % ckpt_every == 0):
                self.step.settle()  # host sync: the hooks act on this step (its log line, its checkpoint)
            if self.state.step == first_step:
                self.first_step_done(outcome, started)
            self.metrics.on_step(outcome, self.state.step, self.state.samples_seen, self.step.health,
                                 force=bool(stop_reason) or last)
            self.checkpoint_if_due()
            self.evaluate_if_due()
            self.stop_if_asked(stop_reason)
        self.stops.drain()
        return loss

    def first_step_done(self, outcome: StepOutcome, loop_started: float) -> None:
        """This invocation's first step (``outcome``; the loop started at ``loop_started``) has finished, its update
        read (a host sync): how long after the process started and where that time went, in the log,
        ``status.json`` and the next ``metrics.jsonl`` record (``time_to_first_step_s``, ``startup/*_s``)."""
        self.step.settle()
        step_s = time.perf_counter() - loop_started
        seconds, waited = self.startup.elapsed(), outcome.times.get("data", 0.0)
        self.startup.add("first batch wait", waited)  # what the loader had not read by then
        self.startup.add("first step", step_s - waited)
        if self.main:
            log.info("first step finished %.1f s after the start (model.compile: %s); start-up: %s",
                     seconds, f"{self.parts.compile_s:.1f} s of compiling" if self.settings.model.compile else "off",
                     self.startup.describe())
        self.metrics.first_step_s = seconds  # in the next log record
        self.status.note(time_to_first_step_s=round(seconds, 2), startup_s=self.startup.record())
        if self.env.local_rank == 0 and (compiling := write_missing_bytecode()):
            log.info("bytecode: the %d modules imported without it compile into %s in the background, for the "
                     "next start (MEGABATCH_PYCACHE=0: off)", compiling, sys.pycache_prefix)

    def checkpoint_if_due(self) -> None:
        """A numbered checkpoint every ``trainer.ckpt_every`` steps (once a step)."""
        every = self.settings.trainer.ckpt_every
        if every and self.state.step % every == 0 and self.checkpointer.saved_step != self.state.step:
            self._checkpoint(numbered=True)

    def evaluate_if_due(self) -> None:
        """The sets whose ``eval.<name>.every`` divides the step (the final evaluation is ``_finish``'s)."""
        step = self.state.step
        due = [s for s in self.cfg.eval.values() if s.every and step % s.every == 0]
        if due and step < self.plan.total_steps:
            self.evaluate(due)

    def stop_if_asked(self, reason: str | None) -> None:
        """End the run after this step: ``NonFiniteError`` after ``trainer.max_bad_steps`` skipped updates in a
        row (as read so far); on a signal or ``trainer.time_limit`` (``reason``), this step's checkpoint (the
        numbered one where one is due), every rank waiting for it, then ``Preempted`` (exit 3)."""
        if self.step.health.diverged:
            raise NonFiniteError.of(self.step.health)
        if not reason:
            return
        if self.checkpointer.saved_step != self.state.step:
            every = self.settings.trainer.ckpt_every
            self._checkpoint(numbered=bool(every) and self.state.step % every == 0)
        self._wait_for_checkpoint()  # no rank exits (and lets torchrun end the writer) before it
        self.stops.drain()
        log.warning("stopped after step %d (%s); last.pt written: continue with resume=latest name=%s",
                    self.state.step, reason, self.run_dir.name)
        raise Preempted(reason, self.state.step, self.ckpt_dir / "last.pt")

    def _checkpoint(self, numbered: bool) -> None:
        started = time.perf_counter()
        self.checkpointer.save(self.state.step, numbered)
        if self.main and not self.warned_shutdown:  # once a run; written in the background: the last write's time
            self.warned_shutdown = warn_if_torchrun_may_cut(max(time.perf_counter() - started,
                                                                self.checkpointer.write_s))

    def _wait_for_checkpoint(self) -> None:
        """Every rank waits here until rank 0 has written the step's checkpoint: a rank that exited
        first would let torchrun end the others (rank 0 mid-write among them). The wait has no
        timeout while rank 0 is alive (a 30 GB checkpoint may take longer than any collective's). Rank 0 first waits
        for its own write (``trainer.ckpt_async``)."""
        self.checkpointer.wait()
        if not self.env.distributed:
            return
        key = f"checkpoint_written/{self.state.step}"
        if self.env.peers is None:  # a process group made by the caller (tests): a barrier
            dist.barrier()
        elif self.main:
            self.env.peers.post(key)
        else:
            self.env.peers.wait_for(key, owner=0)

    def close(self) -> None:
        """Release what the run holds (offload workers and spill file, the wandb run, the run
        directory's lock), also after an error; put the signal handlers back."""
        self.stops.restore()
        try:  # a checkpoint still being written is finished, also after an error
            if self.checkpointer is not None:
                self.checkpointer.close()
        except Exception:  # noqa: BLE001 - the run's own error, if any, is the one to raise
            log.exception("the checkpoint being written when the run ended could not be written")
        self.parts.close()
        if self.metrics is not None:
            self.metrics.sinks.close()
        if self.lock is not None:
            self.lock.release()

    def _finish(self, loss) -> float:
        """Last checkpoint, final evaluation; the value a sweeper optimises."""
        plan, step = self.plan, self.state.step
        if self.main:
            bad = {k: v for k, v in self.parts.inputs.bad_input_counts().items() if v}
            log.info("bad input on rank 0: %s", bad or "none")
        if self.checkpointer.saved_step != step:
            self._checkpoint(numbered=False)
        self.checkpointer.wait()  # the last checkpoint on disk before the run reports it (and evaluates)
        if step < plan.total_steps:
            log.info("stopped at step %d of %d (trainer.stop_at_step); continue with "
                     "resume=latest name=%s", step, plan.total_steps, self.run_dir.name)
            return float(loss)
        results = self.evaluate([s for s in self.cfg.eval.values() if s.at_end])
        for name, result in results.items():
            print(summary(name, result), flush=True)
        if results and self.main:  # the last checkpoint's table: every set's metrics, the main metrics' average
            csv_path, _ = write_results(self.ckpt_dir / "last", results, step=step)
            log.info("results of the last checkpoint -> %s (and .json)\n%s", csv_path, results_table(results))
        if results:  # the first set's headline number is what a sweeper optimises
            return headline(next(iter(results.values())))
        return float(loss)
