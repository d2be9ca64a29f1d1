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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ...data.offload import Offload
from ...data.samples import SubBatch
from ...models.text_length import TextTrim
from .precision import Precision


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, copied asynchronously: a CPU tensor bound for a GPU is page-locked
    first (a copy from pageable memory would wait for the kernels already queued); one already on
    ``device`` comes back as it is. The one place inputs reach the device."""
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


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
    images as tensors on the device, or with ``offload`` as encoded bytes handed to it (``Offload.keep``;
    ``Offload.replay_images`` decodes them again for the replay). ``text_trim``: captions are grouped by
    length and cut (``models.text_length``); ``None``: each sub-batch's captions are encoded whole with its
    images. ``kept_graphs``: the last that many sub-batches are encoded with their graphs in phase 1 and not
    encoded again (a forward each saved; their activations held through the loss)."""

    images: bool
    texts: bool
    offload: Offload | None = None
    text_trim: TextTrim | None = None
    kept_graphs: int = 0


@dataclass
class EncodedBatch:
    """Phase 1's result for one rank: features ``[b_rank, e]`` and what phase 3 needs: for sub-batch ``i``,
    its RNG state ``rng[i]``, its image rows ``i x sub_batch`` on, and its captions' rows ``text_rows[i]``.

    With ``text_trim``, the captions are encoded in chunks of ``sub_batch`` rows sorted by length
    (``text_order [b_rank]``: the rows of the chunks, one after another; ``text_rows[i]``: chunk ``i``'s, as
    indices on the device), each cut to its longest caption: chunk ``i`` is replayed with image sub-batch
    ``i``, with its own RNG state. Without it ``text_rows[i]`` is the slice of sub-batch ``i``'s rows."""

    image_features: torch.Tensor
    text_features: torch.Tensor
    sub_batch: int
    replays: ReplayInputs
    rng: list[RngState] = field(default_factory=list)
    text_rng: list[RngState] = field(default_factory=list)     # per text chunk (captions grouped)
    text_order: torch.Tensor | None = None                     # on the device; None: the images' order
    text_rows: list = field(default_factory=list)              # per sub-batch (or caption chunk): its text rows
    texts: list[torch.Tensor] = field(default_factory=list)    # token ids, on the device
    images: list[torch.Tensor] = field(default_factory=list)   # offload off: inputs on the device
    kept: list = field(default_factory=list)                    # offload on: what Offload.keep gave
    graphs: dict = field(default_factory=dict)                 # index -> [image, text] features with their graphs
    scalars: tuple = (None, None)                               # the last kept graph's scale and bias
    data_s: float = 0.0                                          # time spent waiting on the loader


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
def encode_without_graph(model, stream: Iterator[SubBatch], count: int, precision: Precision,
                         keep: ReplayInputs, progress=None, objectives: Sequence = ()) -> EncodedBatch:
    """Phase 1: encode ``count`` sub-batches from ``stream`` into preallocated feature buffers
    (``precision.feature_dtype``), recording each one's RNG state and keeping what ``keep`` says.
    With ``keep.text_trim`` the captions wait on the host until all images are encoded, then are
    encoded grouped by length (``encode_captions``); the last ``keep.kept_graphs`` sub-batches (and
    caption chunks) keep their graphs. Each of ``objectives`` (``train/step/objectives``) sees every sub-batch once
    encoded (``encoded``: a teacher's features, caption tokens, hard negatives' ids) and the whole rank's
    batch (``encoded_all``: the hard negatives through the text tower)."""
    device, encoded, captions = precision.device, None, []
    for index in range(count):
        with_graph = index >= count - keep.kept_graphs
        waited = time.perf_counter()
        sub = next(stream)
        images = to_device(sub.images, device)
        texts = None if keep.text_trim is not None else to_device(sub.texts, device)
        data_s = time.perf_counter() - waited
        rng = RngState.capture(device)
        with torch.enable_grad() if with_graph else contextlib.nullcontext(), precision.autocast():
            image_features, text_features, *scalars = model(images, texts)
        if encoded is None:  # preallocate once the feature width is known
            rows, dtype = count * len(sub.texts), precision.feature_dtype
            encoded = EncodedBatch(image_features.new_empty((rows, image_features.shape[1]), dtype=dtype),
                                   image_features.new_empty((rows, image_features.shape[1]), dtype=dtype),
                                   sub_batch=len(sub.texts), replays=keep)
        encoded.data_s += data_s
        rows = slice(index * encoded.sub_batch, (index + 1) * encoded.sub_batch)
        for objective in objectives:
            objective.encoded(sub, images, rows, len(encoded.image_features), precision)
        encoded.image_features[rows] = image_features.detach()
        encoded.rng.append(rng)
        if texts is None:
            captions.append(sub.texts)
        else:
            encoded.text_features[rows] = text_features.detach()
            encoded.text_rows.append(rows)
            if keep.texts:
                encoded.texts.append(texts)
        if with_graph:
            encoded.graphs[index] = [image_features, text_features]
            encoded.scalars = (*scalars, None)[:2]  # the last kept sub-batch's scale and bias, with their graph
        elif keep.images and keep.offload is not None:  # the encoded bytes, decoded again for the replay
            if sub.raw is None:
                raise RuntimeError("trainer.offload needs the loader to keep the encoded bytes (keep_raw)")
            encoded.kept.append(keep.offload.keep(sub.raw, sub.boxes))
        elif keep.images:
            encoded.images.append(images)
        if progress is not None:
            progress.update(1)
    if captions:
        encode_captions(model, encoded, torch.cat(captions), precision)
    for objective in objectives:
        objective.encoded_all(model, encoded, precision)
    if not any(f is not None and f.requires_grad for graph in encoded.graphs.values() for f in graph):
        encoded.graphs.clear()  # nothing trainable in them (both towers frozen): replayed like the others
    return encoded


def encode_captions(model, encoded: EncodedBatch, texts: torch.Tensor, precision: Precision) -> None:
    """Phase 1's text tower with ``text_trim``: this rank's captions ``texts [b_rank, ctx]``, sorted
    by length (measured on the host: no sync), in chunks of ``sub_batch`` rows, each cut to its
    longest caption's bucket; the features go back to the captions' own rows."""
    trim, keep, device = encoded.replays.text_trim, encoded.replays, precision.device
    lengths = trim.lengths(texts)
    order = torch.argsort(lengths, stable=True)  # shortest first: each chunk is as short as it can be
    # one asynchronous copy each; the chunks are gathered on the device
    texts, encoded.text_order = to_device(texts, device), to_device(order, device)
    chunks = order.split(encoded.sub_batch)
    for index, rows in enumerate(chunks):
        with_graph = index >= len(chunks) - keep.kept_graphs
        length = trim.bucket(int(lengths[rows].max()))  # a host tensor: no sync
        on_device = encoded.text_order[index * encoded.sub_batch:(index + 1) * encoded.sub_batch]
        encoded.text_rows.append(on_device)  # this chunk's rows, as indices on the device
        chunk = texts.index_select(0, on_device)[:, :length].contiguous()
        encoded.text_rng.append(RngState.capture(device))
        with torch.enable_grad() if with_graph else contextlib.nullcontext(), precision.autocast():
            _, text_features, *_ = model(None, chunk)
        encoded.text_features.index_copy_(0, on_device, text_features.detach().to(encoded.text_features.dtype))
        if with_graph:
            encoded.graphs[index][1] = text_features
        elif keep.texts:
            encoded.texts.append(chunk)


def loss_and_feature_grads(loss_fn, encoded: EncodedBatch, logit_scale: torch.Tensor,
                           logit_bias: torch.Tensor | None, precision: Precision,
                           objectives: Sequence = ()) -> FeatureGrads:
    """Phase 2: the loss once on all of this rank's features (and the inputs ``objectives`` give it: a
    teacher's features, hard negatives' features); gradients of the (fp16: scaled) loss w.r.t. the features,
    kept in fp32, and w.r.t. the scale multiplier and the bias; an objective's input that requires grad gets
    its gradient back (``take_grads``)."""
    image_features = encoded.image_features.float().requires_grad_()
    text_features = encoded.text_features.float().requires_grad_()
    inputs = [image_features, text_features, logit_scale.detach().exp().float().requires_grad_()]
    if logit_bias is not None:
        inputs.append(logit_bias.detach().float().requires_grad_())
    options = {}
    for objective in objectives:
        options.update(objective.loss_inputs(encoded))
    extra = {key: value for key, value in options.items() if isinstance(value, torch.Tensor) and value.requires_grad}
    # bf16 buffers: the kernels' dots in bf16, exact
    loss = loss_fn(*inputs, values_in=encoded.image_features.dtype, **options)
    found = torch.autograd.grad(precision.scaler.scale(loss), inputs + list(extra.values()))
    taken = dict(zip(extra, found[len(inputs):], strict=True))
    for objective in objectives:
        objective.take_grads(taken)
    return FeatureGrads(loss.detach(), *found[:len(inputs)])


@dataclass(frozen=True)
class GradSync:
    """When the replay's backward passes reduce the gradients across ranks. ``hold``: a context
    for the backward passes of all but the last replayed sub-batch (DDP's ``no_sync``; FSDP's
    ``no_gradient_sync`` when it reduces once per step; ``None``: every backward reduces, FSDP's
    default, or a single process). ``kept``: the same for the graph phase 1 kept (``None`` under
    DDP: that graph was built by the unwrapped model, outside DDP's bookkeeping)."""

    hold: Callable[[], contextlib.AbstractContextManager] | None = None
    kept: Callable[[], contextlib.AbstractContextManager] | None = None

    @classmethod
    def of(cls, model) -> GradSync:
        """A DDP-wrapped model's (``no_sync`` held), else reducing on every backward."""
        return cls(hold=model.no_sync) if hasattr(model, "no_sync") else cls()


def replay(model, encoded: EncodedBatch, grads: FeatureGrads, precision: Precision,
           images_again: Iterator[torch.Tensor] | None = None, progress=None, sync: GradSync | None = None,
           objectives: Sequence = ()) -> float:
    """Phase 3: back-propagate the cached feature gradients through each sub-batch's surrogate
    ``sum(features x feature_grads)``: first through the graphs phase 1 kept (if any), then through each other
    sub-batch re-encoded with its RNG state (and its caption chunk's). The last one's surrogate also carries
    ``scale x d_scale`` and ``bias x d_bias``: the temperature's and the bias's gradients are the step's too.
    ``images_again`` yields the re-decoded images when data is offloaded. Only the towers whose inputs phase 1
    kept are encoded again. ``sync`` says which backward passes reduce the gradients across ranks (default
    ``GradSync.of(model)``): with DDP only the last replayed sub-batch's (the kept graphs, built by the unwrapped
    model in phase 1, are back-propagated first, outside DDP's bookkeeping; their gradients join the
    synchronisation with the others'). Each of ``objectives`` replays its own first (``replay_first``: hard
    negatives' chunks), asks the model for its outputs (``model_options_for`` the sub-batch) and adds its term to
    each re-encoded sub-batch's surrogate (``replay_term``: a CoCa's caption loss). Returns the time spent waiting for
    re-decoded images."""
    device, kept = precision.device, sorted(encoded.graphs)
    count, replayed = len(encoded.rng), len(encoded.rng) - len(kept)
    sync = GradSync.of(model) if sync is None else sync
    after_encoding = RngState.capture(device)
    waited_s = 0.0
    for objective in objectives:  # before the sub-batch whose backward synchronises
        objective.replay_first(model, encoded, precision, sync)
    for index in kept + list(range(replayed)):
        graph, outputs = encoded.graphs.pop(index, None), None
        if graph is not None:
            # its backward is outside DDP's bookkeeping (or held by FSDP); the temperature's (and the bias's)
            # gradient goes with the last kept graph when no sub-batch is replayed (all kept: one process)
            last, hold = replayed == 0 and index == count - 1, sync.kept
            image_features, text_features = graph[:2]
            scale, bias = encoded.scalars
        else:
            # DDP all-reduces once per step: only the last replayed sub-batch's backward synchronises, and the
            # temperature's (and the bias's) gradient joins it there, with the rest
            last = index == replayed - 1
            hold = None if last else sync.hold
            if not encoded.replays.images:
                images = None
            elif images_again is not None:
                start = time.perf_counter()
                images = to_device(next(images_again), device)  # on the device already when decoded there
                waited_s += time.perf_counter() - start
            else:
                images = encoded.images[index]
                encoded.images[index] = None  # freed as soon as it is replayed
            texts = encoded.texts[index] if encoded.replays.texts else None
            encoded.rng[index].restore()
            before_text = encoded.text_rng[index].restore if encoded.text_rng else None
        with contextlib.nullcontext() if hold is None else hold():
            if graph is None:
                options = {key: value for objective in objectives
                           for key, value in objective.model_options_for(index).items()}
                with precision.autocast():
                    outputs = model(images, texts, before_text=before_text, **options)
                image_features, text_features, scale, bias = outputs[:4]
            terms = []
            if last:
                terms.append(scale.float() * grads.scale)
                if bias is not None:
                    terms.append((bias.float() * grads.bias).sum())
            if image_features is not None and image_features.requires_grad:
                rows = slice(index * encoded.sub_batch, (index + 1) * encoded.sub_batch)
                terms.append((image_features.float() * grads.image[rows]).sum())
            if text_features is not None and text_features.requires_grad:
                terms.append((text_features.float() * grads.text[encoded.text_rows[index]]).sum())
            terms = [term for term in terms if term.requires_grad]
            surrogate = sum(terms[1:], terms[0]) if terms else None
            for objective in objectives if outputs is not None else ():  # its term of the one global loss
                term = objective.replay_term(outputs, images)
                if term is not None:
                    surrogate = term if surrogate is None else surrogate + term
            if surrogate is not None:
                surrogate.backward()
        del graph, outputs, surrogate, terms  # their activations are freed
        if progress is not None:
            progress.update(1)
    after_encoding.restore()  # randomness continues after phase 1's draws, not the replays'
    return waited_s
