"""What a run is built from its config: ``RunParts`` (``parts.py``: the model, the step, the data, the schedule),
the optimizer and schedules, the compile cache, the sub-batch plan (``trainer.sub_batch=auto``) and the start-up
times."""
