"""Evaluation on every rank together (eval/ranks.py): on 2 gloo ranks each set's numbers equal one process's
(zero-shot on the digits, a multi-label set, retrieval with several captions, image-caption selection, a linear
probe), every rank returns them, and each rank encodes only its share; a sharded model (FSDP) runs in lockstep, as
many forward passes on every rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megabatch.config.schema import validate
from megabatch.eval.ranks import Ranks

from ..helpers import compose, run_ranks
from .test_clip_benchmark_format import image, write_set
from .test_linear_probe import digit_folder


def write_sets(root) -> list[str]:
    """A retrieval folder, a multi-label folder, a probe folder (train and test) and a selection JSONL; the
    overrides that evaluate them and the embedded digits."""
    import io

    captions = [[f"picture {i}", f"image of {i}", f"photo {i}"][: 1 + i % 3] for i in range(9)]
    write_set(root / "pairs", [{"png": image(10 + i), "txt": "\n".join(texts)} for i, texts in enumerate(captions)],
              dataset_type="retrieval\n")
    rng = np.random.default_rng(0)

    def npy(vector) -> bytes:
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(vector, dtype=np.int64))
        return buffer.getvalue()

    write_set(root / "voc", [{"png": image(30 + i), "npy": npy(rng.random(4) < 0.4)} for i in range(11)],
              classnames="cat\ndog\nperson\ncar\n", zeroshot_classification_templates="a photo of a {c}\n",
              dataset_type="multilabel\n")
    digit_folder(root / "probe", 8, 0, "train")
    digit_folder(root / "probe", 3, 1, "test")
    (root / "probe" / "classnames.txt").write_text("red\ngreen\nblue\n")
    rows = []
    for index in range(7):
        (root / f"{index}.png").write_bytes(image(50 + index))
        rows.append({"image": f"{index}.png", "captions": [f"the digit {index}", f"the number {9 - index}"],
                     "subset": ["replace_obj", "swap_att"][index % 2]})
    (root / "sel.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["eval=[digits,retrieval,imagenet,digits_probe,sugarcrepe,digits_dense]", "eval.digits.batch_size=64",
            "eval.retrieval.format=clip_benchmark", f"eval.retrieval.root={root / 'pairs'}",
            "eval.retrieval.batch_size=2", "eval.imagenet.format=clip_benchmark", f"eval.imagenet.root={root / 'voc'}",
            "eval.imagenet.classnames=null", "eval.imagenet.templates=null", "eval.imagenet.batch_size=2",
            "eval.digits_probe.format=clip_benchmark", f"eval.digits_probe.root={root / 'probe'}",
            "eval.digits_probe.batch_size=4", "eval.digits_dense.format=clip_benchmark",
            f"eval.digits_dense.root={root / 'probe'}", "eval.digits_dense.classnames=null",
            "eval.digits_dense.batch_size=4", f"eval.sugarcrepe.jsonl={root / 'sel.jsonl'}",
            "eval.sugarcrepe.batch_size=2"]


def evaluate_sets(rank: int, world: int, overrides: list[str], lockstep: bool) -> dict:
    from megabatch.distributed import fsdp
    from megabatch.eval.zeroshot import run_zeroshot
    from megabatch.models import build_model

    cfg = validate(compose(*overrides))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    calls = {"image": [], "text": []}
    image_encoder, text_encoder = model.encode_image, model.encode_text
    model.encode_image = lambda x: calls["image"].append(len(x)) or image_encoder(x)
    model.encode_text = lambda x: calls["text"].append(len(x)) or text_encoder(x)
    if lockstep:  # as under FSDP: Ranks.of(model) asks fsdp.is_sharded
        fsdp.is_sharded = lambda module: module is model
    results = {name: run_zeroshot(model, model.tokenizer(), eval_cfg, cfg.data, torch.device("cpu"))
               for name, eval_cfg in cfg.eval.items()}
    return {"results": results, "calls": calls, "lockstep": Ranks.of(model).lockstep}


@pytest.mark.parametrize("lockstep", [False, True], ids=["ddp", "fsdp-lockstep"])
def test_two_ranks_give_one_processs_numbers(tmp_path, lockstep):
    overrides = write_sets(tmp_path)
    alone = evaluate_sets(0, 1, overrides, False)
    ranks = run_ranks(2, evaluate_sets, overrides, lockstep, tmp_path=tmp_path)
    for name, expected in alone["results"].items():
        assert set(expected) > {"samples"}, name
        for rank in ranks:
            assert rank["results"][name] == pytest.approx(expected, abs=1e-6), (name, rank["results"][name], expected)
    expected_metrics = {"digits": "top1", "retrieval": "image_to_text_R@1", "imagenet": "mAP",
                        "digits_probe": "lp_top1", "sugarcrepe": "acc", "digits_dense": "dense_miou"}
    assert all(metric in alone["results"][name] for name, metric in expected_metrics.items())
    images_alone = sum(alone["calls"]["image"])
    shares = [sum(rank["calls"]["image"]) for rank in ranks]
    stand_ins = len(expected_metrics) if lockstep else 0  # a one-row batch where a rank's share ran out
    assert images_alone <= sum(shares) <= images_alone + stand_ins  # each rank encoded its share, not the set
    assert max(shares) - min(shares) <= len(expected_metrics)
    assert all(rank["lockstep"] == lockstep for rank in ranks)
    if lockstep:  # as many forward passes on each rank (zero-row stand-ins where a rank's share ran out)
        assert len(ranks[0]["calls"]["image"]) == len(ranks[1]["calls"]["image"])
        assert len(ranks[0]["calls"]["text"]) == len(ranks[1]["calls"]["text"])
    else:
        assert len(ranks[0]["calls"]["image"]) != len(ranks[1]["calls"]["image"]) or shares[0] == shares[1]


def test_interleave_puts_every_ranks_rows_back_in_order():
    whole = torch.arange(7)
    parts = [whole[rank::3] for rank in range(3)]

    class Three(Ranks):
        def gather(self, value):
            return [part.clone() for part in parts]

    assert torch.equal(Three(0, 3).interleave(parts[0]), whole)
    assert Three(1, 3).take(list(range(7))) == [1, 4]


@pytest.mark.slow  # 30 s on 2 cores: make test-all
def test_evaluate_under_torchrun_writes_one_table_and_exits_cleanly(tmp_path):
    """The documented ``torchrun --nproc_per_node=N scripts/evaluate.py`` on 2 gloo ranks: status 0 (every rank's
    process group and heartbeat ended before exit), rank 0 alone writes the table, the probe's features are kept."""
    import os
    import subprocess
    import sys

    from megabatch.train import run

    from ..helpers import ROOT

    cfg = compose("batch=32", "trainer.max_steps=2", "data.train.shuffle_buffer=64", "eval=none")
    cfg.run_dir = str(tmp_path / "run")
    run(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(ROOT / "scripts/evaluate.py"),
               f"ckpt={ckpt}", "eval=[digits,digits_probe]", "eval.digits_probe.probe_epochs=2"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("| average | | |") == 1  # one table, printed by rank 0
    rows = json.loads((tmp_path / "run" / "checkpoints" / "last.results.json").read_text())["rows"]
    assert {("digits", "top1"), ("digits_probe", "lp_top1")} <= {(r["set"], r["metric"]) for r in rows}
    assert (tmp_path / "run" / "checkpoints" / "last.features" / "raw" / "digits_probe-train.pt").is_file()
