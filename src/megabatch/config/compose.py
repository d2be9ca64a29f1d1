"""Compose the training config as ``python train.py <overrides>`` would, without a Hydra run (for
tests, benchmarks and notebooks)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONFIGS = Path(__file__).resolve().parents[3] / "configs"  # the checkout's configs/ (editable install)


def compose(*overrides: str, config_name: str = "train", hydra_config: bool = False) -> DictConfig:
    """``configs/<config_name>.yaml`` with ``overrides`` applied (not yet validated); with
    ``hydra_config``, Hydra's own node too (``cfg.hydra.launcher``, ...)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if not CONFIGS.is_dir():
        raise FileNotFoundError(f"{CONFIGS} not found: compose() reads the configs of a source checkout "
                                "(pip install -e .)")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra_config)
