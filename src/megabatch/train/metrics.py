"""Metrics sinks: ``metrics.jsonl`` in the run directory (always), TensorBoard (``logger=tensorboard``)
and wandb (``logger=wandb``), several at once (``'logger=[jsonl,tensorboard,wandb]'``)."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
        self.wandb = self.tensorboard = None
        if not enabled:
            return
        self.drop_after(resumed_step)
        wandb_cfg = logger_cfg.wandb if logger_cfg is not None else None
        tensorboard_cfg = logger_cfg.tensorboard if logger_cfg is not None else None
        if wandb_cfg is not None:
            import wandb  # only imported when asked for: GPU images may lack it

            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name or (f"{sweep[0]}/{sweep[1]}" if sweep else Path(run_dir).name),
                group=wandb_cfg.group or (sweep[0] if sweep else None),
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=wandb_cfg.id or wandb_run_id(run_dir),
            )
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
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
