"""megabatch: CLIP training with contrastive batches of a million samples and more.

Importing it changes nothing process-wide: the settings a run makes are ``megabatch.runtime.process``'
(``configure_process`` before torch starts, ``configure_backends`` for a run's config).
"""

__version__ = "0.1.0"
