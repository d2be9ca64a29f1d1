"""The documentation holds together: README.md is a landing page, every relative link of README.md and
docs/ resolves (file and heading), every measured file they name is in docs/bench, and the generated
pages (configuration reference, benchmarks) are what their scripts write. The commands they show are
checked by tests/test_readme.py."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from .helpers import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "bench" / "README.md",
             ROOT / "scripts" / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def script(name: str):
    path = ROOT / "scripts" / name
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower().replace("`", "")
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text, fence, found = path.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code is not markdown
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in links(path):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md) [ok](there.md#a-heading) [gone](missing.md) [bad](there.md#nothing)\n"
                    "`[code](missing2.md)`\n")
    found = [t for t in links(page) if not (tmp_path / t.partition("#")[0]).exists()
             or (t.partition("#")[2] and t.partition("#")[2] not in anchors(tmp_path / t.partition("#")[0]))]
    assert found == ["missing.md", "there.md#nothing"]


def test_every_measured_file_named_in_the_docs_and_code_exists():
    sources = [*DOCUMENTS, *(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    named = set()
    for path in sources:
        named |= set(re.findall(r"docs/bench/([A-Za-z0-9_.-]+\.(?:json|png|txt|log))", path.read_text()))
    missing = sorted(name for name in named if not (ROOT / "docs" / "bench" / name).exists())
    assert named and not missing, f"named but not in docs/bench: {missing}"


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for page in ("getting-started", "recipes", "data", "large-batches", "multi-gpu", "evaluation", "models",
                 "performance", "configuration", "benchmarks", "ARCHITECTURE", "development"):
        assert f"(docs/{page}.md)" in text, page
    assert "make demo" in text and "make test" in text  # the two commands


def test_configuration_reference_is_current():
    reference = script("config_reference.py")
    assert reference.main(["--check"]) == 0, "run python scripts/config_reference.py"
    page = reference.page()
    for key in ("trainer.sub_batch", "data.train.split", "optim.lr_scaling", "sched.warmup_epochs",
                "eval.<name>.root", "logger.wandb.mode", "loss.impl", "model.lock_image", "`batch`", "`recipe`"):
        assert key in page, key


def test_every_config_key_is_in_the_reference():
    """Each key of each option file (the typed groups' schemas included) appears in the reference."""
    from dataclasses import fields

    from megabatch.config.schema import SCHEMAS

    page = script("config_reference.py").page()
    for group, schema in SCHEMAS.items():
        for spec in fields(schema):
            assert f"`{group}.{spec.name}" in page, f"{group}.{spec.name}"


def test_benchmarks_page_is_current():
    results = script("benchmarks/results_page.py")
    assert results.main(["--check"]) == 0, "run python scripts/benchmarks/results_page.py"
    for name in results.cited():
        assert (ROOT / "docs" / "bench" / name).exists(), name


def cited_names(text: str) -> set[str]:
    """The code names an architecture page cites in inline code: module files (``step.py``), classes
    (``TrainStep``) and functions (``load_checkpoint``); config keys, paths and values are left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    names = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in re.split(r"[\s:,()=]+", span):
            word = word.strip(".")
            if re.fullmatch(r"[a-z_][a-z0-9_]*\.py", word) or re.fullmatch(r"[A-Z][a-z]+[A-Z][A-Za-z]*", word) \
                    or (re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", word) and "." not in span.split(word)[0][-1:]):
                names.add(word)
    return names


def defined_names() -> set[str]:
    src = ROOT / "src" / "megabatch"
    names = {path.name for path in [*src.rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *ROOT.glob("*.py")]}
    for path in [*src.rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        names |= set(re.findall(r"^\s*(?:def|class)\s+([A-Za-z_][A-Za-z0-9_]*)", path.read_text(), flags=re.M))
    for path in src.rglob("*.py"):  # class attributes (an objective's replays_both_towers)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else \
                        [item.target] if isinstance(item, ast.AnnAssign) else []
                    names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def test_architecture_cites_only_names_that_exist():
    cited = cited_names((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    assert {"TrainStep", "load_checkpoint", "step.py", "build_step"} <= cited  # the extraction finds them
    missing = sorted(cited - defined_names())
    assert not missing, f"docs/ARCHITECTURE.md names what the code does not define: {missing}"
    assert "find_resume_path" not in defined_names() and cited_names("`find_resume_path`") == {"find_resume_path"}
