"""config/cli.py: shard patterns reach Hydra intact; nothing else on the command line changes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megabatch.config import ConfigError
from megabatch.config.cli import quote_patterns, split_top_level
from megabatch.config.compose import compose

from .helpers import ROOT


@pytest.mark.parametrize("arg, expected", [
    ("data.train.urls=/d/{0..9}.tar", "data.train.urls='/d/{0..9}.tar'"),
    ("+data.train.urls=/d/{0..9}.tar", "+data.train.urls='/d/{0..9}.tar'"),
    ("eval.urls=/d/{0..9}.tar::/e/{a,b}.tar", "eval.urls='/d/{0..9}.tar::/e/{a,b}.tar'"),
    ("data.train.urls=/a/{0,1}.tar,/b/{2..3}.tar", "data.train.urls='/a/{0,1}.tar','/b/{2..3}.tar'"),  # a sweep
    ("data.train.urls=[/a/{0..1}.tar,/b.tar]", "data.train.urls=['/a/{0..1}.tar',/b.tar]"),
    ("data.train.urls='/d/{0..9}.tar'", "data.train.urls='/d/{0..9}.tar'"),      # quoted for Hydra already
    ('data.train.urls="/d/{0..9}.tar"', 'data.train.urls="/d/{0..9}.tar"'),
    ("data.train.urls=/it's/{0..9}.tar", 'data.train.urls="/it\'s/{0..9}.tar"'),
    ("data.train.urls=/d/000.tar", "data.train.urls=/d/000.tar"),                 # no brace: as it came
    ("data.train.urls=glob(*)", "data.train.urls=glob(*)"),
    ("+model.extra={a:1}", "+model.extra={a:1}"),                                 # not a urls key
    ("hydra.run.dir=/r/{x}", "hydra.run.dir=/r/{x}"),
    ("batch=1M", "batch=1M"), ("-m", "-m"), ("model=vit_b32", "model=vit_b32"),
])
def test_only_brace_patterns_of_url_keys_are_quoted(arg, expected):
    assert quote_patterns([arg]) == [expected]


def test_quoted_values_compose_to_what_the_shell_passed():
    for value in ("/d/{0..9}.tar", "/d/{0..9}.tar::/e/{a,b}.tar", "/it's/{0..9}.tar"):
        cfg = compose("data=webdataset", *quote_patterns([f"data.train.urls={value}"]))
        assert cfg.data.train.urls == value
    cfg = compose("data=webdataset", *quote_patterns(["data.train.urls=[/a/{0..1}.tar,/b.tar]"]))
    assert list(cfg.data.train.urls) == ["/a/{0..1}.tar", "/b.tar"]


def test_split_top_level_ignores_commas_inside_braces_and_quotes():
    assert split_top_level("/a/{0,1}.tar,'/b,c',/d") == ["/a/{0,1}.tar", "'/b,c'", "/d"]


def test_a_pattern_the_shell_expanded_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="quote it"):
        quote_patterns(["data.train.urls=/d/0.tar", "data.train.urls=/d/1.tar"])
    # as a user meets it: unquoted braces expanded by bash itself
    result = subprocess.run(["bash", "-c", f"{sys.executable} {ROOT / 'train.py'} data=webdataset "
                             "data.train.urls=/data/{0..2}.tar"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("config error: data.train.urls is given 3 times")
    assert len(result.stderr.strip().splitlines()) == 1


def test_hydra_full_error_still_shows_the_traceback(tmp_path):
    import os

    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "trainer.log_every=0"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError: trainer.log_every=0" in result.stderr


def test_a_given_run_dir_holds_hydras_log_and_config_and_nothing_lands_in_runs(tmp_path):
    """``run_dir=<path>``: Hydra's output dir is that folder (``mb.output_dir``), so ``train.log`` and ``.hydra/`` are
    beside the run, and no ``runs/<timestamp>`` of Hydra's own is left in the working directory (a config error
    here: Hydra makes its output dir before the job starts)."""
    run_dir = tmp_path / "elsewhere"
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "trainer.log_every=0", f"run_dir={run_dir}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "trainer.log_every=0" in result.stderr
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("typo, message", [
    ("trainer.max_step=5", "trainer.max_step: no such option; did you mean trainer.max_steps?"),
    ("+trainer.max_step=5", "trainer.max_step: no such option; did you mean trainer.max_steps?"),
    ("optim.lr_scalng=sqrt", "optim.lr_scalng: no such option; did you mean optim.lr_scaling?"),
    ("model.image.widht=64", "model.image.widht: no such option; did you mean model.image.width?"),
    ("+model.image.widht=64", "model.image.widht: no such option; did you mean model.image.width?"),
])
def test_an_unknown_key_gets_the_closest_names_not_hydras_advice(tmp_path, typo, message):
    """With or without ``+``, at any depth: megabatch's one line (status 2), never Hydra's ``+key`` advice."""
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), typo, "eval=none"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(f"config error: {message}"), result.stderr[-2000:]
    assert "To append to your config" not in result.stderr and "HYDRA_FULL_ERROR" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_unknown_key_without_close_names_lists_the_options():
    from megabatch.config import no_such_option

    assert no_such_option("trainer.zzz", ["max_steps", "sub_batch"]) == \
        "trainer.zzz: no such option; the options are max_steps, sub_batch"
