"""Every command line in README.md and docs/ composes: the docs cannot drift from the CLI.

Each ``python``/``torchrun``/``srun``/``docker run`` line of their ``bash`` blocks is split as the
shell splits it (quotes removed, comments dropped, continuations joined); ``train.py`` and
``scripts/evaluate.py`` arguments go through the entry points' own pattern quoting and compose with
Hydra (each value of a sweep in turn), launcher flags parse with torchrun's parser, and
``make_shards.py`` arguments with its own. Placeholders such as ``/data/...`` are fine: this is
composition, not a run.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from megabatch.config.cli import quote_patterns
from megabatch.config.compose import compose
from megabatch.config.schema import validate

from .helpers import ROOT

ENTRY_POINTS = {"train.py": "train", "scripts/evaluate.py": "evaluate"}
SKIPPED_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--info": 0, "-i": 0}


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_commands() -> list[str]:
    """The command lines of the ``bash`` blocks of README.md and docs/*.md, continuations joined."""
    text = "\n".join(path.read_text() for path in DOCUMENTS)
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.split()
            if words and (words[0] in ("python", "torchrun", "srun") or words[:2] == ["docker", "run"]):
                commands.append(" ".join(words))
    return commands


COMMANDS = readme_commands()


def test_readme_has_the_commands_this_test_is_about():
    assert len(COMMANDS) >= 40
    assert sum("experiment=" in c for c in COMMANDS) >= 6  # real-data commands start from a recipe
    assert any("batch=1M" in c and c.startswith("torchrun") for c in COMMANDS)
    assert any(c.startswith("srun python train.py") for c in COMMANDS)
    assert any("hydra/launcher=submitit_slurm" in c for c in COMMANDS)
    assert any("--nnodes" in c for c in COMMANDS)


def split(command: str) -> tuple[list[str], str, list[str]]:
    """(what precedes the script, the script, its arguments) as the shell would pass them."""
    words = [w for w in shlex.split(command, comments=True) if w != "&"]
    script = next(w for w in words if w.endswith(".py") or w.endswith(".sh"))
    index = words.index(script)
    return words[:index], script, words[index + 1:]


def check_launcher(before: list[str]) -> None:
    if "torchrun" in before:
        from torch.distributed.run import get_args_parser

        flags = before[before.index("torchrun") + 1:]
        get_args_parser().parse_args([*flags, "train.py"])  # exits (SystemExit) on an unknown flag
    elif before[:1] == ["python"] or before[:1] == ["srun"]:
        assert before in (["python"], ["srun", "python"]), before


def hydra_overrides(args: list[str]) -> tuple[list[str], bool]:
    """The overrides of a Hydra command line, and whether it is a multirun."""
    overrides, multirun, skip = [], False, 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in SKIPPED_FLAGS:
            skip = SKIPPED_FLAGS[arg]
        else:
            assert not arg.startswith("-"), f"unknown flag {arg}"
            overrides.append(arg)
    return overrides, multirun


def runs_of(overrides: list[str], multirun: bool) -> list[list[str]]:
    """One override list per value of each sweep (the others at their first value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    sweeps = [i for i, o in enumerate(parsed) if o.is_sweep_override()]
    assert multirun or not sweeps, f"a sweep without -m: {overrides}"
    values = {i: list(parsed[i].sweep_string_iterator()) for i in sweeps}
    first = [f"{o.get_key_element()}={values[i][0]}" if i in values else overrides[i]
             for i, o in enumerate(parsed)]
    runs = [first]
    for i in sweeps:
        for value in values[i][1:]:
            runs.append([*first[:i], f"{parsed[i].get_key_element()}={value}", *first[i + 1:]])
    return runs


@pytest.fixture
def placeholder_paths(monkeypatch):
    """The docs' data paths (/data/imagenet/val) are placeholders: the start-up check of an evaluation set's files
    (``check_eval_data``, tested on its own in tests/eval/test_eval_data_checked.py) is left out."""
    from megabatch.config import schema

    monkeypatch.setattr(schema, "check_eval_data", lambda eval_cfg: None)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_composes(command, placeholder_paths):
    before, script, args = split(command)
    if script.endswith(".sh"):  # docker/smoke.sh: its own test (tests/test_docker.py)
        return
    check_launcher(before)
    if script.endswith("compare_export.py"):  # key=value: exactly these two
        assert sorted(arg.partition("=")[0] for arg in args) == ["ckpt", "export"], args
        return
    if script.endswith(("make_shards.py", "export.py", "caption.py", "report.py", "config_reference.py",
                        "results_page.py")):
        name = Path(script).stem
        spec = importlib.util.spec_from_file_location(name, ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if name in ("export", "caption"):
            module.parse(args)  # key=value arguments: unknown or missing keys exit
        else:
            module.build_parser().parse_args(args)
        return
    assert script in ENTRY_POINTS, f"README runs {script}: teach this test to check it"
    overrides, multirun = hydra_overrides(quote_patterns(args))
    for run in runs_of(overrides, multirun):
        cfg = compose(*run, config_name=ENTRY_POINTS[script], hydra_config=True)
        if script == "train.py":  # and passes the start-up checks (placeholder paths are fine: not opened yet)
            validate(compose(*run))
        for arg in args:  # a shard pattern arrives as the shell passed it, braces and all
            key, _, value = arg.partition("=")
            if key.endswith(".urls") and not multirun:
                node = cfg
                for part in key.lstrip("+").split("."):
                    node = node[part]
                assert node == value.strip("'\""), (key, node)


def test_brace_patterns_compose_with_and_without_inner_quotes():
    pattern = "/data/cc12m/{000000..001242}.tar"
    for arg in (f"data.train.urls={pattern}", f"data.train.urls='{pattern}'", f'data.train.urls="{pattern}"'):
        cfg = compose("data=webdataset", *quote_patterns([arg]))
        assert cfg.data.train.urls == pattern, arg
    joined = "/a/{0..3}.tar::/b/{00..09}.tar"
    assert compose("data=webdataset", *quote_patterns([f"data.train.urls={joined}"])).data.train.urls == joined
    evaluated = compose("eval=imagenet", *quote_patterns(["eval.imagenet.urls=/in1k/{000..063}.tar"]),
                        config_name="evaluate")
    assert evaluated.eval.imagenet.urls == "/in1k/{000..063}.tar"


@pytest.mark.parametrize("command", [
    "python train.py trainer.max_step=5",                                   # a key that is not there
    "python train.py model=vit_b99",                                        # an option that is not there
    "torchrun --nproc-per-gpu=8 train.py",                                  # a launcher flag that is not there
    "python scripts/make_shards.py tables --out s/",                        # a subcommand that is not there
    "python scripts/export.py ckpt=a.pt",                                   # export without out=
    "python scripts/report.py --output s/ runs/sweep",                      # a flag that is not there
    "python scripts/evaluate.py ckpt=a.pt eval=imagenet eval.root=/d",      # a set's key outside eval.<name>
    "python train.py optim.lr=1e-4,5e-4",                                   # a sweep without -m
    "python train.py experiment=openclip_b32_laion400m eval.imagenet.root=/d",  # a recipe without its shards
])
def test_a_drifted_command_fails(command, placeholder_paths):
    with pytest.raises((Exception, SystemExit)):
        test_readme_command_composes(command, None)


def test_hydra_alone_reads_braces_as_a_dictionary():
    """What the entry points' quoting is for: without it, README's own pattern does not parse."""
    with pytest.raises(Exception, match="mismatched input"):
        compose("data=webdataset", "data.train.urls=/data/cc12m/{000000..001242}.tar")
