"""Metrics sinks: ``metrics.jsonl`` in the run directory, and wandb when ``logger=wandb``."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def finite_or_none(value):
    """A non-finite float as ``None`` (JSON ``null``): ``metrics.jsonl`` stays strict JSON."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLogger:
    """Append one JSON object per record to ``<run_dir>/metrics.jsonl``; mirror to wandb if set.

    Only rank 0 should construct one with ``enabled=True``.
    """

    def __init__(self, run_dir: Path, wandb_cfg=None, config: dict | None = None, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = None
        if enabled and wandb_cfg is not None:
            import wandb  # only imported when asked for: GPU images may lack it

            self.wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name,
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=wandb_cfg.id,
            )

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

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
