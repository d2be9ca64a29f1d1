"""Gradient Cache: a batch far larger than fits through the encoders, with exact gradients.

A rank's batch is split into sub-batches (``rank_batch = sub_batches x sub_batch``), then:

1. ``encode_without_graph``: encode every sub-batch under autocast without autograd, write the
   features into preallocated buffers, and record each sub-batch's RNG state (CPU and CUDA,
   captured explicitly, so dropout / patch dropout can be replayed).
2. ``loss_and_feature_grads``: the configured loss once, on all of this rank's features, gives the
   feature gradients (fp32) and the scale gradient (and the logit bias's, for the sigmoid loss).
3. ``replay``: re-encode each sub-batch with its RNG state restored and back-propagate the cached
   feature gradients through a surrogate ``sum(features * feature_grads)``. The last sub-batch's
   surrogate also carries ``scale * d_scale`` (and ``bias * d_bias``), so the temperature's gradient enters DDP's one
   synchronisation (``no_sync`` on all but the last sub-batch) like every other parameter's.

Data offload (``trainer.offload``). Off: the sub-batches' input tensors stay on the GPU between
phases 1 and 3 (fastest when they fit). On: only the *encoded* image bytes and each sample's stream
position stay, kept by ``data.offload.Offload`` (host memory or a spill file); phase 3 gets the
images decoded again by its worker pool. Augmentation is
seeded per sample by (seed, epoch, position) (``data.samples.SampleDecoder``), so the re-decoded
tensors equal the first ones bit for bit, whatever worker decodes them. Host memory is the encoded
bytes of one rank batch (a 1M-sample batch of ~20 KB JPEGs: ~20 GB, against 150 GB as uint8
pixels or 600 GB as float tensors), and nothing of the batch stays on the GPU but its token ids.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..data.offload import Offload
from ..data.samples import SubBatch
from .precision import Precision


@dataclass
class RngState:
    """The CPU and (on CUDA) current-device RNG states at one point."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


@dataclass(frozen=True)
class ReplayInputs:
    """What phase 1 keeps of each sub-batch for phase 3: the inputs of the towers that are replayed
    (a frozen tower's phase-1 features are final: nothing of it is kept or encoded again), the
    images as tensors on the device, or with ``offload`` as encoded bytes handed to it."""

    images: bool
    texts: bool
    offload: Offload | None = None


@dataclass
class EncodedBatch:
    """Phase 1's result for one rank: features ``[b_rank, e]`` and what phase 3 needs."""

    image_features: torch.Tensor
    text_features: torch.Tensor
    sub_batch: int
    rng: list[RngState] = field(default_factory=list)
    texts: list[torch.Tensor] = field(default_factory=list)    # token ids, on the device
    images: list[torch.Tensor] = field(default_factory=list)   # offload off: inputs on the device
    kept: list = field(default_factory=list)                    # offload on: what Offload.keep gave
    data_s: float = 0.0                                          # time spent waiting on the loader

    @property
    def replays_images(self) -> bool:
        return bool(self.images or self.kept)

    @property
    def replays_texts(self) -> bool:
        return bool(self.texts)


@dataclass
class FeatureGrads:
    """Phase 2's result: ``d loss / d features`` (fp32, W-scaled per the loss contract), scale and
    bias (``None`` for a model without a logit bias)."""

    loss: torch.Tensor
    image: torch.Tensor
    text: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None = None


@torch.no_grad()
def encode_without_graph(model, sub_batches: Iterator[SubBatch], count: int, precision: Precision,
                         keep: ReplayInputs, progress=None) -> EncodedBatch:
    """Phase 1: encode ``count`` sub-batches from ``sub_batches`` into preallocated feature buffers
    (``precision.feature_dtype``), recording each one's RNG state and keeping what ``keep`` says."""
    device, encoded = precision.device, None
    for index in range(count):
        waited = time.perf_counter()
        sub = next(sub_batches)
        images, texts = sub.images.to(device, non_blocking=True), sub.texts.to(device, non_blocking=True)
        data_s = time.perf_counter() - waited
        rng = RngState.capture(device)
        with precision.autocast():
            image_features, text_features, *_ = model(images, texts)
        if encoded is None:  # preallocate once the feature width is known
            rows, dtype = count * len(texts), precision.feature_dtype
            encoded = EncodedBatch(image_features.new_empty((rows, image_features.shape[1]), dtype=dtype),
                                   text_features.new_empty((rows, text_features.shape[1]), dtype=dtype),
                                   sub_batch=len(texts))
        encoded.data_s += data_s
        rows = slice(index * encoded.sub_batch, (index + 1) * encoded.sub_batch)
        encoded.image_features[rows] = image_features
        encoded.text_features[rows] = text_features
        encoded.rng.append(rng)
        if keep.texts:
            encoded.texts.append(texts)
        if keep.images and keep.offload is not None:
            if sub.raw is None:
                raise RuntimeError("trainer.offload needs the loader to keep the encoded bytes (keep_raw)")
            encoded.kept.append(keep.offload.keep(sub.raw, sub.boxes))
        elif keep.images:
            encoded.images.append(images)
        if progress is not None:
            progress.update(1)
    return encoded


def loss_and_feature_grads(loss_fn, encoded: EncodedBatch, logit_scale: torch.Tensor,
                           logit_bias: torch.Tensor | None, precision: Precision) -> FeatureGrads:
    """Phase 2: the loss once on all of this rank's features; gradients of the (fp16: scaled)
    loss w.r.t. the features, kept in fp32, and w.r.t. the scale multiplier and the bias."""
    image_features = encoded.image_features.float().requires_grad_()
    text_features = encoded.text_features.float().requires_grad_()
    inputs = [image_features, text_features, logit_scale.detach().exp().float().requires_grad_()]
    if logit_bias is not None:
        inputs.append(logit_bias.detach().float().requires_grad_())
    loss = loss_fn(*inputs)
    return FeatureGrads(loss.detach(), *torch.autograd.grad(precision.scale(loss), inputs))


def replay(model, encoded: EncodedBatch, grads: FeatureGrads, precision: Precision,
           images_again: Iterator[torch.Tensor] | None = None, progress=None) -> float:
    """Phase 3: re-encode each sub-batch with its RNG state and back-propagate its cached feature
    gradients. ``images_again`` yields the re-decoded images when data is offloaded. Only the
    towers whose inputs phase 1 kept are encoded again. ``model`` may be DDP-wrapped: only the last
    sub-batch's backward synchronises. Returns the time spent waiting for re-decoded images."""
    device, sub_batch = precision.device, encoded.sub_batch
    num_sub = len(encoded.rng)
    after_encoding = RngState.capture(device)
    waited_s = 0.0
    for index in range(num_sub):
        last = index == num_sub - 1
        if not encoded.replays_images:
            images = None
        elif images_again is not None:
            start = time.perf_counter()
            images = next(images_again)  # on the device already when decoded there (data.decode=gpu)
            if device.type == "cuda" and images.device.type == "cpu":
                images = images.pin_memory()  # page-locked: the copy need not wait for the queued kernels
            images = images.to(device, non_blocking=True)
            waited_s += time.perf_counter() - start
        else:
            images = encoded.images[index]
        texts = encoded.texts[index] if encoded.replays_texts else None
        rows = slice(index * sub_batch, (index + 1) * sub_batch)
        encoded.rng[index].restore()
        # DDP all-reduces once per step: only the last sub-batch's backward synchronises
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with precision.autocast():
                image_features, text_features, scale, bias = model(images, texts)
            surrogate = scale.float() * grads.scale if last else 0.0  # the temperature's (and
            # the bias's) gradient joins DDP's synchronisation in the last sub-batch, with the rest
            if last and bias is not None:
                surrogate = surrogate + (bias.float() * grads.bias).sum()
            if image_features is not None:
                surrogate = surrogate + (image_features.float() * grads.image[rows]).sum()
            if text_features is not None:
                surrogate = surrogate + (text_features.float() * grads.text[rows]).sum()
            if torch.is_tensor(surrogate) and surrogate.requires_grad:
                surrogate.backward()
        if images_again is None and encoded.images:
            encoded.images[index] = None  # free the inputs as soon as they are replayed
        if progress is not None:
            progress.update(1)
    after_encoding.restore()  # randomness continues after phase 1's draws, not the replays'
    return waited_s
