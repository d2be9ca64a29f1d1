"""A NaFlex image tower (``model.image.naflex``, timm's ``NaFlexVit``) trains exactly as a fixed-size one: images
of mixed aspect ratios, packed per sub-batch at a drawn sequence length, give the same loss and gradients in one
pass, with GradCache sub-batches, with offload (the kept bytes decoded and packed again) and on 2 gloo ranks; and
the packed layout is timm's patches with their coordinates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megabatch.data.naflex import NaFlexSpec
from megabatch.data.shard_writer import Sample, encode_png, write_shards
from megabatch.kernels.packed_patches import unpack
from megabatch.models import build_model

from ..helpers import compose, rel_error, run_ranks
from .test_gradcache import BATCH, flat
from .test_objectives_contract import assert_same, gradients, run_parts

# (height, width) of the images, cycled: square, wide, tall, 1:3 and 3:1, smaller and larger than the grid
SHAPES = [(32, 32), (16, 48), (40, 20), (24, 72), (60, 20), (16, 16), (33, 47)]
NAFLEX = ["model=tiny_naflex", "data.naflex.seq_lens=[9,16]"]
PATHS = {"gradcache": [f"trainer.sub_batch={BATCH // 4}"],
         "offload": [f"trainer.sub_batch={BATCH // 4}", "trainer.offload=true"]}
# trainer.sub_batch_tokens: 8 images of 16 patches a sub-batch (128 of the 144), 16 of 9; seed 1 draws 9 for step 0
TOKENS, SHORT_FIRST = "trainer.sub_batch_tokens=144", "seed=1"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """64 captioned images of mixed sizes and aspect ratios, as shards."""
    folder, rng, samples = tmp_path_factory.mktemp("naflex"), np.random.default_rng(0), []
    for i in range(64):
        height, width = SHAPES[i % len(SHAPES)]
        samples.append(Sample(encode_png(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)), "png",
                              f"a photo of {i % 10}"))
    write_shards(samples, folder, "n", per_shard=16)
    return {"urls": str(folder / "n-{000000..000003}.tar")}


def test_packed_patches_are_timms_patches_with_their_coordinates():
    from timm.data.naflex_transforms import patchify_image

    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(16,))
    image = torch.randint(0, 256, (3, 16, 48), dtype=torch.uint8)
    packed = spec.patches(image, 16)
    assert packed.shape == (16, 3 * 64 + 4)
    pixels, coord, _ = patchify_image(image, (8, 8))  # 16 x 48 already fits 12 patches of 16: not resized
    unpacked = unpack(packed[None], 8, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert torch.equal(unpacked["patch_valid"][0], torch.arange(16) < 12)
    assert torch.equal(unpacked["patch_coord"][0, :12], coord)
    assert torch.equal((unpacked["patches"][0, :12] * 255).round().to(torch.uint8), pixels)
    # at 9 patches the sides are rounded up to whole patches as far as they fit (timm's search): 2 x 4
    assert spec.target_size(16, 48, 9) == (16, 32)
    assert int(unpack(spec.patches(image, 9)[None], 8, (0.0,) * 3, (1.0,) * 3)["patch_valid"].sum()) == 8


def test_padding_rows_change_no_feature():
    """A sub-batch is packed to its longest image: the others' padding rows are masked out of attention and
    pooling, so an image's features do not depend on the length it is padded to."""
    model = build_model(compose(*NAFLEX).model).eval()
    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(9, 16))
    images = [torch.randint(0, 256, shape, dtype=torch.uint8) for shape in [(3, 16, 48), (3, 40, 20)]]
    short = spec.collate([spec.patches(image, 9) for image in images])  # 9 rows each
    mixed = spec.collate([spec.patches(images[0], 9), spec.patches(images[1], 16)])  # the first padded to 16
    assert short.shape[1] == 9 and mixed.shape[1] == 16
    texts = torch.ones(2, 16, dtype=torch.long)
    with torch.no_grad():
        assert rel_error(model(mixed[:1], texts[:1])[0], model(short[:1], texts[:1])[0]) <= 1e-6


def test_the_grids_are_read_in_one_copy_as_timm_reads_them(monkeypatch):
    """timm reads each image's grid with two ``.item()`` calls (a GPU wait each), for its position embeddings
    (then ``PositionsOnDevice``'s, which read none) and its other paths; ``grid_sizes_in_one_copy`` reads all of
    them in one ``tolist``, to the same sizes; the tower's forward reads nothing to the host."""
    from timm.models import naflexvit

    from megabatch.models.naflex import TIMMS, grid_sizes_in_one_copy

    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(16,))
    images = [torch.randint(0, 256, (3, *shape), dtype=torch.uint8) for shape in SHAPES]
    packed = spec.collate([spec.patches(image, 16) for image in images])
    coord = unpack(packed, 8, (0.0,) * 3, (1.0,) * 3)["patch_coord"]
    model = build_model(compose(*NAFLEX).model).eval()
    assert naflexvit.calculate_naflex_grid_sizes is grid_sizes_in_one_copy
    assert grid_sizes_in_one_copy(coord) == TIMMS["calculate_naflex_grid_sizes"](coord)
    assert len(set(grid_sizes_in_one_copy(coord))) > 3  # images of several grids
    reads = {"item": 0, "tolist": 0}
    for name in reads:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k:
                            reads.__setitem__(_n, reads[_n] + 1) or _o(self, *a, **k))
    with torch.no_grad():
        model.clip.visual(packed)
    assert reads == {"item": 0, "tolist": 0}


def grids_of(shapes: list[tuple[int, int]], tokens: int) -> torch.Tensor:
    """Raster patch coordinates ``[n, tokens, 2]`` of grids of these (rows, columns), zero on the padding."""
    coord = torch.zeros(len(shapes), tokens, 2, dtype=torch.long)
    for i, (rows, columns) in enumerate(shapes):
        y, x = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
        coord[i, :rows * columns] = torch.stack([y.flatten(), x.flatten()], dim=1)
    return coord


@pytest.mark.parametrize("variant", ["naflexvit_base_patch16_gap", "naflexvit_base_patch16_siglip"])
@pytest.mark.parametrize("square", [False, True])
def test_the_position_embeddings_are_timms_resized_per_grid_with_no_host_read(variant, square):
    """``PositionsOnDevice``: each patch's position embedding as timm's (the table resized per distinct grid by
    ``F.interpolate``, antialiased bicubic for the gap variants, bilinear for SigLIP's; ``square``: timm's
    aspect-preserving square grid, then cropped), with its gradient, computed as one product on the device: grids
    smaller and larger than the table, one patch wide or high, and padding rows that get none."""
    import copy

    import timm

    from megabatch.models.naflex import PositionsOnDevice, place_positions_on_device

    timms = timm.create_model(variant, pretrained=False, num_classes=0, embed_dim=32, depth=1, num_heads=2,
                              pos_embed_ar_preserving=square).embeds
    torch.nn.init.normal_(timms.pos_embed)
    ours = copy.deepcopy(timms)
    assert place_positions_on_device(ours) and type(ours) is PositionsOnDevice
    shapes = [(16, 16), (1, 7), (7, 1), (1, 1), (3, 5), (11, 22), (22, 11), (4, 40), (17, 15), (2, 128)]
    coord = grids_of(shapes, 260)
    tokens = torch.randn(len(shapes), 260, 32)
    weights = torch.randn_like(tokens)
    results = []
    for embeds in (timms, ours):
        x = tokens.clone()
        embeds._apply_learned_naflex_pos_embed(x, coord)
        (x * weights).sum().backward()
        results.append((x.detach(), embeds.pos_embed.grad))
    (want, want_grad), (got, got_grad) = results
    assert rel_error(got, want) <= 1e-6 and rel_error(got_grad, want_grad) <= 1e-6
    padding = torch.arange(260) >= torch.tensor([rows * columns for rows, columns in shapes])[:, None]
    assert torch.equal(got[padding], tokens[padding])
    # one graph: no host read to break it (timm's path reads the grids and loops over them in Python)
    compiled = torch.compile(lambda x, c: ours._apply_learned_naflex_pos_embed(x, c) or x, fullgraph=True,
                             backend="eager")
    assert rel_error(compiled(tokens.clone(), coord).detach(), want) <= 1e-6


def test_position_settings_the_resize_does_not_compute_keep_timms_path():
    import timm

    from megabatch.models.naflex import place_positions_on_device

    for kwargs in ({"pos_embed_use_grid_sample": True}, {"pos_embed_align_corners": True},
                   {"pos_embed_interp_mode": "nearest"}):
        embeds = timm.create_model("naflexvit_base_patch16_gap", pretrained=False, num_classes=0, embed_dim=32,
                                   depth=1, num_heads=2, **kwargs).embeds
        assert not place_positions_on_device(embeds) and type(embeds).__name__ == "NaFlexEmbeds"


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_the_blocks_given_each_images_length_compute_timms_masked_attention(attention):
    """``model.direct_attention`` (the default): the tower passes each image's sequence length to its blocks
    (``LengthsAttention``) instead of timm's ``[n, 1, L, L]`` mask; SDPA with the key mask and the kernels, which
    skip the padding, give timm's features and gradients (images of several lengths, padded to the longest)."""
    from megabatch.models.naflex import LengthsAttention

    timms = build_model(compose(*NAFLEX, "model.direct_attention=false").model)
    ours = build_model(compose(*NAFLEX, f"model.attention={attention}").model)
    ours.load_state_dict(timms.state_dict())
    assert ours.clip.visual.lengths and not timms.clip.visual.lengths
    assert all(type(block.attn) is LengthsAttention for block in ours.clip.visual.trunk.blocks)
    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(16,))
    generator = torch.Generator().manual_seed(0)
    packed = spec.collate([spec.patches(torch.randint(0, 256, (3, *shape), dtype=torch.uint8, generator=generator),
                                        16) for shape in SHAPES])
    assert len(set(unpack(packed, 8, (0.0,) * 3, (1.0,) * 3)["patch_valid"].sum(1).tolist())) > 2
    texts = torch.ones(len(SHAPES), 16, dtype=torch.long)
    weights = torch.randn(len(SHAPES), ours.clip.visual.head.proj.out_features, generator=generator)
    results = []
    for model in (timms, ours):
        features = model(packed, texts)[0]
        (features * weights).sum().backward()
        results.append((features.detach(), [param.grad for param in model.clip.visual.parameters()]))
    (want, want_grads), (got, got_grads) = results
    assert rel_error(got, want) <= 1e-5
    assert all(rel_error(grad, wanted) <= 1e-5 for grad, wanted in zip(got_grads, want_grads, strict=True))


def test_patch_dropout_in_training_keeps_timms_mask(monkeypatch):
    """Patch dropout shuffles the valid patches out of the row's lead: the tower then passes no lengths."""
    from megabatch.models.naflex import LengthsAttention

    model = build_model(compose(*NAFLEX, "model.image.patch_dropout=0.5").model)
    masks = []
    original = LengthsAttention.forward
    monkeypatch.setattr(LengthsAttention, "forward", lambda self, x, attn_mask=None, **kw:
                        masks.append(attn_mask.dim()) or original(self, x, attn_mask=attn_mask, **kw))
    images, texts = model.example_inputs(2, torch.device("cpu"))
    model.train()(images, texts)
    model.eval()(images, texts)
    layers = len(model.clip.visual.trunk.blocks)
    assert masks == [4] * layers + [1] * layers


def test_a_naflex_model_is_rebuilt_from_its_description():
    from megabatch.models.openclip import from_description

    model = build_model(compose(*NAFLEX).model)
    again = from_description(model.description())
    again.load_state_dict(model.state_dict())
    images, texts = model.example_inputs(3, torch.device("cpu"))
    assert images.dtype == torch.uint8 and images.shape == (3, 16, 3 * 64 + 4)
    assert torch.equal(model(images, texts)[0], again(images, texts)[0])


def test_locking_and_layer_decay_take_the_naflex_towers_blocks():
    """``model.lock_image`` freezes the whole NaFlex trunk; ``optim.layer_decay.image`` gives its embeddings depth 0,
    block i depth i + 1 and the final norm and projection the top, as for open_clip's towers."""
    from megabatch.train.build.optim import param_groups

    locked = build_model(compose(*NAFLEX, "model.lock_image=true").model)
    assert not any(p.requires_grad for n, p in locked.named_parameters() if n.startswith("clip.visual."))
    assert any(p.requires_grad for n, p in locked.named_parameters() if n.startswith("clip.transformer."))
    model = build_model(compose(*NAFLEX).model)
    image = [g for g in param_groups(model, 0.2, {"image": 0.5, "text": None}) if g["name"].startswith("image/")]
    layers = len(model.clip.visual.trunk.blocks)
    depths = [int(group["name"].split()[1]) for group in image]  # "image/depth 2 of 4"
    assert set(depths) == set(range(layers + 2))
    for depth, group in zip(depths, image, strict=True):
        assert group["lr_scale"] == pytest.approx(0.5 ** (layers + 1 - depth))
    trunk = {id(p) for n, p in model.named_parameters() if n.startswith("clip.visual.")}
    assert trunk == {id(p) for group in image for p in group["params"]}


def test_every_path_gives_the_one_pass_loss_and_gradients(data):
    one_pass = gradients(data, *NAFLEX)
    assert torch.isfinite(flat(one_pass["grads"])).all()
    assert any(name.startswith("clip.visual.trunk.") for name in one_pass["grads"])
    for path, extra in PATHS.items():
        assert_same(gradients(data, *NAFLEX, *extra), one_pass, path)
    # patch dropout's draws replayed: GradCache against one pass with the same draws
    dropped = gradients(data, *NAFLEX, "model.image.patch_dropout=0.25")
    assert rel_error(flat(dropped["grads"]), flat(one_pass["grads"])) > 1e-4  # it drops patches
    assert_same(gradients(data, *NAFLEX, "model.image.patch_dropout=0.25", *PATHS["gradcache"]), dropped,
                "gradcache with patch dropout")


def test_a_token_budget_joins_the_sub_batches_of_shorter_images(data):
    """``trainer.sub_batch_tokens``: the loader cuts each step into the sub-batches that fit the budget at the
    longest length (4 of 8 images of 16 patches); a step of 9-patch images has them joined two by two (16 images,
    144 patches each), and gives the one-pass loss and gradients, with offload too (the joined bytes decoded
    again)."""
    from megabatch.data.token_groups import TokenGroups

    parts = run_parts(data, *NAFLEX, TOKENS)  # seed 0: a step of 16 patches, then one of 9
    stream = parts.inputs(0)
    try:
        assert isinstance(stream, TokenGroups) and (parts.plan.sub_batch, parts.plan.sub_batches) == (8, 4)
        for count, shape in ((4, (8, 16)), (2, (16, 9))):
            assert stream.step_sub_batches() == count
            taken = [next(stream) for _ in range(count)]
            assert [tuple(sub.images.shape[:2]) for sub in taken] == [shape] * count
            assert all(len(sub.texts) == shape[0] for sub in taken)
    finally:
        stream.close()
        parts.close()
    one_pass = gradients(data, *NAFLEX, SHORT_FIRST)
    for extra in ([TOKENS], [TOKENS, "trainer.offload=true"]):
        assert_same(gradients(data, *NAFLEX, SHORT_FIRST, *extra), one_pass, " ".join(extra))


def test_a_token_budgets_sub_batches_are_compiled_and_warmed_at_their_rows():
    """Compiled towers see one shape per length (``_FixedRows``): under a token budget a length's rows are its own
    (``ClipModel.image_rows``), neither cut into chunks of the longest length's rows nor padded to them, and the
    warm-up compiles each length at them."""
    import contextlib

    from megabatch.models.clip import _FixedRows

    seen = []
    fixed = _FixedRows(lambda x: seen.append(tuple(x.shape[:2])) or x.float().sum((1, 2)), rows=4, by_length={9: 8})
    for shape in ((8, 9), (8, 16), (6, 9)):
        assert fixed(torch.ones(*shape, 5, dtype=torch.uint8)).shape == (shape[0],)
    assert seen == [(8, 9), (4, 16), (4, 16), (8, 9)]
    model = build_model(compose(*NAFLEX).model).train()
    model.image_lengths, model.image_rows, seen = (9, 16), {9: 8, 16: 4}, []
    model.clip.visual.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape[:2])))
    model.warm_up(4, torch.device("cpu"), contextlib.nullcontext, graph_free=True)
    assert set(seen) == {(8, 9), (4, 16)}


def test_a_token_budget_is_checked_at_start(data):
    """Less than one image at the longest length, beside trainer.sub_batch, without a NaFlex tower, with the
    shard split (whose sub-batches mix lengths): each a config error naming the keys and the fix."""
    from megabatch.config import ConfigError

    for extra, match in ((["trainer.sub_batch_tokens=15"], r"less than one image .*\(16 patches"),
                         ([TOKENS, "trainer.sub_batch=8"], "not both"),
                         ([TOKENS, "data.train.split=shard"], "data.train.split=indexed")):
        with pytest.raises(ConfigError, match=match):
            run_parts(data, *NAFLEX, *extra)
    with pytest.raises(ConfigError, match="model.image.naflex=true"):
        run_parts(data, TOKENS)


def two_ranks(rank: int, world: int, data: dict) -> dict:
    return {"ddp": gradients(data, *NAFLEX, "trainer.sub_batch=4"),
            "fsdp": gradients(data, *NAFLEX, "trainer.sub_batch=4", "trainer.parallel=fsdp"),
            "fsdp, tokens": gradients(data, *NAFLEX, SHORT_FIRST, "trainer.sub_batch_tokens=72",
                                      "trainer.parallel=fsdp", "trainer.fsdp_reduce=sub_batch")}


def test_two_ranks_equal_one_process(data, tmp_path):
    """DDP and FSDP (the NaFlex tower's blocks each a unit, as an open_clip tower's: timm keeps them in a
    Sequential) on 2 gloo ranks; FSDP with a token budget's joined sub-batches (each rank's 16 images: 4 sub-batches
    at 16 patches, 2 at 9), reducing after each."""
    from megabatch.distributed.fsdp import transformer_blocks

    model = build_model(compose(*NAFLEX).model)
    units = {id(block) for block in transformer_blocks(model)}
    assert {id(block) for block in model.clip.visual.trunk.blocks} <= units
    assert not any(isinstance(unit, torch.nn.Linear) for unit in transformer_blocks(model))
    single = {"": gradients(data, *NAFLEX), SHORT_FIRST: gradients(data, *NAFLEX, SHORT_FIRST)}
    for rank, results in enumerate(run_ranks(2, two_ranks, data, tmp_path=tmp_path)):
        for parallel, result in results.items():
            assert_same(result, single[SHORT_FIRST if "tokens" in parallel else ""], f"rank {rank}, {parallel}")


def test_the_naflex_decoder_crosses_to_a_fork_servers_workers():
    """A GPU run's loader workers start from a fork server: the dataset, its decoder included, is pickled."""
    import pickle

    from megabatch.data.samples import SampleDecoder, decode_rgb
    from megabatch.data.shard_writer import encode_png

    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(9, 16), group=32)
    decoder = pickle.loads(pickle.dumps(SampleDecoder(spec, seed=0, epoch=0)))
    png = encode_png(np.zeros((16, 48, 3), dtype=np.uint8))
    assert torch.equal(decoder(png, 5), SampleDecoder(spec, seed=0, epoch=0)(decode_rgb(png), 5))
    on_gpu = pickle.loads(pickle.dumps(SampleDecoder(spec, seed=0, epoch=0, gpu=True)))  # data.decode=gpu's
    assert torch.equal(on_gpu(on_gpu.decode(png), 5), decoder(png, 5))  # a PNG: the worker packs it


def test_evaluation_keeps_the_aspect_ratio_at_the_sets_sequence_length(tmp_path):
    """``eval.<name>.seq_len``: each image as that many patches at most, its aspect ratio kept; a checkpoint's NaFlex
    model evaluates at any length (the position embeddings resized per image)."""
    from PIL import Image

    from megabatch.eval.zeroshot import run_zeroshot

    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(16,))
    wide = Image.fromarray(np.zeros((16, 48, 3), dtype=np.uint8))
    for seq_len, grid in ((16, (2, 6)), (9, (2, 4)), (36, (3, 9))):
        packed = spec.eval_transform(seq_len)(wide)
        unpacked = unpack(packed[None], 8, (0.0,) * 3, (1.0,) * 3)
        assert packed.shape[0] == seq_len and int(unpacked["patch_valid"].sum()) == grid[0] * grid[1]
        assert unpacked["patch_coord"][0].max(0).values.tolist() == [grid[0] - 1, grid[1] - 1]
    cfg = compose(*NAFLEX, "eval=digits")
    torch.manual_seed(0)
    model = build_model(cfg.model)
    results = {seq_len: run_zeroshot(model, model.tokenizer(), {**cfg.eval.digits, "seq_len": seq_len}, cfg.data,
                                     torch.device("cpu")) for seq_len in (16, 9)}
    assert results[16]["samples"] == results[9]["samples"] == 360
    assert results[16]["top1"] != results[9]["top1"]  # the images were cut to another length


def test_a_tower_open_clip_cannot_rebuild_is_not_exported_and_the_flops_are_counted(tmp_path):
    """open_clip's released package rebuilds a NaFlex tower at its timm variant's own sizes only: the tiny one is
    refused by name, before anything is written. timm's SigLIP variant (attention pooling) is counted as the
    other towers are."""
    from megabatch.config import ConfigError
    from megabatch.models.export import export_open_clip
    from megabatch.train.step.utilization import count_model_flops

    model = build_model(compose(*NAFLEX).model)
    with pytest.raises(ConfigError, match="naflexvit_base_patch16_gap at its own sizes"):
        export_open_clip(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    siglip = build_model(compose(*NAFLEX, "model.image.variant=naflexvit_base_patch16_siglip").model)
    flops = count_model_flops(siglip, *siglip.example_inputs(2, torch.device("cpu")))
    assert flops.image_forward > 0 and all(p.requires_grad for p in siglip.parameters())


def test_openclips_naflex_checkpoints_load(tmp_path):
    """OpenCLIP's NaFlex ViT-B/16 (its main branch's config: timm's ``naflexvit_base_patch16_gap`` in a ``TimmModel``,
    average pooling, a linear projection, open_clip's text tower under ``text.`` as ``custom_text`` saves it) has
    ``model=vit_b16_naflex``'s tensors, names and shapes, once the text tower is named as a ``CLIP`` names it (built
    on the meta device, as open_clip's released package builds it); and such a training checkpoint (``state_dict``,
    ``module.`` prefixes) loads through ``model.pretrained`` with every tensor as saved."""
    import open_clip

    from megabatch.models.pretrained import text_tower_layout

    cfg = {"embed_dim": 512, "vision_cfg": {"image_size": 224, "timm_model_name": "naflexvit_base_patch16_gap"},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12}}
    with torch.device("meta"):
        theirs = open_clip.model.CustomTextCLIP(**cfg).state_dict()
        own = build_model(compose("model=vit_b16_naflex").model).clip.state_dict()
    renamed = text_tower_layout(theirs, own)
    assert renamed.keys() == own.keys() and any(k.startswith("text.") for k in theirs)
    assert all(renamed[name].shape == tensor.shape for name, tensor in own.items())
    torch.manual_seed(1)
    saved = build_model(compose(*NAFLEX).model).clip.state_dict()
    custom = {f"module.{'' if k.startswith(('visual.', 'logit_')) else 'text.'}{k}": v for k, v in saved.items()}
    torch.save({"state_dict": custom, "epoch": 1}, tmp_path / "epoch_1.pt")
    loaded = build_model(compose(*NAFLEX, f"model.pretrained={tmp_path / 'epoch_1.pt'}").model).clip.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())


# OpenCLIP main's ViT-B-16-SigLIP2-naflex image tower (the Hugging Face hub's timm/ViT-B-16-SigLIP2-naflex folder):
# timm's SigLIP variant, its attention pool's output the embedding; image_seq_len is main's key, not the released one's
SIGLIP2_NAFLEX = {"image_size": 384, "image_seq_len": 576, "timm_model_name": "naflexvit_base_patch16_siglip",
                  "timm_model_pretrained": False, "timm_pool": "map", "timm_proj": "none"}


def test_siglip2_naflex_folders_load_into_a_naflex_tower(tmp_path):
    """``model=openclip`` with an open_clip folder whose config names a timm ``naflexvit_*`` tower (SigLIP 2's NaFlex
    models as OpenCLIP's main branch and the Hugging Face hub keep them) builds megabatch's NaFlex tower of the same
    weights: the tower's names and shapes are what open_clip's ``TimmModel`` builds from that config, and the weights
    saved by open_clip (a small text tower here) give the same image and text features; a checkpoint's description
    rebuilds it."""
    import json

    import open_clip

    from megabatch.config import ConfigError
    from megabatch.models.naflex import NaFlexCfg, NaFlexTower
    from megabatch.models.openclip import from_description

    released = {key: value for key, value in SIGLIP2_NAFLEX.items() if key != "image_seq_len"}
    cfg = NaFlexCfg.of_open_clip(SIGLIP2_NAFLEX)
    assert (cfg.proj, cfg.max_seq_len, cfg.image_size, cfg.width, cfg.layers) == ("none", 576, 256, 768, 12)
    for pool in ("", "avg"):  # open_clip would build another tower: no pooling, or the mean of the tokens
        with pytest.raises(ConfigError, match="pools as timm's naflexvit_base_patch16_siglip does"):
            NaFlexCfg.of_open_clip({**SIGLIP2_NAFLEX, "timm_pool": pool})
    with torch.device("meta"):
        theirs = open_clip.model._build_vision_tower(768, released).state_dict()
        ours = NaFlexTower(cfg, 768).state_dict()
    assert {k: v.shape for k, v in theirs.items()} == {k: v.shape for k, v in ours.items()}
    model_cfg = {"embed_dim": 768, "init_logit_bias": -10, "custom_text": True, "vision_cfg": SIGLIP2_NAFLEX,
                 "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 64, "heads": 2, "layers": 1,
                              "no_causal_mask": True, "proj_bias": True, "pool_type": "last"}}
    torch.manual_seed(0)
    saved = open_clip.model.CustomTextCLIP(embed_dim=768, init_logit_bias=-10, vision_cfg=released,
                                           text_cfg=model_cfg["text_cfg"]).eval()
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {
        "size": 384, "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic", "resize_mode": "squash"}}))
    torch.save(saved.state_dict(), tmp_path / "open_clip_pytorch_model.bin")
    model = build_model(compose("model=openclip", "model.arch=null", f"model.pretrained={tmp_path}").model).eval()
    assert isinstance(model.clip.visual, NaFlexTower) and model.naflex == cfg
    images, texts = torch.rand(2, 3, 256, 256), torch.randint(1, 1000, (2, 16))
    with torch.no_grad():
        for ours_, theirs_ in ((model.encode_image(images), saved.encode_image(images)),
                               (model.encode_text(texts), saved.encode_text(texts))):
            assert rel_error(torch.nn.functional.normalize(ours_, dim=-1),
                             torch.nn.functional.normalize(theirs_, dim=-1)) <= 1e-6
        again = from_description(model.description())
        again.load_state_dict(model.state_dict())
        packed = model.clip.visual.example_inputs(2, 64)
        assert torch.equal(again.eval().encode_image(packed), model.encode_image(packed))
    # exported, it is the folder it came from: open_clip's released package builds and loads it strictly
    from safetensors.torch import load_file

    from megabatch.models.export import WEIGHTS_NAME, export_open_clip

    folder = export_open_clip(model, tmp_path / "export")
    exported = json.loads((folder / "open_clip_config.json").read_text())["model_cfg"]
    assert {k: exported["vision_cfg"][k] for k in ("timm_model_name", "timm_pool", "timm_proj")} == \
        {k: released[k] for k in ("timm_model_name", "timm_pool", "timm_proj")}
    rebuilt = open_clip.model.CustomTextCLIP(**{k: v for k, v in exported.items() if k != "custom_text"}).eval()
    rebuilt.load_state_dict(load_file(str(folder / WEIGHTS_NAME)))
    with torch.no_grad():
        assert rel_error(rebuilt.encode_image(images), saved.encode_image(images)) <= 1e-6


def test_layer_scale_is_the_variants_a_given_value_or_none():
    """``model.image.ls_init_value``: null keeps the variant's (1e-5), a value starts there, 0 removes layer scale
    (timm reads init_values=None as "the variant's": before, 0 left it at 1e-5)."""
    def gammas(value: str) -> list[torch.Tensor]:
        trunk = build_model(compose(*NAFLEX, f"model.image.ls_init_value={value}").model).clip.visual.trunk
        return [param for name, param in trunk.named_parameters() if ".ls1." in name or ".ls2." in name]

    assert all(torch.all(gamma == 1e-5) for gamma in gammas("null")) and gammas("null")
    assert all(torch.all(gamma == 0.1) for gamma in gammas("0.1")) and gammas("0.1")
    assert gammas("0") == []


def test_the_weight_init_is_timms_scheme_named():
    """``model.image.weight_init``: timm's schemes (jax: big_vision's Xavier, sqrt(2 / (96 + 288)) = 0.072 for the
    tiny tower's q/k/v, against the default's 0.02); another name is a config error naming the key."""
    from megabatch.config import ConfigError

    for init, std in (("''", 0.02), ("jax", (2 / (96 + 288)) ** 0.5)):
        weight = build_model(compose(*NAFLEX, f"model.image.weight_init={init}").model).clip.visual.trunk.blocks[0]
        assert float(weight.attn.qkv.weight.detach().std()) == pytest.approx(std, rel=0.05)
    with pytest.raises(ConfigError, match="model.image.weight_init='xavier'"):
        build_model(compose(*NAFLEX, "model.image.weight_init=xavier").model)


def test_a_timm_older_than_the_floor_is_named_with_the_fix(monkeypatch):
    """requirements.txt's timm floor (1.0.21: 1.0.16's patch dropout and 1.0.18's meta-device build fail the tests
    above) is checked where the tower is built."""
    import timm

    from megabatch.config import ConfigError

    monkeypatch.setattr(timm, "__version__", "1.0.18")
    with pytest.raises(ConfigError, match=r"needs timm >= 1\.0\.21 \(installed: 1\.0\.18.*pip install -U timm"):
        build_model(compose(*NAFLEX).model)


def test_a_variant_timm_does_not_have_is_a_config_error_naming_the_key():
    from megabatch.config import ConfigError

    with pytest.raises(ConfigError, match="model.image.variant=naflexvit_nope"):
        build_model(compose(*NAFLEX, "model.image.variant=naflexvit_nope").model)
    with pytest.raises(ConfigError, match="model.image_features=stored with a NaFlex image tower"):
        build_model(compose(*NAFLEX, "model.lock_image=true", "model.image_features=stored").model)
    with pytest.raises(ConfigError, match="model.image.max_seq_len is a NaFlex tower's key"):
        build_model(compose("model=vit_b16_naflex", "model.image.naflex=false").model)
    with pytest.raises(ConfigError, match="model.image.max_seq_len is a NaFlex tower's key, and model.arch=ViT-B-32"):
        build_model(compose("model=openclip", "model.arch=ViT-B-32", "+model.image.max_seq_len=256").model)


def test_the_training_crop_keeps_the_aspect_ratio_within_its_range_and_is_drawn_from_the_sample():
    """``data.train.augment`` for a NaFlex tower: a crop of the image's area share in ``scale``, its aspect ratio the
    image's times a factor in ``ratio``, the same for the same sample's seed (the offload's replay)."""
    spec = NaFlexSpec(patch_size=8, max_seq_len=16, seq_lens=(16,), scale=(0.5, 1.0), ratio=(0.8, 1.25))
    image = torch.randint(0, 256, (3, 60, 180), dtype=torch.uint8)
    for seed in range(20):
        crop = spec.crop(image, seed)
        height, width = crop.shape[-2:]
        assert 0.5 * 0.9 <= height * width / (60 * 180) <= 1.0
        assert 3 * 0.8 * 0.9 <= width / height <= 3 * 1.25 * 1.1 or width == 180 or height == 60
        assert torch.equal(crop, spec.crop(image, seed))
    assert len({tuple(spec.crop(image, seed).shape) for seed in range(20)}) > 5
    assert spec.crop(image, 3) is not image and NaFlexSpec(8, 16, (16,)).crop(image, 3) is image
