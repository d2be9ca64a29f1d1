"""The moving average of the weights (``ema.*``): against a hand-rolled average, across a resume, under
FSDP on 2 ranks (sharded checkpoint included), evaluated and exported with ``weights=ema``."""

from __future__ import annotations

import json

import pytest
import torch

from megabatch.config import ConfigError
from megabatch.config.schema import validate
from megabatch.train import run
from megabatch.train.step.ema import WeightAverage

from ..helpers import ROOT, compose, rel_error, run_ranks, run_script


def hand_rolled(snapshots: list[dict], decay: float, every: int, power: float | None) -> dict:
    """The average of the weights after each step (``snapshots``), written out plainly."""
    average, updates = None, 0
    for number, weights in enumerate(snapshots, start=1):
        if number % every:
            continue
        if updates == 0:
            rate = 0.0
        else:
            rate = decay if power is None else min(decay, 1 - (1 + updates) ** -power)
        average = {n: w.double().clone() for n, w in weights.items()} if average is None else \
            {n: rate * average[n] + (1 - rate) * weights[n].double() for n in weights}
        updates += 1
    return average


@pytest.mark.parametrize("every,power,dtype", [(1, 0.6667, torch.float32), (2, None, torch.float32),
                                                (1, None, torch.bfloat16)])
def test_the_average_is_the_hand_rolled_one(every, power, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(dtype)
    model[0].bias.requires_grad_(False)  # not trained: not averaged
    average = WeightAverage(model, decay=0.9, every=every, warmup_power=power)
    assert average.names == ["0.weight", "1.weight", "1.bias"]
    assert all(a.dtype == torch.float32 for a in average.average)  # bf16 weights: averaged in fp32
    optimizer, snapshots = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5), []
    for _ in range(7):
        model(torch.randn(8, 5, dtype=dtype)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        average.step()
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    expected = hand_rolled(snapshots, 0.9, every, power)
    for name, value in zip(average.names, average.average, strict=True):
        assert rel_error(value.double(), expected[name]) <= 1e-6, name
        assert rel_error(value.double(), snapshots[-1][name].double()) > 1e-3  # an average, not the weights
    raw = {n: p.detach().clone() for n, p in model.named_parameters()}
    with average.swapped():
        for name, value in zip(average.names, average.average, strict=True):
            assert torch.equal(dict(model.named_parameters())[name], value.to(dtype))
    for name, param in model.named_parameters():  # put back
        assert torch.equal(param, raw[name]), name


TINY = ["batch=32", "trainer.max_steps=4", "trainer.log_every=1", "trainer.ckpt_every=1", "trainer.keep_ckpts=null",
        "eval=none", "sched.warmup_steps=2", "data.train.shuffle_buffer=64", "ema.decay=0.8", "ema.every=1"]


def train(run_dir, *extra: str) -> dict:
    cfg = compose(*TINY, *extra)
    cfg.run_dir = str(run_dir)
    run(cfg)
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


def test_the_runs_average_is_hand_rolled_across_a_resume_evaluated_and_exported(tmp_path):
    """2 steps + resume + 2 steps: the last checkpoint's average equals the average hand-rolled from
    each step's checkpointed weights (steps 1-2 before the resume, 3-4 after: the resumed average went
    on from the saved one); ``scripts/evaluate.py`` evaluates both (``eval.<name>.weights=auto``), and
    the export of ``weights=ema`` holds the average."""
    train(tmp_path / "run", "trainer.stop_at_step=2")
    resumed = train(tmp_path / "run", "resume=latest")
    assert resumed["ema"]["updates"] == 4 and resumed["ema"]["steps"] == 4
    steps = [torch.load(tmp_path / "run" / "checkpoints" / f"step_{n:08d}.pt", weights_only=True)["model"]
             for n in range(1, 5)]
    expected = hand_rolled([{n: s[n] for n in resumed["ema"]["weights"]} for s in steps], 0.8, 1, 0.6667)
    for name, value in resumed["ema"]["weights"].items():
        assert rel_error(value.double(), expected[name]) <= 1e-6, name
    assert any(not torch.equal(value, resumed["model"][name]) for name, value in resumed["ema"]["weights"].items())

    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    done = run_script(str(ROOT / "scripts" / "evaluate.py"), f"ckpt={ckpt}", cwd=tmp_path)
    raw = json.loads((ckpt.parent / "last.eval-digits.json").read_text())
    ema = json.loads((ckpt.parent / "last.eval-digits-ema.json").read_text())
    assert (raw["weights"], ema["weights"]) == ("raw", "ema") and "digits-ema" in done.stdout

    from safetensors.torch import load_file

    from megabatch.checkpoint.files import load_checkpoint
    from megabatch.checkpoint.model import model_from_checkpoint
    from megabatch.models.export import export_open_clip

    out = export_open_clip(model_from_checkpoint(load_checkpoint(ckpt), "ema"), tmp_path / "export")  # export.py's
    exported = load_file(out / "open_clip_model.safetensors")
    projection = next(name for name in resumed["ema"]["weights"] if name.endswith("text_projection"))
    assert torch.equal(exported[projection.removeprefix("clip.")], resumed["ema"]["weights"][projection])


def test_bad_ema_settings_name_the_key():
    from megabatch.checkpoint.files import model_weights

    for override, key in (("ema.decay=1.5", "ema.decay"), ("ema.every=0", "ema.every"),
                          ("ema.warmup_power=-1", "ema.warmup_power"), ("+ema.beta=0.9", "ema.beta"),
                          ("eval.digits.weights=ema", "eval.digits.weights"),
                          ("eval.digits.weights=average", "eval.digits.weights")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(compose(override))
    with pytest.raises(ConfigError, match="no moving average.*weights=raw"):  # a checkpoint trained without one
        model_weights({"model": {}, "step": 1}, "ema", "weights")


def sharded_average(rank: int, world: int, ckpt_dir: str) -> dict:
    """Three ``TrainStep.step`` updates with ``ema.decay``, replicated (DDP) and sharded (FSDP): each
    step's weights, the average; the sharded one saved in a DCP checkpoint, changed, and loaded back."""
    from megabatch.checkpoint.checkpointer import Checkpointer, TrainState
    from megabatch.checkpoint.files import load_checkpoint
    from megabatch.distributed.fsdp import full

    from ..train.test_gradcache import build

    result = {}
    for name, extra in (("ddp", []), ("fsdp", ["trainer.parallel=fsdp"])):
        parts = build("trainer.sub_batch=4", "model.image.patch_dropout=0", "ema.decay=0.7", "ema.warmup_power=null",
                      *extra)
        stream, snapshots, average = parts.inputs(0), [], parts.step.ema
        for number in (1, 2, 3):
            parts.step.step(stream, lr=0.05, number=number)
            snapshots.append({n: full(p).detach().clone() for n, p in parts.model.named_parameters()
                              if p.requires_grad})
        result[name] = {"snapshots": snapshots,
                        "average": {n: full(a).clone() for n, a in zip(average.names, average.average, strict=True)}}
    from pathlib import Path

    checkpointer = Checkpointer(Path(ckpt_dir), parts.model, parts.optimizer,
                                {"train_state": TrainState(3, 3 * 32), "ema": average}, header=lambda: {},
                                sharded=True, keep=None, main=rank == 0, distributed=True)
    checkpointer.save(3, numbered=False)
    parts.step.step(stream, lr=0.05, number=4)  # the average moves on, then is read back
    path = Path(ckpt_dir) / "last.dcp"
    checkpointer.load(path, load_checkpoint(path, weights=False))
    result["reloaded"] = {n: full(a).clone() for n, a in zip(average.names, average.average, strict=True)}
    result["updates"] = average.updates
    if rank == 0:
        result["whole"] = load_checkpoint(path)["ema"]["weights"]  # read whole, as evaluation and export do
    return result


def test_the_average_under_fsdp_on_two_ranks_is_ddps_and_its_checkpoint_reshards(tmp_path):
    ranks = run_ranks(2, sharded_average, str(tmp_path / "ckpt"), tmp_path=tmp_path)
    for result in ranks:
        ddp, fsdp = result["ddp"], result["fsdp"]
        expected = hand_rolled(ddp["snapshots"], 0.7, 1, None)
        for name, value in fsdp["average"].items():
            assert rel_error(value.double(), expected[name]) <= 1e-5, name
            assert rel_error(ddp["average"][name].double(), expected[name]) <= 1e-6, name
            assert torch.equal(result["reloaded"][name], value), name  # step 4's change undone by the load
        assert result["updates"] == 3
    for name, value in ranks[0]["fsdp"]["average"].items():
        assert torch.equal(ranks[0]["whole"][name], value), name
        assert torch.equal(ranks[1]["fsdp"]["average"][name], value), name
