"""One training step: ``TrainStep`` (``step.py``), GradCache's three phases (``gradcache.py``), the training terms
beside the contrastive loss (``objectives/``), and what the step owns: its batch plan, precision, phase times, the
weight average and the model's FLOPs."""
