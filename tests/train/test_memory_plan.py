"""trainer.sub_batch=auto: the planner fits the Inf-CL paper's linear memory model through two
probes and picks the largest divisor of the per-rank batch that fits; the config keys' checks."""

from __future__ import annotations

import pytest

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.train.build.memory_plan import MemoryFit, batch_bytes, divisors, plan_sub_batch

from ..helpers import compose

GB = 1e9


def test_the_line_through_two_probes():
    fit = MemoryFit.through([(64, 3.25 * GB), (32, 2.11 * GB)])  # ViT-B/32 bf16 on an H100 (measured)
    assert fit.per_row == pytest.approx(1.14 * GB / 32)
    assert fit.peak(32) == pytest.approx(2.11 * GB) and fit.peak(64) == pytest.approx(3.25 * GB)
    with pytest.raises(ValueError):
        MemoryFit.through([(32, GB), (32, 2 * GB)])


def test_the_largest_divisor_that_fits_is_chosen():
    fit = MemoryFit(fixed=1 * GB, per_row=0.1 * GB)  # 1 GB + 100 MB per sample
    # 0.9 x 80 GB = 72 GB, less 2 GB held for the batch: 70 GB -> at most 690 rows -> 512 divides 32k
    choice = plan_sub_batch(32768, fit, 80 * GB, 0.9, batch_bytes=2 * GB)
    assert choice.sub_batch == 512 and choice.predicted_bytes == pytest.approx(1 * GB + 51.2 * GB + 2 * GB)
    # a batch of 3 x 1000: the largest divisor up to 690 is 600
    assert plan_sub_batch(3000, fit, 80 * GB, 0.9, batch_bytes=2 * GB).sub_batch == 600
    # a lower memory fraction, a smaller choice
    assert plan_sub_batch(32768, fit, 80 * GB, 0.5, batch_bytes=2 * GB).sub_batch == 256
    # everything fits: the whole per-rank batch (no GradCache needed)
    assert plan_sub_batch(256, fit, 80 * GB, 0.9).sub_batch == 256


def test_the_graphs_that_fit_beside_the_chosen_sub_batch():
    """``trainer.keep_graph=auto``: what the chosen sub-batch leaves of the budget, in kept graphs of
    ``graph_per_row x sub_batch`` each (the measured graph), else ``per_row x sub_batch``."""
    # 0.9 x 141 GB = 126.9 GB, 2 GB held: 8192 rows (1 + 81.92 GB) fit, 16384 do not; 41.98 GB left
    fit = MemoryFit(fixed=1 * GB, per_row=0.01 * GB, graph_per_row=0.001 * GB)
    choice = plan_sub_batch(32768, fit, 141 * GB, 0.9, batch_bytes=2 * GB)
    assert choice.sub_batch == 8192 and choice.graphs_that_fit == 5  # 8.192 GB a graph
    # not measured: a whole forward-backward a graph (81.92 GB): none beside it
    unmeasured = MemoryFit(fixed=1 * GB, per_row=0.01 * GB)
    assert plan_sub_batch(32768, unmeasured, 141 * GB, 0.9, batch_bytes=2 * GB).graphs_that_fit == 0
    # a batch the divisors leave room beside: 3,000 rows, 600 (61 GB) of 70 GB, 9 GB left, 6 GB a graph
    assert plan_sub_batch(3000, MemoryFit(1 * GB, 0.1 * GB, 0.01 * GB), 80 * GB, 0.9,
                          batch_bytes=2 * GB).graphs_that_fit == 1


def test_the_graph_is_fitted_through_the_probes():
    fit = MemoryFit.through([(64, 3.25 * GB, 1.2 * GB), (32, 2.11 * GB, 0.7 * GB)])
    assert fit.graph_per_row == pytest.approx(0.5 * GB / 32)
    assert MemoryFit.through([(32, 2.11 * GB), (64, 3.25 * GB)]).graph_per_row == 0.0


def test_nothing_fitting_is_a_clear_error():
    with pytest.raises(ConfigError, match="trainer.sub_batch=auto: not even one sample fits.*trainer.offload=true"):
        plan_sub_batch(1024, MemoryFit(fixed=70 * GB, per_row=0.1 * GB), 80 * GB, 0.9, batch_bytes=5 * GB)


def test_what_the_batch_holds():
    # 1024 rows x 512 dims x 2 towers x (bf16 buffer + fp32 copy + fp32 gradient) + kept inputs + Adam
    held = batch_bytes(1024, 512, 2, kept_input_bytes_per_row=77 * 8, trainable_params=1000)
    assert held == 1024 * 512 * 2 * (2 + 4 + 4) + 1024 * 77 * 8 + 8 * 1000
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_the_keys_are_checked():
    validate(compose("trainer.sub_batch=auto", "trainer.memory_fraction=0.8"))
    with pytest.raises(ConfigError, match="trainer.memory_fraction=1.5"):
        validate(compose("trainer.memory_fraction=1.5"))
    with pytest.raises(ConfigError, match="trainer.sub_batch"):
        validate(compose("trainer.sub_batch=most"))
    with pytest.raises(ConfigError, match="data.decode"):
        validate(compose("data.decode=fpga"))
    validate(compose("data.decode_ahead_gb=2.5"))
    for bad in ("-1", "lots", "true"):
        with pytest.raises(ConfigError, match="data.decode_ahead_gb"):
            validate(compose(f"data.decode_ahead_gb={bad}"))
    validate(compose("data.decode_threads=6"))
    for bad in ("1", "lots", "true", "2.5"):
        with pytest.raises(ConfigError, match="data.decode_threads"):
            validate(compose(f"data.decode_threads={bad}"))
    with pytest.raises(ConfigError, match="model.compile"):
        validate(compose("model.compile=maybe"))


def test_fsdp_reduces_once_per_step_where_the_whole_gradient_fits():
    """``trainer.fsdp_reduce=auto``: once per step (the whole gradient held) unless that halves the
    sub-batch or nothing fits beside the gradient; ``step`` counts the gradient or fails clearly."""
    from megabatch.train.build.memory_plan import plan_sub_batch_and_reduction as plan

    fit = MemoryFit(fixed=1 * GB, per_row=0.1 * GB)
    # 70 GB beside the batch: 512 rows per sub-batch alone; with a 10 GB gradient 512 still fits (52.2 GB)
    choice, reduce = plan(32768, fit, 80 * GB, 0.9, 2 * GB, 10 * GB, "auto")
    assert (choice.sub_batch, reduce) == (512, "step")
    assert choice.predicted_bytes == pytest.approx(1 * GB + 51.2 * GB + 12 * GB)
    # a 30 GB gradient: 256 rows beside it (half of 512): still once per step
    assert plan(32768, fit, 80 * GB, 0.9, 2 * GB, 30 * GB, "auto")[0].sub_batch == 256
    assert plan(32768, fit, 80 * GB, 0.9, 2 * GB, 30 * GB, "auto")[1] == "step"
    # a 50 GB gradient: 128 rows, a quarter: reduce per sub-batch, at 512
    choice, reduce = plan(32768, fit, 80 * GB, 0.9, 2 * GB, 50 * GB, "auto")
    assert (choice.sub_batch, reduce) == (512, "sub_batch")
    # a 70 GB gradient: nothing fits beside it
    assert plan(32768, fit, 80 * GB, 0.9, 2 * GB, 70 * GB, "auto")[1] == "sub_batch"
    with pytest.raises(ConfigError, match="not even one sample fits"):
        plan(32768, fit, 80 * GB, 0.9, 2 * GB, 70 * GB, "step")
    # asked for: per sub-batch, or once per step at what fits beside the gradient
    assert plan(32768, fit, 80 * GB, 0.9, 2 * GB, 50 * GB, "sub_batch") == (plan_sub_batch(32768, fit, 80 * GB, 0.9,
                                                                                           2 * GB), "sub_batch")
    assert plan(32768, fit, 80 * GB, 0.9, 2 * GB, 50 * GB, "step")[0].sub_batch == 128
    # not sharded: the plan alone
    assert plan(32768, fit, 80 * GB, 0.9, 2 * GB, 0, None)[1] is None


def test_a_teachers_features_are_held_for_the_batch():
    """``distill.teacher``: its image and text features in GradCache's buffers and as the loss's fp32 copies,
    and on several ranks every rank's teacher and student text features gathered; a plan with them picks a smaller
    sub-batch where they take the room."""
    from megabatch.train.build.memory_plan import teacher_bytes

    assert teacher_bytes(1024, 1, 768, 2) == 1024 * 768 * 2 * (2 + 4)
    assert teacher_bytes(1024, 4, 768, 2) == 1024 * 768 * 2 * (2 + 4) + 4 * 1024 * 768 * 4
    # with the student's width: every rank's text features gathered, and their gradient, in fp32
    assert teacher_bytes(1024, 4, 768, 2, 512) == teacher_bytes(1024, 4, 768, 2) + 4 * 1024 * 512 * 8
    assert teacher_bytes(1024, 1, 768, 2, 512) == teacher_bytes(1024, 1, 768, 2)  # one process: nothing gathered
    assert teacher_bytes(1024, 1, 3 * 768, 2) == 3 * teacher_bytes(1024, 1, 768, 2)  # a stored ensemble of three
    fit = MemoryFit(fixed=1 * GB, per_row=0.1 * GB)
    alone = plan_sub_batch(1 << 20, fit, 141 * GB, 0.9, batch_bytes=20 * GB)
    distilled = plan_sub_batch(1 << 20, fit, 141 * GB, 0.9, batch_bytes=20 * GB + teacher_bytes(1 << 20, 1, 768, 2))
    assert distilled.sub_batch < alone.sub_batch


def test_a_naflex_towers_token_budget_fits_every_lengths_joined_sub_batch():
    """A NaFlex tower trained at 4 and 16 patches (``LengthFits``): the sub-batch at 16 patches sets the token budget,
    under which a step at 4 patches joins the loader's sub-batches (``BatchPlan.joined``). The text tower costs the
    same per caption at either length, so the joined short sub-batch is what limits: 32 images fit at 16 patches,
    but 32 at 16 joins 64 at 4, which does not; 8 at 16 (32 at 4) is the plan."""
    from megabatch.train.build.memory_plan import LengthFits

    fits = {4: MemoryFit(fixed=1 * GB, per_row=0.008 * GB), 16: MemoryFit(fixed=1 * GB, per_row=0.010 * GB)}
    assert plan_sub_batch(64, fits[16], 1.4 * GB, 1.0).sub_batch == 32  # the longest length alone
    lengths = LengthFits(fits, rank_batch=64)
    assert lengths.rows(32) == {4: 64, 16: 32} and lengths.rows(16) == {4: 64, 16: 16}
    choice = plan_sub_batch(64, lengths, 1.4 * GB, 1.0)
    assert (choice.sub_batch, choice.token_budget) == (8, 128) and lengths.rows(8) == {4: 32, 16: 8}
    assert choice.predicted_bytes == pytest.approx(1 * GB + 32 * 0.008 * GB)  # the 4-patch sub-batch's peak
    assert plan_sub_batch(64, fits[16], 1.4 * GB, 1.0).token_budget is None


def test_auto_measures_a_naflex_tower_at_each_length_and_plans_a_token_budget(monkeypatch):
    """``trainer.sub_batch=auto`` with a NaFlex tower at ``data.naflex.seq_lens=[4,16]``: probed at each length (on a
    stand-in GPU whose peaks grow with the images' patches and, per caption, with the text tower), the choice is a
    token budget, and the batch plan joins a 4-patch step's sub-batches under it."""
    import torch

    from megabatch.config.run import RunSettings
    from megabatch.distributed.env import DistEnv
    from megabatch.models import build_model
    from megabatch.train.build import parts
    from megabatch.train.step.plan import BatchPlan

    cfg = validate(compose("model=tiny_naflex", "data.naflex.seq_lens=[4,16]", "batch=256", "trainer.sub_batch=auto"))
    settings = RunSettings.of(cfg)
    model = build_model(cfg.model)
    model.image_lengths = (4, 16)
    probed = []

    def probe(model, rows, precision, device, caption=False, views=False, seq_len=None):
        images, _ = model.example_inputs(rows, torch.device("meta"), seq_len=seq_len)
        probed.append((rows, images.shape[1]))
        return 1 * GB + rows * (0.05 * GB + images.shape[1] * 0.001 * GB), 0

    monkeypatch.setattr(parts, "probe_peak_memory", probe)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 10 * GB}))
    env = DistEnv(device=torch.device("cuda"))
    precision = parts.precision_of(settings, DistEnv())
    choice = parts.choose_sub_batch(settings, model, env, precision, join_lengths=True)
    assert sorted(probed) == [(32, 4), (32, 16), (64, 4), (64, 16)]
    # 0.9 x 10 GB less what the batch holds: 64 at 16 patches would fit (5.2 GB), but joins 256 at 4 (15 GB)
    assert (choice.sub_batch, choice.token_budget) == (32, 512)
    rows = choice.fit.rows(choice.sub_batch)
    assert rows == {4: 128, 16: 32} and choice.predicted_bytes <= 9 * GB  # 128 at 4 patches: 7.9 GB
    plan = BatchPlan.of(settings, 1, 4096, sub_batch=choice.sub_batch, longest=16, token_budget=choice.token_budget)
    assert plan.token_budget == choice.token_budget and plan.rows_at((4, 16)) == rows
    # without joining (the shard split): measured at the longest length alone, no budget
    probed.clear()
    plain = parts.choose_sub_batch(settings, model, env, precision, join_lengths=False)
    assert sorted(probed) == [(32, 16), (64, 16)] and plain.token_budget is None


def test_the_probes_are_kept_for_the_next_run_of_the_same_model(monkeypatch, tmp_path, caplog):
    """``ProbeCache``: the first run measures and keeps the peaks; the same model again reads them and runs no probe
    (a warm start); other probes asked, a damaged file or MEGABATCH_PROBE_CACHE=0 measure again. The key follows the
    model and the trainer's precision, not the run's length or name."""
    import logging

    import torch

    from megabatch.config.run import RunSettings
    from megabatch.distributed.env import DistEnv
    from megabatch.models import build_model
    from megabatch.train.build import parts
    from megabatch.train.build.memory_plan import ProbeCache

    def config(*overrides):
        cfg = validate(compose("model=tiny", "batch=256", "trainer.sub_batch=auto", *overrides))
        cfg.data.cache_dir = str(tmp_path)
        return cfg

    cfg = config()
    settings, model = RunSettings.of(cfg), build_model(cfg.model)
    probed = []

    def probe(model, rows, precision, device, caption=False, views=False, seq_len=None):
        probed.append(rows)
        return int(1 * GB + rows * 0.05 * GB), int(rows * 0.01 * GB)

    monkeypatch.setattr(parts, "probe_peak_memory", probe)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 10 * GB}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in GPU")
    env = DistEnv(device=torch.device("cuda"))
    precision = parts.precision_of(settings, DistEnv())
    cache = ProbeCache.for_run(cfg, 0, 1, env.device)
    assert cache.path.parent == tmp_path / "probes" and not cache.path.exists()
    first = parts.choose_sub_batch(settings, model, env, precision, probe_cache=cache)
    assert probed == [32, 64] and cache.path.is_file()
    again = ProbeCache.for_run(config("trainer.max_steps=7", "name=other"), 0, 1, env.device)
    assert again.path == cache.path  # the run's length and name are not in the key
    with caplog.at_level(logging.INFO, logger="megabatch"):
        second = parts.choose_sub_batch(settings, model, env, precision, probe_cache=again)
    assert probed == [32, 64] and second == first  # nothing probed: the same choice from the kept peaks
    assert "kept in" in caplog.text
    # another model, another precision: another file
    assert ProbeCache.for_run(config("model.image.width=64"), 0, 1, env.device).path != cache.path
    assert ProbeCache.for_run(config("trainer.precision=fp32"), 0, 1, env.device).path != cache.path
    # other probes asked of the same file (a caption loss's): measured again
    cache.write({"sizes": [32, 64], "lengths": [None], "caption": True, "views": False}, {None: [(32, 1, 0)]})
    parts.choose_sub_batch(settings, model, env, precision, probe_cache=cache)
    assert probed == [32, 64] * 2
    cache.path.write_text("{not json")  # damaged: measured again, written whole
    assert parts.choose_sub_batch(settings, model, env, precision, probe_cache=cache) == first
    assert probed == [32, 64] * 3 and cache.read({"sizes": [32, 64], "lengths": [None], "caption": False,
                                                  "views": False}) is not None
    monkeypatch.setenv("MEGABATCH_PROBE_CACHE", "0")
    assert ProbeCache.for_run(cfg, 0, 1, env.device).path is None
    monkeypatch.delenv("MEGABATCH_PROBE_CACHE")
    assert ProbeCache.for_run(cfg, 0, 1, torch.device("cpu")).path is None


def test_the_flop_count_is_kept_so_the_same_command_again_counts_nothing(tmp_path, monkeypatch):
    """``parts.model_flops``: on a GPU the towers' FLOPs are counted once (an eager forward under the FLOP counter)
    and kept in ``data.cache_dir`` under the probes' key and the rows; the same command again reads them. Off (or
    with a file that does not read) they are counted."""
    import torch

    from megabatch.config.run import RunSettings
    from megabatch.distributed import DistEnv
    from megabatch.train.build import parts
    from megabatch.train.step.utilization import ModelFlops

    counted = []

    class Model:  # what model_flops asks of the model; the count itself is count_model_flops's (its own tests)
        def example_inputs(self, rows, device):
            return rows, device

    def count(model, rows, device):
        counted.append(rows)
        return ModelFlops(1.5e9, 2.5e8, True, False)

    monkeypatch.setattr(parts, "count_model_flops", count)
    monkeypatch.setattr(parts, "probe_key", lambda cfg, rank, world, device: {"model": cfg.model.name})
    cfg = validate(compose("batch=64", f"data.cache_dir={tmp_path}"))
    settings, gpu = RunSettings.of(cfg), DistEnv(device=torch.device("cuda"))  # (no CUDA call: the count is stubbed)
    first = parts.model_flops(cfg, settings, Model(), gpu)
    assert first == ModelFlops(1.5e9, 2.5e8, True, False) and counted == [64]
    assert [path.parent.name for path in tmp_path.rglob("*.json")] == ["flops"]
    assert parts.model_flops(cfg, settings, Model(), gpu) == first and counted == [64]  # read, not counted
    monkeypatch.setenv("MEGABATCH_PROBE_CACHE", "0")
    assert parts.model_flops(cfg, settings, Model(), gpu) == first and counted == [64, 64]
    monkeypatch.delenv("MEGABATCH_PROBE_CACHE")
    next(tmp_path.rglob("*.json")).write_text("{}")  # a file that does not read: counted again
    assert parts.model_flops(cfg, settings, Model(), gpu) == first and counted == [64, 64, 64]
    assert parts.model_flops(cfg, settings, Model(), DistEnv()) == first and counted == [64] * 4  # the CPU: not kept
