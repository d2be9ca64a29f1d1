"""Checkpoints, written and read: ``files.py`` (atomic durable saves, sharded DCP folders, RNG states, the newest
checkpoint that loads), ``checkpointer.py`` (``Checkpointer``: every part of a run saved and resumed) and
``model.py`` (a model rebuilt from a checkpoint's description, for evaluation, export and teachers)."""
