"""Process-wide settings, none made at import: ``process.py`` (``configure_process`` before torch starts,
``configure_backends`` for a run's config), ``signals.py`` (the stop signals that worker processes ignore, children
ended on a failure) and ``bytecode.py`` (bytecode kept under the cache directory where Python may not write it);
and ``files.py``: files written whole, in one rename over the old one."""
