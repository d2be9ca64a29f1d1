"""CLIP models built through open_clip from per-tower configs (``model.image.*``, ``model.text.*``):
the built-in shapes (``configs/model/*.yaml``). ``openclip.py`` builds any open_clip architecture by
name; both return a ``ClipModel``, which carries its open_clip config, preprocessing and tokenizer.

Weights start random; pretrained weights come only from local paths (``model.pretrained``), never
from a hub.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import fields
from typing import Any

import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg, CustomTextCLIP, set_model_preprocess_cfg
from torch import nn

from ..config import ConfigError, no_such_option
from ..config.schema import RETIRED_MODEL_KEYS, ModelSettings, model_settings
from .images import normalize_images
from .naflex import NaFlexCfg, NaFlexTower
from .preprocess import build_tokenizer, resolve_preprocess
from .pretrained import load_weights, resolve_pretrained
from .spec import OPENAI_LOGIT_SCALE, ModelSpec
from .text_length import TextTrim, encode_text_prefix, text_trim, why_untrimmed

log = logging.getLogger(__name__)

MAX_LOGIT_SCALE = math.log(100.0)


class ClipModel(nn.Module):
    """An open_clip ``CLIP`` returning L2-normalised features, the scale multiplier and the bias.

    ``forward(images [b, 3, s, s], texts [b, ctx])`` -> ``(image_features [b, e], text_features
    [b, e], scale [], bias)`` with ``scale = logit_scale.exp()`` and ``bias`` the learnable logit
    bias [] of a sigmoid-loss model (``init_logit_bias``), else ``None``. Both towers live in one
    module so that one DDP wrapper synchronises them together.

    ``images`` may also be ``[b, e]``: the locked image tower's own features of the images, stored
    (``model.image_features=stored``, ``data/image_features.py``), taken for its output (normalised again in
    float32) without running it; a tower that trains refuses them.
    """

    def __init__(self, clip: CLIP | CustomTextCLIP, name: str, model_cfg: dict[str, Any],
                 arch: str | None = None, tokenizer_folder: str | None = None):
        super().__init__()
        self.clip = clip
        self.name = name
        self.model_cfg = model_cfg                # open_clip's model config (open_clip_config.json's model_cfg)
        self.arch = arch                          # the open_clip architecture name, if built from one
        self.tokenizer_folder = tokenizer_folder  # a pretrained folder holding the HF tokenizer
        self._compiled: dict | None = None        # compile_towers(): the compiled encoders, and their batch
        self._cuda_graphs = False                 # compile_towers(cuda_graphs=True): replayed as CUDA graphs
        self._compiled_caption: dict | None = None  # compile_towers() of a CoCa: caption_forward's three graphs
        self.text_trim: TextTrim | None = None    # trim_text(): how captions are cut to their length
        self.decoder: nn.Module | None = None     # attach_decoder(): model.decoder's captioner (models/decoder.py)
        self.views: nn.Module | None = None       # attach_views(): self_distill's heads (models/views.py)
        self.stored_image_features = False        # model.image_features=stored: training feeds features, not images
        self.image_lengths: tuple[int, ...] = ()  # a NaFlex tower's: the sequence lengths training feeds (warm_up's)
        self.image_rows: dict[int, int] = {}      # and its rows per length where a token budget joins sub-batches

    @property
    def preprocess(self) -> dict[str, Any]:
        """open_clip's preprocessing config of this model (``size``, ``mean``, ``std``,
        ``interpolation``, ``resize_mode``, ``fill_color``): what training, the on-device
        normalisation and evaluation use, and what a checkpoint and an export record."""
        return self.clip.visual.preprocess_cfg

    @property
    def image_size(self) -> int | tuple[int, int]:
        return self.preprocess["size"]

    def example_inputs(self, rows: int, device: torch.device,
                       seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` uint8 images of the model's size and token ids (all ones): inputs of the right
        shapes for a FLOP count, a memory probe or a compile warm-up (``seq_len``: a NaFlex tower's images at that
        many patches; default: the longest it trains at)."""
        texts = torch.ones((rows, self.context_length), dtype=torch.long, device=device)
        if self.stored_image_features:  # what training feeds the image tower: its stored features, float16
            return torch.ones((rows, int(self.model_cfg["embed_dim"])), dtype=torch.float16, device=device), texts
        if self.naflex is not None:  # packed patches of the longest sequence training feeds (data/naflex.py)
            length = seq_len or max(self.image_lengths, default=None)
            return self.clip.visual.example_inputs(rows, length).to(device), texts
        size = (self.image_size,) * 2 if isinstance(self.image_size, int) else tuple(self.image_size)
        return torch.zeros((rows, 3, *size), dtype=torch.uint8, device=device), texts

    @property
    def naflex(self):
        """A NaFlex image tower's ``NaFlexCfg`` (``model.image.naflex``, ``models/naflex.py``), else ``None``."""
        return self.clip.visual.cfg if isinstance(self.clip.visual, NaFlexTower) else None

    @property
    def context_length(self) -> int:
        return int(self.model_cfg["text_cfg"].get("context_length", 77))

    @property
    def vocab_size(self) -> int:
        """The token ids the captions hold: the text tower's vocabulary (a Hugging Face tower's tokenizer's)."""
        size = self.model_cfg["text_cfg"].get("vocab_size")
        if size is None:
            tokenizer = self.tokenizer()
            size = len(getattr(tokenizer, "tokenizer", tokenizer))
        return int(size)

    def tokenizer(self):
        """The text tower's tokenizer (built from local files only)."""
        return build_tokenizer(self.model_cfg, self.arch, self.tokenizer_folder)

    def description(self) -> dict[str, Any]:
        """What rebuilds this model without its config files (``from_description``): stored in
        checkpoints and written by ``scripts/export.py``."""
        description = {"name": self.name, "arch": self.arch, "model_cfg": _plain(self.model_cfg),
                       "preprocess_cfg": _plain(self.preprocess), "tokenizer_folder": self.tokenizer_folder}
        if self.decoder is not None:
            description["decoder"] = self.decoder.cfg.to_dict()
        if self.views is not None:
            description["views"] = self.views.cfg.to_dict()
        if self.naflex is not None:
            description["naflex"] = self.naflex.to_dict()
        return description

    def attach_views(self, cfg) -> None:
        """``self_distill``'s student side: the heads over views of the images (``models/views.py``; ``cfg``: a
        ``ViewsCfg``); an open_clip ViT image tower only (a ``ConfigError`` naming the key otherwise)."""
        from .views import ViewHeads, check_views

        visual = self.clip.visual
        check_views(cfg, visual, self.name)
        self.views = ViewHeads(cfg, int(self.model_cfg["embed_dim"]), visual.transformer.width, visual.grid_size,
                               visual.patch_size[0])

    def attach_decoder(self, cfg) -> None:
        """``model.decoder``: a caption decoder over the image tower's tokens (``models/decoder.py``; ``cfg``: a
        ``DecoderCfg``), frozen until ``loss.caption_weight`` trains it. An open_clip ViT image tower only, and not
        beside a CoCa's own decoder: a ``ConfigError`` naming the key otherwise."""
        from open_clip.transformer import VisionTransformer

        from .decoder import CaptionDecoder

        visual = self.clip.visual
        if self.has_decoder:
            raise ConfigError(f"model.decoder with model {self.name}, a CoCa: it has a caption decoder already "
                              "(loss.caption_weight trains it); set model.decoder.layers=0")
        if not isinstance(visual, VisionTransformer):
            raise ConfigError(f"model.decoder reads an open_clip ViT's tokens; model {self.name}'s image tower is a "
                              f"{type(visual).__name__}: set model.decoder.layers=0")
        self.decoder = CaptionDecoder(cfg, visual.transformer.width, self.vocab_size, self.context_length,
                                      int(getattr(self.clip, "pad_id", 0) or 0)).requires_grad_(False)

    def tower_parameters(self, tower: str):
        """``(name, parameter)`` pairs of the ``image`` or ``text`` tower (projection included)."""
        for param_name, param in self.clip.named_parameters():
            if not param_name.startswith("logit_") and param_name.startswith("visual.") == (tower == "image"):
                yield param_name, param

    def frozen(self, tower: str) -> bool:
        """Whether no parameter of ``tower`` is trainable (a locked tower). Called on every
        forward: stops at the first trainable parameter."""
        return not any(p.requires_grad for _, p in self.tower_parameters(tower))

    def train(self, mode: bool = True):
        """Frozen towers stay in eval mode (no dropout, fixed statistics) whatever the mode."""
        super().train(mode)
        if self.frozen("image"):
            self.clip.visual.eval()
        if self.frozen("text"):
            text = getattr(self.clip, "text", None)
            for module in [text] if text is not None else [
                    self.clip.transformer, self.clip.token_embedding, self.clip.ln_final]:
                module.eval()
        return self

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    @property
    def logit_bias(self) -> nn.Parameter | None:
        return getattr(self.clip, "logit_bias", None)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: float (normalised) or uint8 ``[n, 3, s, s]`` (normalised here, on device)."""
        with torch.no_grad() if self.frozen("image") else contextlib.nullcontext():
            return self._image_features(images)

    def encode_text(self, texts: torch.Tensor) -> torch.Tensor:
        with torch.no_grad() if self.frozen("text") else contextlib.nullcontext():
            return self._text_features(texts)

    def use_stored_image_features(self) -> None:
        """``model.image_features=stored``: training feeds this model its locked image tower's stored features
        (``example_inputs`` gives such inputs); evaluation still feeds images, which the tower encodes."""
        if self.naflex is not None:
            raise ConfigError("model.image_features=stored with a NaFlex image tower (model.image.naflex=true): stored "
                              "features are of a fixed-size centre crop (scripts/make_shards.py image-features), not "
                              "of each image at its own aspect ratio as the tower trains and evaluates; set "
                              "model.image_features=tower (a locked tower runs without autograd), or use a "
                              "fixed-size model")
        if not self.frozen("image"):
            raise ConfigError(f"model.image_features=stored: model {self.name}'s image tower has trainable weights, "
                              "and stored features stand for a locked tower's output; set model.lock_image=true with "
                              "model.image.unlocked_layers=0")
        self.stored_image_features = True

    def _stored_features(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, e]`` stored image features as the tower's output: float32, L2-normalised again (as stored in
        float16 they are normalised to ~1e-3); no autograd: they belong to a locked tower."""
        if not self.frozen("image"):
            raise ValueError("image features given for images, but the image tower trains: stored features stand "
                             "for a locked tower's output (model.image_features=stored)")
        return nn.functional.normalize(features.float(), dim=-1)

    def _image_features(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() == 2:
            return self._stored_features(images)
        if images.dim() == 4:  # (a NaFlex tower's packed patches [n, L, row], uint8, are normalised in it)
            images = normalize_images(images, self.preprocess["mean"], self.preprocess["std"])
        return nn.functional.normalize(self.clip.encode_image(images), dim=-1)

    def _text_features(self, texts: torch.Tensor) -> torch.Tensor:
        """``texts [n, L]``: the whole context, or cut to ``L`` tokens by ``text_trim``."""
        if texts.shape[1] < self.context_length:
            return self._text_prefix_features(texts)
        return nn.functional.normalize(self.clip.encode_text(texts), dim=-1)

    def _text_prefix_features(self, texts: torch.Tensor) -> torch.Tensor:
        """``texts [n, L]`` with any ``L`` up to the context, without a branch on ``L``: what the
        compiled text tower runs when its length is dynamic."""
        return nn.functional.normalize(encode_text_prefix(self.clip, texts), dim=-1)

    def trim_text(self, enabled: bool = True, step: int = 8) -> str | None:
        """``model.trim_text``: let the trainer cut captions to their own length (``text_length.py``),
        where this text tower's features cannot depend on the padding. Returns why not, or ``None``."""
        self.text_trim = text_trim(self.clip, self.model_cfg, step) if enabled else None
        return why_untrimmed(self.clip) if enabled else "model.trim_text=false"

    def random_modules(self) -> list[str]:
        """The modules that draw random numbers in training (dropout, patch dropout with a
        probability above 0, in a tower that trains): their names with the probability."""
        from open_clip.transformer import PatchDropout

        drawn = []
        for name, module in self.named_modules():
            p = module.p if isinstance(module, nn.Dropout) else module.prob if isinstance(module, PatchDropout) else 0
            if p > 0 and module.training:
                drawn.append(f"{name}={p:g}")
        return drawn

    def _encode(self, tower: str, inputs: torch.Tensor) -> torch.Tensor:
        """A tower's features, compiled after ``compile_towers`` (a frozen tower without autograd). Eager, the
        features' own functions, not ``encode_*``: under FSDP those are the root's forward methods, and a call
        of one inside ``forward`` left the root's weights resharded at its end (the hooks' state IDLE by
        then): gathered again for every pass of a step (11 gathers of the root in a tiny model's GradCache
        step, against 1)."""
        if tower == "image" and inputs.dim() == 2:  # stored features: nothing to run, nothing to compile
            return self._stored_features(inputs)
        encode = self._compiled[tower] if self._compiled is not None else \
            self._image_features if tower == "image" else self._text_features
        with torch.no_grad() if self.frozen(tower) else contextlib.nullcontext():
            return encode(inputs)

    def forward(self, images: torch.Tensor | None, texts: torch.Tensor | None, before_text=None, caption: bool = False,
                views: bool = False, caption_tokens: int | None = None):
        """Either input may be ``None`` (its features are then ``None``): GradCache's replay
        skips a frozen tower. A frozen tower always runs without autograd. After
        ``compile_towers`` the towers run compiled (evaluation's ``encode_*`` calls stay eager).
        ``before_text``: called between the towers (GradCache's replay restores the RNG state its
        text chunk was first encoded with: the towers' inputs are grouped differently). The objectives' outputs
        come fifth, a dict, where one is asked: ``caption``: a caption decoder's loss (``caption_forward``; with
        ``caption_tokens``, the count of tokens it predicts in ``texts``, counted on the host); ``views``: the
        student's logits on views of the images (``self_distill``: ``ViewHeads.student``)."""
        extras = {}
        if caption:
            image_features, text_features, extras["caption"] = self.caption_forward(images, texts, before_text,
                                                                                    caption_tokens)
        else:
            if self._cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs are consumed
            image_features = None if images is None else self._encode("image", images)
            if before_text is not None:
                before_text()
            text_features = None if texts is None else self._encode("text", texts)
        if views and images is not None:
            normalized = normalize_images(images, self.preprocess["mean"], self.preprocess["std"])
            extras["views"] = self.views.student(self.clip.visual, images, normalized)
        elif self.views is not None and image_features is not None and image_features.requires_grad:
            image_features = image_features + self.views.untouched().to(image_features.dtype)  # DDP: heads used
        outputs = (image_features, text_features, self.clip.logit_scale.exp(), self.logit_bias)
        return (*outputs, extras) if caption or views else outputs

    @property
    def has_decoder(self) -> bool:
        """A caption decoder over the image tower's tokens (``loss.caption_weight``): a CoCa's, or
        ``model.decoder``'s."""
        return self.decoder is not None or getattr(self.clip, "text_decoder", None) is not None

    @property
    def decoder_module(self) -> nn.Module | None:
        """The caption decoder's module: ``model.decoder``'s, or a CoCa's ``text_decoder``."""
        return self.decoder if self.decoder is not None else getattr(self.clip, "text_decoder", None)

    def image_and_tokens(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An open_clip ViT's output and its last tokens (after ``ln_post``) of normalised ``images``: its forward
        with ``output_tokens`` (its own forward: under FSDP its hooks gather its weights), for ``model.decoder``."""
        visual = self.clip.visual
        visual.output_tokens = True
        try:
            return visual(images)
        finally:
            visual.output_tokens = False

    def caption_forward(self, images: torch.Tensor | None, texts: torch.Tensor, before_text=None,
                        caption_tokens: int | None = None):
        """The features and the caption decoder's cross-entropy summed over the captions' tokens
        (teacher forcing: token t + 1 from the image's tokens and the caption's up to t; padding ignored):
        ``loss.caption_weight``. A frozen tower runs without autograd; the features are the same as
        ``forward``'s. After ``compile_towers`` the image tower, the text tower and the decoder run compiled, each
        its own graph (the first two also output their tokens; a CoCa's decoder with its cross-entropy).
        ``model.decoder``'s head and cross-entropy then run at the predicted tokens alone
        (``CaptionDecoder.head_loss``; ``caption_tokens``: their count, else counted there)."""
        parts = self._compiled_caption or {"image": self._caption_image, "text": self._caption_text,
                                           "decoder": self._decoder_pass}
        with torch.no_grad() if self.frozen("image") else contextlib.nullcontext():
            image_features, image_tokens = parts["image"](images)
        if before_text is not None:
            before_text()
        with torch.no_grad() if self.frozen("text") else contextlib.nullcontext():
            text_features, token_embeddings = parts["text"](texts)
        decoded = parts["decoder"](image_tokens, token_embeddings, texts)
        if self.decoder is not None:  # its head and the softmax at the predicted tokens (a count the graph can't be)
            decoded = self.decoder.head_loss(decoded, texts, caption_tokens)
        return image_features, text_features, decoded

    def _caption_image(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = normalize_images(images, self.preprocess["mean"], self.preprocess["std"])
        latent, tokens = self.image_and_tokens(images) if self.decoder is not None else self.clip._encode_image(images)
        return nn.functional.normalize(latent, dim=-1), tokens

    def _caption_text(self, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.decoder is not None:  # model.decoder reads no output of the text tower
            return self._text_features(texts), None
        latent, token_embeddings = self.clip._encode_text(texts)
        return nn.functional.normalize(latent, dim=-1), token_embeddings

    def _decoder_pass(self, image_tokens: torch.Tensor, token_embeddings: torch.Tensor | None,
                      texts: torch.Tensor) -> torch.Tensor:
        """The decoder's graph: ``model.decoder``'s states before its head (``CaptionDecoder.caption_states``), or a
        CoCa's cross-entropy sum over the captions' tokens."""
        if self.decoder is not None:
            return self.decoder.caption_states(image_tokens, texts)
        logits = self.clip.text_decoder(image_tokens, token_embeddings[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), texts[:, 1:].flatten(),
                                           ignore_index=self.clip.pad_id, reduction="sum")

    def tower_blocks(self, tower: str) -> list[nn.Module]:
        """A tower's repeated transformer blocks: the longest ``ModuleList`` in it whose members share
        one class (open_clip's ``resblocks``, a Hugging Face encoder's ``layer``); empty if none."""
        found = self._tower_stack(tower)
        return list(found[1]) if found is not None else []

    def _tower_stack(self, tower: str) -> tuple[nn.Module, nn.ModuleList] | None:
        """``tower_blocks``' ``ModuleList`` and the module holding it (open_clip's ``Transformer``, a
        Hugging Face encoder), whose forward runs the blocks in turn; ``None`` if there is none."""
        module = self.clip.visual if tower == "image" else getattr(self.clip, "text", None) or self.clip.transformer
        found: tuple[nn.Module, nn.ModuleList] | None = None
        for parent in module.modules():
            for child in parent.children():
                if isinstance(child, nn.ModuleList) and len(child) > max(1, len(found[1]) if found else 0) \
                        and len({type(block) for block in child}) == 1:
                    found = (parent, child)
        return found

    def compile_towers(self, rows: int, cuda_graphs: bool = False, scope: str = "tower") -> None:
        """``model.compile=true``: ``torch.compile`` each tower's encoder (normalisation of the
        images and of the features included), static shapes for ``rows`` inputs. ``scope="block"``
        (``model.compile_scope``): each tower's repeated transformer block compiled once for all its
        layers, and the tower compiled around the loop over them (``_run_blocks_outside_the_graph``),
        the shortest compilation; ``"tower"``: each tower one graph. A call with fewer
        rows (a short last sub-batch) is padded to ``rows`` and its output cut, a call with more
        goes through in chunks of ``rows``: neither recompiles. Gradient mode is part of what a
        compiled graph assumes, so GradCache's graph-free encoding, the replay and a frozen tower's
        no-grad pass each compile once. Random ops (dropout, patch dropout) draw from torch's
        generator as in eager mode (inductor's ``fallback_random``, which
        ``megabatch.runtime.process.configure_backends`` sets), so the replay redraws them.
        Captions cut to their length (``trim_text``) reach the text tower with their length marked
        dynamic from the first call, and compiled without the GPU's fusion size checks that guarded that length
        (``dynamic_length_options``): one graph per gradient mode for the lengths its guards admit (ViT-B/16's cold
        compile on one H200 lost the shortest cut's second set, 5 s; on the CPU in bf16, inductor's C++
        reductions guard ``65 <= L`` at 64 rows, and the warm-up compiles the shorter cuts' graph), not one
        per length.

        ``cuda_graphs`` (``model.cuda_graphs``): inductor's ``reduce-overhead`` mode, each compiled
        graph recorded once as a CUDA graph (per shape and gradient mode) and replayed as one launch
        instead of its kernels one by one. Each ``forward`` call then starts a new generation of
        those graphs (``torch.compiler.cudagraph_mark_step_begin``): its outputs may overwrite the
        previous call's, which the one-pass step has consumed by then (its backward run). The
        trainer allows it for the one-pass step of towers without random ops only
        (``train/build/parts.py: check_cuda_graphs``)."""
        trim = self.text_trim
        dynamic = trim is not None and trim.bucket(1) < trim.context_length  # captions cut to varying lengths
        text_options = dynamic_length_options() if dynamic else {}
        if scope == "block":
            if cuda_graphs:
                raise ValueError("CUDA graphs record whole towers: compile_towers(scope='tower') with them")
            for tower in ("image", "text"):
                found = self._tower_stack(tower)
                if found is not None:
                    for block in found[1]:
                        block.compile(dynamic=False, **_compile_kwargs(None, text_options if tower == "text" else {}))
                    _run_blocks_outside_the_graph(found[0], dynamic_length=tower == "text" and dynamic)
        mode = "reduce-overhead" if cuda_graphs else None
        compiled = {"image": torch.compile(self._image_features, dynamic=False, mode=mode),
                    "text": torch.compile(self._text_prefix_features, **_compile_kwargs(mode, text_options)) if trim
                    else torch.compile(self._text_features, dynamic=False, mode=mode)}
        if scope == "block" and hasattr(torch._dynamo.config, "nested_graph_breaks"):
            # the loop over the blocks, deep in the tower's calls, splits it where it is: two graphs
            # (before and after the blocks), not a graph per function on the way down and back
            nested = torch._dynamo.config.patch(nested_graph_breaks=True)
            compiled = {tower: nested(fn) for tower, fn in compiled.items()}
        self._compiled = {"image": _FixedRows(compiled["image"], rows, by_length=self.image_rows),
                          "text": _FixedRows(compiled["text"], rows, dynamic_length=dynamic)}
        self._cuda_graphs = cuda_graphs
        if self.has_decoder and not cuda_graphs:  # loss.caption_weight's pass (caption_forward): three graphs,
            # each of static shapes (a short last sub-batch, a frozen tower's no-grad mode: compiled once more). Not
            # dynamic: on one H200 (torch 2.11) inductor's dynamic-shape backward of model.decoder's graph sized a
            # reduction's workspace 0 ("shape '[1216, 512]' is invalid for input of size 0"; ViT-B/16, sub-batch 512)
            self._compiled_caption = {name: torch.compile(fn, dynamic=False) for name, fn in (
                ("image", self._caption_image), ("text", self._caption_text), ("decoder", self._decoder_pass))}

    def warm_up(self, rows: int, device: torch.device, autocast, graph_free: bool,
                options: dict | None = None) -> float:
        """After ``compile_towers``: compile now every graph training will call, so that no step
        stalls on a compilation later. Calls each tower once with autograd (the replay, a plain step)
        and, with ``graph_free`` (GradCache), once without (phase 1); the text tower at its whole
        context and, where captions are cut, at the lengths they can be cut to (``warm_up_lengths``): the
        graph compiled for the first (its length dynamic, ``compile_towers``) serves the lengths its guards
        admit, and a length outside them compiles its graph here, not in a step. With ``cuda_graphs`` the
        calls run twice, both towers together: the second run records the CUDA graphs a step replays
        (one per length; one recorded mid-run stalls that step).
        ``options``: the forward's options the objectives ask for (``caption``: the caption decoder's
        graphs, ``views``: self_distill's crops and masked view, which start later in the run); the call
        with autograd passes them, so that neither the first step nor the late terms' start compiles.
        A NaFlex tower's images: at each of ``image_lengths`` (a graph each), beside the text tower's calls.
        ``autocast``: a callable giving the step's autocast context. The RNG states are restored
        and the gradients cleared: training draws and computes what it would have without.
        Returns seconds."""
        start = time.perf_counter()
        images, texts = self.example_inputs(rows, device)
        lengths = self.warm_up_lengths(texts.shape[1])
        cpu_state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        try:
            # CUDA graphs: each call is run once, then recorded on its second run, both towers
            # together as the one-pass step calls them
            graphs, compiled_at_last = self._cuda_graphs, True
            for _ in range(2 if graphs else 1):
                for index, length in enumerate(lengths):
                    if index >= 3 and not graphs and not compiled_at_last:  # the guards admit the lengths left
                        break
                    before = _graphs_compiled()
                    inputs = (images if index == 0 or graphs else None, texts[:, :length].contiguous())  # as cut
                    if index == 0 and len(self.image_lengths) > 1:  # the other lengths' image graphs first
                        self._warm_image_lengths(rows, device, autocast, graph_free)
                    if graph_free:
                        with torch.no_grad(), autocast():
                            self(*inputs)
                    asked = options if options and not graphs and index == 0 else {}  # (no CUDA graph of theirs)
                    with autocast():
                        outputs = self(*inputs, **asked)
                    trained = [t for t in _tensors(outputs) if t.requires_grad]
                    if trained:
                        sum(t.float().sum() for t in trained).backward()
                    self.zero_grad(set_to_none=True)
                    compiled_at_last = _graphs_compiled() > before
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
        return time.perf_counter() - start

    def warm_up_lengths(self, context: int) -> list[int]:
        """The caption lengths ``warm_up`` calls the text tower at, in order: the whole context, then (captions cut,
        ``trim_text``) the shortest cut, the longest, and the others. The graph traced at the whole context admits
        every length where nothing guards it (``dynamic_length_options``); where something does, dynamo guards it
        by a range, and the graph traced at the shortest cut admits the shorter ones. So the warm-up stops at the
        first length after the shortest that compiles nothing (with CUDA graphs it runs them all, to record each).
        A length that neither admitted would compile in the first step that cuts to it. Each call costs a
        sub-batch's forward and backward (~0.2 s for ViT-B/16 at 1024 rows on an H200)."""
        if self.text_trim is None:
            return [context]
        cuts = sorted({self.text_trim.bucket(n) for n in range(1, context)} - {context})
        ends = [cuts[0], cuts[-1]] if len(cuts) > 1 else cuts
        return [context, *ends, *cuts[1:-1]]

    def _warm_image_lengths(self, rows: int, device: torch.device, autocast, graph_free: bool) -> None:
        """A NaFlex tower's image graphs at each of ``image_lengths`` but the longest (``example_inputs``'),
        without and with autograd, as ``warm_up`` calls them, each at its ``image_rows`` (a token budget's)."""
        for length in sorted(self.image_lengths)[:-1]:
            images = self.clip.visual.example_inputs(self.image_rows.get(length, rows), length).to(device)
            if graph_free:
                with torch.no_grad(), autocast():
                    self(images, None)
            with autocast():
                features = self(images, None)[0]
            if features.requires_grad:
                features.float().sum().backward()
            self.zero_grad(set_to_none=True)

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        """Keep the temperature in [0, log 100] (CLIP's clamp), after each optimizer step."""
        self.clip.logit_scale.clamp_(0, MAX_LOGIT_SCALE)


def dynamic_length_options() -> dict:
    """Inductor's options for a graph whose sequence length is dynamic (the text tower's, captions cut to their
    length): one graph for every length. Inductor fuses a layer norm's backward reductions (``mix_order_reduction``)
    only past a size, and checking that size on a dynamic length guards the graph on it: on one H200 (torch 2.11,
    ViT-B/16's text tower at 1024 rows) ``10 <= L``, so the shortest cut (8 tokens) compiled a second set of graphs,
    ~7 s of a cold start (at 256 rows the same check is ``40 <= L``). Its non-strict mode leaves those size checks out
    (the fusion is then taken at every length, as it already was at every length but the shortest). ``{}`` where
    this torch has no such option."""
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


def _compile_kwargs(mode: str | None, options: dict) -> dict:
    """``torch.compile``'s keywords for ``mode`` and ``options`` together (it takes one or the other): the mode's own
    options (``reduce-overhead``: CUDA graphs) with ``options`` added."""
    if not options:
        return {"mode": mode}
    from torch._inductor import list_mode_options

    return {"options": {**(list_mode_options(mode) if mode else {}), **options}}


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (a cached one counts: it is traced again)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _tensors(outputs) -> list[torch.Tensor]:
    """The floating-point tensors in the forward's outputs, its fifth (a dict of the objectives' outputs) included."""
    if isinstance(outputs, torch.Tensor):
        return [outputs] if outputs.is_floating_point() else []
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, (list, tuple)):
        return [t for item in outputs for t in _tensors(item)]
    return []


class _FixedRows:
    """Calls ``fn`` on exactly ``rows`` rows: fewer are padded (zeros) and the output cut, more go in
    chunks. A compiled function then sees one shape whatever the batch. ``dynamic_length``: the
    inputs' second dimension is marked dynamic from the first call: one compiled graph for the
    lengths its guards admit (compiled with ``dynamic_length_options``, without the GPU's guarding size
    checks). ``by_length``:
    the rows of inputs of a given length (a NaFlex tower's packed patches ``[n, L, row]`` under a
    token budget), ``rows`` for the others; read at each call."""

    def __init__(self, fn, rows: int, dynamic_length: bool = False, by_length: dict[int, int] | None = None):
        self.fn, self.rows, self.dynamic_length = fn, int(rows), dynamic_length
        self.by_length = {} if by_length is None else by_length

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        n, rows = inputs.shape[0], self.by_length.get(inputs.shape[1], self.rows) if inputs.dim() > 1 else self.rows
        if n == rows:
            return self._call(inputs)
        outputs = []
        for start in range(0, n, rows):
            chunk = inputs[start:start + rows]
            short = rows - chunk.shape[0]
            if short:
                chunk = torch.cat([chunk, _filler(chunk, short)])
            outputs.append(self._call(chunk)[: rows - short])
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _call(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.dynamic_length:
            torch._dynamo.maybe_mark_dynamic(inputs, 1)
        return self.fn(inputs)


def _filler(chunk: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` rows that pad ``chunk`` to a compiled call's rows (their outputs are cut): zeros, or for a
    NaFlex tower's packed patches (uint8 ``[n, L, row]``) copies of the first row, an image with its patches
    (all-padding rows would pool over no patch: 0 / 0 in the forward, NaN in the backward)."""
    if chunk.dim() == 3 and chunk.dtype == torch.uint8:
        return chunk[:1].expand(rows, *chunk.shape[1:])
    return chunk.new_zeros((rows, *chunk.shape[1:]))


def _run_blocks_outside_the_graph(stack: nn.Module, dynamic_length: bool = False) -> None:
    """``compile_towers(scope="block")``: ``stack`` (the module whose forward runs a tower's blocks in
    turn) runs its forward outside the tower's compiled graph (``torch.compiler.disable``), so that
    the tower compiles around it (images normalised, patches embedded, the final norm and projection,
    fused as whole-tower compilation fuses them) and each block in it calls its own compiled graph,
    one for all layers. Set on the instance: the class and the state dict are unchanged.
    ``dynamic_length``: the blocks' inputs (``[b, L, e]`` and the ``[L, L]`` mask) get their length
    marked dynamic (captions cut to varying lengths: one graph for the lengths its guards admit)."""
    forward = stack.forward

    @torch.compiler.disable
    def run_blocks(x: torch.Tensor, *args, **kwargs):
        if dynamic_length:
            torch._dynamo.maybe_mark_dynamic(x, 1)
            mask = kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                torch._dynamo.maybe_mark_dynamic(mask, 0)
                torch._dynamo.maybe_mark_dynamic(mask, 1)
        return forward(x, *args, **kwargs)

    stack.forward = run_blocks


def init_caption_decoder(clip):
    """A CoCa's caption decoder's output projection, which open_clip leaves uninitialised (``torch.empty``:
    its ``MultimodalTransformer.init_parameters`` is never called), drawn as open_clip draws the text tower's
    (normal, std width^-0.5); pretrained weights replace it. Returns ``clip``."""
    decoder = getattr(clip, "text_decoder", None)
    if decoder is not None:
        with torch.no_grad():
            nn.init.normal_(decoder.text_projection, std=decoder.width ** -0.5)
    return clip


def _dataclass_kwargs(cls, values: dict[str, Any], key: str) -> dict[str, Any]:
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{no_such_option(f'{key}.{unknown[0]}', known)} (open_clip's {cls.__name__})")
    return values


def build_clip(**values: Any) -> ClipModel:
    """Build a CLIP from tower configs.

    ``image``/``text`` hold open_clip's ``CLIPVisionCfg``/``CLIPTextCfg`` fields, plus our own:
    ``image.ckpt`` (a local image-tower state dict), ``*.unlocked_layers`` (with ``lock_*``: keep
    the last N layers trainable), and for a Hugging Face text tower ``text.hf_path`` (a local model
    folder: weights and tokenizer), ``text.pooling`` (``cls`` or ``mean``) and ``text.proj``
    (``linear`` or ``mlp``). ``pretrained``: local weights of the whole model (a file or an
    open_clip folder, ``pretrained.resolve_pretrained``). ``preprocess``: ``model.preprocess.*``
    (null values: the pretrained folder's, else OpenAI CLIP's).
    ``init_logit_bias``: a learnable logit bias with this initial value (the sigmoid loss's).
    ``lock_image`` / ``lock_text`` freeze a whole tower, projection included (LiT).
    ``multimodal``: open_clip's ``MultimodalCfg`` fields: a CoCa, whose caption decoder reads the image
    tower's tokens (``loss.caption_weight`` trains it; the towers then output their tokens).
    The keywords are ``ModelSpec``'s (``models/spec.py``, the type ``build_openclip`` takes too); ``name``,
    ``embed_dim``, ``image`` and ``text`` are required.
    """
    spec = ModelSpec.of(values, "build_clip", refused={
        "arch": "an open_clip architecture is built by model=openclip (build_openclip)"})
    for key in ("name", "embed_dim"):
        if getattr(spec, key) is None:
            raise ConfigError(f"model.{key} is not set: build_clip needs it (configs/model/tiny.yaml gives one)")
    name, embed_dim, pretrained, preprocess = spec.name, int(spec.embed_dim), spec.pretrained, spec.preprocess
    quick_gelu = bool(spec.quick_gelu)
    init_logit_scale = OPENAI_LOGIT_SCALE if spec.init_logit_scale is None else spec.init_logit_scale
    init_logit_bias, multimodal = spec.init_logit_bias, spec.multimodal
    grad_checkpointing, lock_image, lock_text = spec.grad_checkpointing, spec.lock_image, spec.lock_text
    image, text = dict(spec.image), dict(spec.text)
    image_ckpt = image.pop("ckpt", None)
    image_unlocked = int(image.pop("unlocked_layers", 0) or 0)
    text_unlocked = int(text.pop("unlocked_layers", 0) or 0)
    naflex = naflex_cfg(image)
    vision_cfg = _dataclass_kwargs(CLIPVisionCfg, PLACEHOLDER_VISION if naflex else image, "model.image")
    model_cfg: dict[str, Any] = {"embed_dim": embed_dim, "quick_gelu": quick_gelu, "vision_cfg": vision_cfg}
    if naflex is not None and multimodal:
        raise ConfigError("model.image.naflex=true with model.multimodal (a CoCa): its decoder reads an open_clip "
                          "ViT's tokens; set model.image.naflex=false or use a CLIP")
    if init_logit_bias is not None:
        model_cfg["init_logit_bias"] = init_logit_bias
    hf_path = text.pop("hf_path", None)
    if hf_path:
        model_cfg.update(custom_text=True, text_cfg=_hf_text_cfg(hf_path, text))
        clip = CustomTextCLIP(embed_dim=embed_dim, vision_cfg=CLIPVisionCfg(**vision_cfg),
                              text_cfg=CLIPTextCfg(**model_cfg["text_cfg"]), quick_gelu=quick_gelu,
                              init_logit_scale=init_logit_scale, init_logit_bias=init_logit_bias)
    elif multimodal:
        from open_clip.coca_model import CoCa, MultimodalCfg

        for key in ("pooling", "proj"):
            text.pop(key, None)
        vision_cfg.update(attentional_pool=True, output_tokens=True)
        model_cfg.update(vision_cfg=vision_cfg, custom_text=True,
                         text_cfg={**_dataclass_kwargs(CLIPTextCfg, text, "model.text"), "embed_cls": True,
                                   "output_tokens": True},
                         multimodal_cfg=_dataclass_kwargs(MultimodalCfg, dict(multimodal), "model.multimodal"))
        clip = CoCa(embed_dim, MultimodalCfg(**model_cfg["multimodal_cfg"]), CLIPTextCfg(**model_cfg["text_cfg"]),
                    CLIPVisionCfg(**vision_cfg), quick_gelu=quick_gelu, init_logit_scale=init_logit_scale,
                    init_logit_bias=init_logit_bias)
        init_caption_decoder(clip)  # open_clip leaves its projection uninitialised
        clip.text_decoder.requires_grad_(False)  # trained only with loss.caption_weight > 0 (train/build/parts.py)
    else:
        for key in ("pooling", "proj"):
            text.pop(key, None)
        model_cfg["text_cfg"] = _dataclass_kwargs(CLIPTextCfg, text, "model.text")
        clip = CLIP(embed_dim=embed_dim, vision_cfg=CLIPVisionCfg(**vision_cfg),
                    text_cfg=CLIPTextCfg(**model_cfg["text_cfg"]),
                    quick_gelu=quick_gelu, init_logit_scale=init_logit_scale, init_logit_bias=init_logit_bias)
    if naflex is not None:
        use_naflex_tower(clip, model_cfg, naflex)
    source = resolve_pretrained(pretrained)
    if source is not None:
        load_weights(clip, source.weights, "model.pretrained", f"model={name}")
    image_source = resolve_pretrained(image_ckpt, "model.image.ckpt")
    if image_source is not None:
        load_weights(clip.visual, image_source.weights, "model.image.ckpt", f"model={name}'s image tower",
                     prefix="visual.")
    set_model_preprocess_cfg(clip, resolve_preprocess(
        source.config.get("preprocess_cfg", {}) if source and source.config else {}, preprocess or {},
        clip.visual.image_size, "model.preprocess"))
    if grad_checkpointing:
        clip.set_grad_checkpointing(True)
    model = ClipModel(clip, name, model_cfg)
    lock_towers(model, lock_image, lock_text, image_unlocked, text_unlocked,
                image_pretrained=bool(image_ckpt or source), text_pretrained=bool(hf_path or source))
    attach_decoder(model, spec.decoder)
    return model


# the open_clip ViT a CLIP is first built with where a NaFlex tower (model.image.naflex) replaces it: the smallest
PLACEHOLDER_VISION = {"image_size": 8, "patch_size": 8, "width": 8, "layers": 1, "head_width": 8}


def naflex_cfg(image: dict[str, Any]) -> NaFlexCfg | None:
    """``model.image.naflex``: the NaFlex tower's ``NaFlexCfg`` of the other ``model.image`` keys (popped from
    ``image``), else ``None`` (the key removed)."""
    if not image.pop("naflex", False):
        for key in ("max_seq_len", "variant", "ls_init_value", "proj"):
            if image.pop(key, None) is not None:
                raise ConfigError(f"model.image.{key} is a NaFlex tower's key, and model.image.naflex is off: set "
                                  "model.image.naflex=true (model=vit_b16_naflex), or remove the key")
        return None
    values = {key: image.pop(key) for key in list(image)}
    return NaFlexCfg.of(values)


def use_naflex_tower(clip, model_cfg: dict[str, Any], cfg: NaFlexCfg) -> None:
    """``clip``'s image tower replaced by a NaFlex tower of ``cfg`` (``models/naflex.py``); ``model_cfg`` records
    open_clip's ``vision_cfg`` of the same layout (``TimmModel``'s)."""
    clip.visual = NaFlexTower(cfg, int(model_cfg["embed_dim"]))
    model_cfg["vision_cfg"] = clip.visual.vision_cfg()


def attach_views(model: ClipModel, values) -> None:
    """A description's ``views`` (a mapping, or ``None``): ``self_distill``'s heads attached where it has them."""
    from .views import ViewsCfg

    cfg = ViewsCfg.of(values)
    if cfg is not None:
        model.attach_views(cfg)


def attach_decoder(model: ClipModel, values) -> None:
    """``model.decoder`` (a mapping, or ``None``): its caption decoder attached where it has layers."""
    from .decoder import DecoderCfg

    cfg = DecoderCfg.of(values)
    if cfg is not None:
        model.attach_decoder(cfg)


def lock_towers(model: ClipModel, lock_image: bool, lock_text: bool, image_unlocked: int, text_unlocked: int,
                image_pretrained: bool, text_pretrained: bool) -> None:
    """``model.lock_image`` / ``model.lock_text``: freeze a tower (LiT), all but its last
    ``*.unlocked_layers`` layers if given; warn when the frozen tower was never trained."""
    if lock_image:
        if not image_pretrained:
            log.warning("model.lock_image=true on a randomly initialised image tower: give model.pretrained "
                        "(or model.image.ckpt) local weights (LiT locks a pretrained tower)")
        _lock(model, "image", image_unlocked)
    if lock_text:
        if not text_pretrained:
            log.warning("model.lock_text=true on a randomly initialised text tower")
        _lock(model, "text", text_unlocked)


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: what JSON and ``torch.load(weights_only=True)`` keep as is."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _lock_hf_text(text: nn.Module, unlocked_layers: int) -> None:
    """Freeze a Hugging Face text tower except its last ``unlocked_layers`` transformer layers and
    what follows them (pooler, projection). The layers are the encoder's longest ModuleList."""
    layer_lists = [m for m in text.transformer.modules() if isinstance(m, nn.ModuleList)]
    if not layer_lists:
        raise ConfigError("model.text.unlocked_layers: no layer list found in this text tower")
    layers = max(layer_lists, key=len)
    if unlocked_layers > len(layers):
        raise ConfigError(f"model.text.unlocked_layers={unlocked_layers} > the tower's {len(layers)} layers")
    for param in text.parameters():
        param.requires_grad_(False)
    for module in list(layers)[-unlocked_layers:]:
        module.requires_grad_(True)
    for name, module in text.named_children():
        if name != "transformer":  # pooler and projection follow the layers
            module.requires_grad_(True)


def _hf_text_cfg(hf_path: str, text: dict[str, Any]) -> dict[str, Any]:
    """open_clip's Hugging Face text tower over a *local* model folder (never a hub name)."""
    path = os.path.expanduser(str(hf_path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model.text.hf_path={hf_path!r} is not a Hugging Face model folder (no config.json); "
            "text towers load only from local paths, e.g. a folder written by save_pretrained()"
        )
    pooling = text.pop("pooling", "mean")
    poolers = {"mean": "mean_pooler", "cls": "cls_pooler"}
    if pooling not in poolers:
        raise ConfigError(f"model.text.pooling={pooling!r}; use cls or mean")
    proj = text.pop("proj", "linear")
    if proj not in ("linear", "mlp"):
        raise ConfigError(f"model.text.proj={proj!r}; use linear or mlp")
    context_length = int(text.pop("context_length", 77))
    ignored = sorted(k for k in text if k not in ("vocab_size", "width", "heads", "layers", "mlp_ratio"))
    if ignored:
        raise ConfigError(f"model.text: {ignored} do not apply to a Hugging Face text tower")
    return {"hf_model_name": path, "hf_tokenizer_name": path, "hf_model_pretrained": True,
            "hf_pooler_type": poolers[pooling], "hf_proj_type": proj, "context_length": context_length}


def _lock(model: ClipModel, tower: str, unlocked_layers: int) -> None:
    """Freeze ``tower`` whole (projection included), or all but its last ``unlocked_layers``."""
    if unlocked_layers <= 0:
        for _, param in model.tower_parameters(tower):
            param.requires_grad_(False)
    elif tower == "image":
        model.clip.visual.lock(unlocked_groups=unlocked_layers)
    elif isinstance(model.clip, CustomTextCLIP):
        _lock_hf_text(model.clip.text, unlocked_layers)
    else:
        model.clip.lock_text_tower(unlocked_layers=unlocked_layers)
    trainable = sum(p.numel() for _, p in model.tower_parameters(tower) if p.requires_grad)
    log.info("locked the %s tower: %d trainable parameters left", tower, trainable)
    model.train(model.training)  # frozen towers switch to eval mode


# model.* keys the run applies to a built model, not builder arguments (config.schema.ModelSettings), and the
# removed options that configs stored by older checkpoints still hold
RUN_SETTINGS = (*(spec.name for spec in fields(ModelSettings)), *RETIRED_MODEL_KEYS)


def builder_node(node):
    """The ``model`` config less its run settings (``compile``, ``compile_scope``, ``cuda_graphs``:
    ``ClipModel.compile_towers``; ``trim_text``: ``ClipModel.trim_text``; ``direct_attention``,
    ``attention``: ``models/attention.py``; ``patch_gemm``: ``models/patches.py``; ``gelu``: ``models/mlp.py``;
    ``fp8``: ``models/fp8.py``)."""
    from omegaconf import OmegaConf

    if not any(key in node for key in RUN_SETTINGS):
        return node
    return OmegaConf.masked_copy(node, [key for key in node if key not in RUN_SETTINGS])


def build_model(node) -> ClipModel:
    """``instantiate`` the ``model`` config, its attention blocks computed directly where
    ``model.direct_attention`` is set (``models/attention.py``) and its patch embedding as a GEMM
    where ``model.patch_gemm`` is (``models/patches.py``) and its MLPs with the tanh GELU where
    ``model.gelu=tanh`` (``models/mlp.py``): the same parameters, so a run, a
    benchmark and an evaluation build the same model; a ``ConfigError`` raised while building
    reaches the caller as itself (one line naming the key), not wrapped in Hydra's exception."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from .attention import use_direct_attention
    from .mlp import use_tanh_gelu
    from .patches import use_patch_gemm
    try:
        model = instantiate(builder_node(node), _convert_="all")
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError):
            raise error.__cause__ from None
        raise
    settings = model_settings(node)  # a stored config's absent keys: as before the key existed
    if settings.image_features == "stored":
        model.use_stored_image_features()
    if settings.direct_attention:
        use_direct_attention(model, settings.attention)
    if settings.patch_gemm:
        use_patch_gemm(model)
    if settings.gelu == "tanh":
        use_tanh_gelu(model)
    return model
