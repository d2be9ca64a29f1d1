"""Data: webdataset shards, transforms, the embedded digits."""

from .train_data import TrainData

__all__ = ["TrainData"]
