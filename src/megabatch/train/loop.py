"""The training run: set-up, the step loop, checkpoints, evaluation."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from ..config import ConfigError
from ..data import TrainData
from ..data.read_ahead import ReadAhead
from ..distributed import DistEnv, init_distributed
from ..eval import run_zeroshot
from ..models import build_tokenizer
from .checkpoint import (
    capture_rng,
    find_resume_path,
    load_checkpoint,
    restore_rng,
    write_run_checkpoint,
)
from .gradcache import encode_without_graph, loss_and_feature_grads, replay
from .metrics import MetricsLogger
from .optim import build_optimizer
from .plan import BatchPlan
from .precision import DTYPES, grad_scaler, resolve_precision
from .step import forward_backward

log = logging.getLogger("megabatch")


def run(cfg: DictConfig) -> float:
    """Train as configured; return the final zero-shot top-1 (or the last loss without eval)."""
    env = init_distributed(cfg.trainer.device, cfg.trainer.dist_backend, cfg.trainer.dist_timeout_s)
    try:
        return Trainer(cfg, env).fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def resolve_run_dir(cfg: DictConfig, env: DistEnv) -> Path:
    """``cfg.run_dir`` if set, else Hydra's output dir; rank 0's choice wins on every rank."""
    run_dir = cfg.get("run_dir")
    if not run_dir:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    if env.distributed:
        holder = [str(run_dir)]
        dist.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    return Path(run_dir)


def read_ahead_budget(prefetch_gb, offload: bool) -> float:
    """Bytes the loader may be read ahead into (``trainer.prefetch_gb``). ``auto``: 8 GB, or none
    with data offload, whose point is a small host footprint: there the replay's re-decode workers
    already use the cores, and a 1M step measured no faster with it, and 13 GB larger
    (docs/bench/offload_1M_spill_readahead_h100.json against offload_1M_spill_h100.json)."""
    if prefetch_gb == "auto":
        return 0.0 if offload else 8e9
    if isinstance(prefetch_gb, bool) or not isinstance(prefetch_gb, (int, float)) or prefetch_gb < 0:
        raise ConfigError(f"trainer.prefetch_gb={prefetch_gb!r}: give the host memory (GB per rank) the "
                          "loader may read ahead into, e.g. trainer.prefetch_gb=8, 0 to turn it off, or auto")
    return float(prefetch_gb) * 1e9


class Trainer:
    """Holds what a run builds once; ``fit`` runs the step loop."""

    def __init__(self, cfg: DictConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.main = env.rank == 0
        self.run_dir = resolve_run_dir(cfg, env)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        self.model = instantiate(cfg.model, _convert_="all").to(env.device)
        self.tokenize = build_tokenizer(**cfg.model.text)
        self.data = TrainData(cfg.data, self.tokenize, cfg.model.image.image_size, cfg.seed)
        self.plan = self._plan_batches()
        self.loss_fn = instantiate(cfg.loss)
        self.optimizer, self.peak_lr = build_optimizer(cfg.optim, self.model, self.plan.global_batch)
        self.schedule = instantiate(
            cfg.sched, total_steps=self.plan.total_steps, global_batch=self.plan.global_batch
        )
        self.precision = resolve_precision(cfg.trainer.precision, env.device)
        if env.device.type == "cuda":  # TF32 for fp32 matmuls (the loss on fp32 features)
            torch.backends.cuda.matmul.allow_tf32 = bool(cfg.trainer.get("tf32", True))
            torch.backends.cudnn.allow_tf32 = bool(cfg.trainer.get("tf32", True))
        self.scaler = grad_scaler(self.precision, env.device)
        self.offload = bool(cfg.trainer.get("offload", False))
        if cfg.trainer.get("offload_dir") and not self.offload:
            raise ConfigError("trainer.offload_dir is set but trainer.offload=false; set trainer.offload=true "
                              "or drop trainer.offload_dir")
        self.read_ahead_bytes = read_ahead_budget(cfg.trainer.get("prefetch_gb", "auto"), self.offload)
        self.data.spill_to(cfg.trainer.get("offload_dir") if self.offload else None, env.rank)
        self.data_stats: dict = {}
        self.feature_dtype = DTYPES[cfg.trainer.get("feature_dtype", "fp32")]
        self.step = 0
        torch.manual_seed(cfg.seed + 1000 * env.rank)  # per-rank randomness (dropout, ...)
        self._resume()
        self.ddp = (
            DDP(self.model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
            if env.distributed else self.model
        )
        self.metrics = MetricsLogger(
            self.run_dir, cfg.logger.get("wandb"), OmegaConf.to_container(cfg, resolve=True), self.main
        )

    def _plan_batches(self) -> BatchPlan:
        """The batch arithmetic, with the epoch length the data can give every rank."""
        cfg, world = self.cfg, self.env.world_size
        plan = BatchPlan.from_config(cfg, world, self.data.num_samples)
        steps = self.data.steps_per_epoch(plan.global_batch, world, plan.sub_batch)
        if steps == plan.steps_per_epoch:
            return plan
        if steps == 0:  # shard split: each worker of each rank fills only its own shards
            raise ConfigError(f"batch={plan.global_batch} is larger than what the shards give each of "
                              f"{world} ranks x {self.data.workers} workers in one epoch; lower batch or "
                              "data.num_workers")
        return BatchPlan.from_config(cfg, world, self.data.num_samples, steps_per_epoch=steps)

    def _resume(self) -> None:
        path = find_resume_path(self.cfg.get("resume"), self.run_dir)
        if path is None:
            if (self.ckpt_dir / "last.pt").exists() and not self.cfg.get("overwrite"):
                raise ConfigError(
                    f"{self.ckpt_dir / 'last.pt'} exists: continue that run with resume=latest, "
                    "start a new one with name=<new name>, or pass overwrite=true"
                )
            return
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        if int(state["global_batch"]) != self.plan.global_batch:
            log.warning("checkpoint trained with batch=%s, resuming with %s: the data order "
                        "within the epoch changes", state["global_batch"], self.plan.global_batch)
        rng = state["rng"]
        if len(rng) == self.env.world_size:
            restore_rng(rng[self.env.rank])
        else:
            log.warning("checkpoint has RNG states of %d ranks, this run has %d: RNG reseeded",
                        len(rng), self.env.world_size)
        log.info("resumed from %s at step %d", path, self.step)

    def _checkpoint(self, numbered: bool) -> None:
        rng = capture_rng()
        if self.env.distributed:  # every rank's RNG, so a resumed run continues each exactly
            gathered = [None] * self.env.world_size
            dist.all_gather_object(gathered, rng)
            rng = gathered
        else:
            rng = [rng]
        if not self.main:
            return
        payload = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "global_batch": self.plan.global_batch,
            "rng": rng,
            "config": OmegaConf.to_yaml(self.cfg, resolve=True),
        }
        if self.scaler.is_enabled():
            payload["scaler"] = self.scaler.state_dict()
        keep = self.cfg.trainer.get("keep_ckpts")
        write_run_checkpoint(self.ckpt_dir, payload, self.step, numbered, keep)

    def _sub_batches(self):
        """This rank's sub-batches ``(images, texts, raw, stats)`` from the current step to the end
        of the run, across epochs (``plan.sub_batches`` per step). Records the loader workers'
        counts of bad input in ``self.data_stats``."""
        plan = self.plan
        budget = self.read_ahead_bytes
        while self.step < plan.total_steps:
            epoch, start = divmod(self.step, plan.steps_per_epoch)
            loader = iter(self.data.loader(epoch, start, plan.rank_batch, self.env.rank,
                                           self.env.world_size, plan.steps_per_epoch,
                                           sub_batch=plan.sub_batch,
                                           keep_raw=self.offload and not self.model.frozen("image"),
                                           pin_memory=self.env.device.type == "cuda"))
            # workers keep decoding through the loss and the replay (see data/read_ahead.py); only
            # steps with a replay: a one-sub-batch step has nothing to hide it behind, and read ahead
            # it measured 8% slower at batch 512 (docs/bench/gradcache_32k_loader_readahead_warm_h200.json)
            reads_ahead = budget > 0 and int(self.cfg.data.num_workers) > 0 and plan.sub_batches > 1
            ahead = ReadAhead(loader, budget) if reads_ahead else None
            try:
                for batch in ahead if ahead is not None else loader:
                    if getattr(batch, "stats", None):
                        self.data_stats[(epoch, batch.stats["worker"])] = batch.stats
                    if getattr(batch, "raw", None) is not None:  # offload: the bytes or their place on disk
                        batch = batch._replace(raw=self.data.keep(batch.raw))
                    yield batch
            finally:
                if ahead is not None:
                    ahead.close()

    def bad_input_counts(self) -> dict[str, int]:
        """This rank's bad-input counts so far (summed over loader workers and epochs)."""
        totals: dict[str, int] = {}
        for stats in self.data_stats.values():
            for kind, count in stats.items():
                if kind != "worker":
                    totals[kind] = totals.get(kind, 0) + count
        return totals

    def gradients(self, sub_batches) -> tuple[torch.Tensor, dict[str, float]]:
        """Accumulate this step's gradients (DDP-averaged) into ``.grad``; return the loss and
        per-phase seconds. One sub-batch: a plain forward/backward. Several: GradCache."""
        plan, env, times = self.plan, self.env, {}
        self.data.release_kept()  # the last step's kept bytes are no longer needed
        if plan.sub_batches == 1:
            start = time.perf_counter()
            images, texts = next(sub_batches)[:2]
            times["data"] = time.perf_counter() - start
            images, texts = images.to(env.device, non_blocking=True), texts.to(env.device)
            start = time.perf_counter()
            loss = forward_backward(self.ddp, self.loss_fn, images, texts, self.precision,
                                    env.device, self.scaler)
            times["forward_backward"] = time.perf_counter() - start
            return loss, times
        # global batch = world_size x sub_batches x sub_batch, e.g. 1M = 2 x 1024 x 512
        progress = tqdm(total=2 * plan.sub_batches, desc=f"step {self.step + 1} encode",
                        leave=False, disable=not self.main or plan.sub_batches < 8,
                        dynamic_ncols=True, position=1, unit="sub-batch")
        start = time.perf_counter()
        replay_images, replay_texts = not self.model.frozen("image"), not self.model.frozen("text")
        encoded = encode_without_graph(self.model, sub_batches, plan.sub_batches, plan.sub_batch,
                                       self.precision, env.device, self.feature_dtype,
                                       self.offload, progress, keep_images=replay_images)
        times["data"] = encoded.data_s
        times["encode"] = self._lap(start) - encoded.data_s
        start = time.perf_counter()
        grads = loss_and_feature_grads(self.loss_fn, encoded, self.model.logit_scale,
                                       self.scaler if self.scaler.is_enabled() else None)
        times["loss"] = self._lap(start)
        progress.set_description(f"step {self.step + 1} replay")
        start = time.perf_counter()
        again = (self.data.redecode(encoded.raw, self.step // plan.steps_per_epoch)
                 if self.offload and replay_images else None)
        waited = replay(self.ddp, encoded, grads, plan.sub_batch, self.precision, env.device,
                        again, progress, replay_images=replay_images, replay_texts=replay_texts)
        times["data"] += waited
        times["replay"] = self._lap(start) - waited
        progress.close()
        return grads.loss, times

    def optimizer_step(self) -> None:
        """Clip the true (unscaled) gradient, step, clear the gradients, clamp the temperature."""
        self.scaler.unscale_(self.optimizer)
        if self.cfg.optim.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.cfg.optim.grad_clip))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.clamp_logit_scale()

    def _lap(self, start: float) -> float:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)  # host-device sync: honest phase times only
        return time.perf_counter() - start

    def evaluate(self) -> dict[str, float] | None:
        if not self.main or not self.cfg.eval.get("name"):
            return None
        result = run_zeroshot(self.model, self.tokenize, self.cfg.eval, self.cfg.data,
                              self.cfg.model.image.image_size, self.env.device)
        log.info("eval %s at step %d: %s", self.cfg.eval.name, self.step,
                 ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
        self.metrics.log({f"eval/{self.cfg.eval.name}/{k}": v for k, v in result.items()}, self.step)
        return result

    def fit(self) -> float:
        cfg, plan, env = self.cfg, self.plan, self.env
        if self.main:
            log.info("run dir %s; %d steps of batch %d (%d ranks x %d), %d steps per epoch, %s",
                     self.run_dir, plan.total_steps, plan.global_batch, env.world_size,
                     plan.rank_batch, plan.steps_per_epoch, self.precision)
        ckpt_every, log_every = int(cfg.trainer.ckpt_every or 0), int(cfg.trainer.log_every)
        eval_every = int(cfg.eval.get("every") or 0)
        progress = tqdm(total=plan.total_steps, initial=self.step, disable=not self.main,
                        desc="train", dynamic_ncols=True, mininterval=1.0, leave=False)
        # trainer.stop_at_step ends this invocation early (a time-limited job); resume=latest
        # continues it as if it had never stopped.
        stop = min(plan.total_steps, int(cfg.trainer.get("stop_at_step") or plan.total_steps))
        sub_batches = self._sub_batches()
        loss = torch.zeros(())
        tick, last_logged = time.perf_counter(), self.step
        phase_totals: dict[str, float] = {}
        while self.step < stop:
            # 1. learning rate for this step (peak lr x schedule multiplier)
            lr = self.peak_lr * self.schedule(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            # 2. data, forward, global loss, backward: this rank's share of the global batch;
            #    DDP averages the gradients across ranks once per step
            loss, times = self.gradients(sub_batches)
            # 3. clip the true (unscaled) gradient, step, clear, clamp the temperature
            start = time.perf_counter()
            self.optimizer_step()
            times["optimizer"] = self._lap(start)
            for phase, seconds in times.items():
                phase_totals[phase] = phase_totals.get(phase, 0.0) + seconds
            self.step += 1
            progress.update(1)
            if self.step % log_every == 0 or self.step == stop:
                elapsed, tick = time.perf_counter() - tick, time.perf_counter()
                steps, last_logged = self.step - last_logged, self.step
                self._log_interval(loss, lr, steps, elapsed, phase_totals, progress)
                phase_totals = {}
            if ckpt_every and self.step % ckpt_every == 0:
                self._checkpoint(numbered=True)
            if eval_every and self.step % eval_every == 0 and self.step < plan.total_steps:
                self.evaluate()
        progress.close()
        return self._finish(loss, numbered_just_written=bool(ckpt_every and self.step % ckpt_every == 0))

    def _log_interval(self, loss, lr: float, steps: int, elapsed: float,
                      phase_totals: dict[str, float], progress) -> None:
        """One log line, progress-bar postfix and metrics.jsonl record for the last ``steps``."""
        plan, env = self.plan, self.env
        loss_value = loss.item()  # host sync, once per log interval
        record = {
            "loss": loss_value, "lr": lr,
            "logit_scale": self.model.logit_scale.exp().item(),
            "samples_per_s": plan.global_batch * steps / elapsed,
            "epoch": self.step / plan.steps_per_epoch,
            **{f"time/{k}": v / steps for k, v in phase_totals.items()},
            "data_wait": phase_totals.get("data", 0.0) / elapsed,  # fraction of wall time
        }
        record.update({f"data/{k}": v for k, v in self.bad_input_counts().items() if v})
        if env.device.type == "cuda":
            record["peak_gpu_gb"] = torch.cuda.max_memory_allocated(env.device) / 1e9
        progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", sps=f"{record['samples_per_s']:.0f}")
        self.metrics.log(record, self.step)
        if self.main:
            phases = " ".join(f"{k.split('/')[1]} {v:.2f}s" for k, v in record.items() if k.startswith("time/"))
            memory = f"  peak {record['peak_gpu_gb']:.1f} GB" if "peak_gpu_gb" in record else ""
            bad = {k[5:]: v for k, v in record.items() if k.startswith("data/")}
            log.info("step %d/%d  loss %.4f  lr %.3g  logit_scale %.2f  %.0f samples/s  data wait %.0f%%  "
                     "[%s]%s%s", self.step, plan.total_steps, loss_value, lr, record["logit_scale"],
                     record["samples_per_s"], 100 * record["data_wait"], phases, memory,
                     f"  bad input: {bad}" if bad else "")

    def _finish(self, loss, numbered_just_written: bool) -> float:
        """Last checkpoint, final evaluation; the value a sweeper optimises."""
        cfg, plan = self.cfg, self.plan
        self.data.close()  # the offload re-decode workers
        if self.main:
            bad = {k: v for k, v in self.bad_input_counts().items() if v}
            log.info("bad input on rank 0: %s", bad or "none")
        if not numbered_just_written:
            self._checkpoint(numbered=False)
        if self.step < plan.total_steps:
            log.info("stopped at step %d of %d (trainer.stop_at_step); continue with "
                     "resume=latest name=%s", self.step, plan.total_steps, self.run_dir.name)
            self.metrics.close()
            return float(loss)
        result = self.evaluate() if cfg.eval.get("at_end", True) else None
        self.metrics.close()
        if result is not None and "top1" in result:
            print(f"zero-shot top-1 on {cfg.eval.name} (held out): {result['top1']:.2f}% "
                  f"(top-5 {result['top5']:.2f}%, {result['samples']} images)", flush=True)
            return result["top1"]
        if result is not None:
            print(f"{cfg.eval.name}: {result}", flush=True)
            return result.get("image_to_text_R@1", float(loss))
        return float(loss)
