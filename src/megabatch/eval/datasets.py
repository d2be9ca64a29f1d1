"""Evaluation sets: where their images are, their class names and prompt templates."""

from __future__ import annotations

from ..config import ConfigError


def resolve_eval_set(eval_cfg, data_cfg) -> tuple[str, list[str], list[str]]:
    """``(shard urls, class names, templates)`` for ``eval_cfg``.

    ``eval.name=digits`` uses the embedded held-out split (built on first use); other sets give
    ``eval.urls``, ``eval.classnames`` and ``eval.templates`` in their config.
    """
    if eval_cfg.name == "digits":
        from ..data.digits import CLASS_NAMES, EVAL_TEMPLATES, ensure_digits

        urls = eval_cfg.get("urls") or ensure_digits(data_cfg.cache_dir)["test"]
        return urls, list(CLASS_NAMES), list(eval_cfg.get("templates") or EVAL_TEMPLATES)
    for key in ("urls", "classnames", "templates"):
        if not eval_cfg.get(key):
            raise ConfigError(f"eval.{key} is not set for eval={eval_cfg.name}")
    return eval_cfg.urls, list(eval_cfg.classnames), list(eval_cfg.templates)
