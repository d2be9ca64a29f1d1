"""megabatch: CLIP training with contrastive batches of a million samples and more."""

import os

from .bytecode import use_kept_bytecode

# The GPU decoding (data/gpu_decode.py) runs beside the step on other CUDA streams. CUDA maps all
# streams onto CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default), and a stream that shares
# a queue with the step's waits behind everything the step has queued; 32 is the most CUDA allows
# (docs/performance.md has the measurement). Read when CUDA starts, so set here, before anything
# uses it; a value already set wins.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

# Where torch was installed without bytecode and Python may not write it (PYTHONDONTWRITEBYTECODE),
# bytecode is read from the cache directory (bytecode.py); before torch is imported.
use_kept_bytecode()

__version__ = "0.1.0"
