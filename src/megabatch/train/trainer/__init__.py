"""The run around the steps: ``Trainer`` and ``run`` (``loop.py``), the log and its sinks (``metrics.py``), stop
requests (``stops.py``) and the run directory's lock (``lock.py``)."""
