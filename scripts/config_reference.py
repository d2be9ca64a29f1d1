"""Write docs/configuration.md, the configuration reference: every option of every config group, each
key with its default, its type (from ``src/megabatch/config/schema.py`` where the group is typed) and
the comment beside it in the YAML file, which is where a key is documented.

    python scripts/config_reference.py            # rewrite docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 if the committed page is not what it would write

tests/test_docs.py runs the check, so the page cannot drift from configs/.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
PAGE = ROOT / "docs" / "configuration.md"
GROUPS = ["model", "loss", "data", "optim", "sched", "trainer", "eval", "logger", "experiment"]


def parse_yaml(path: Path) -> tuple[list[str], list[tuple[str, str, str]]]:
    """(the file's leading comment lines, [(dotted key, value as written, its comment)]) read from the
    text, so that the comments come along; a comment alone on the lines after a key continues it, and
    one alone above a top-level key documents that key."""
    header, rows, stack, in_defaults, seen_key, pending = [], [], [], False, False, []
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped:
            continue
        indent = len(raw) - len(raw.lstrip())
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if text.startswith("@package"):
                continue
            if not seen_key:
                header.append(text)
            elif rows and indent > 0 and not in_defaults:
                key, value, comment = rows[-1]
                rows[-1] = (key, value, f"{comment} {text}".strip())
            elif indent == 0:  # a comment above a top-level key documents the key below it
                pending.append(text)
            continue
        seen_key = True
        if stripped.startswith("- "):  # a list item: the defaults list, or a value written as a list
            continue
        name, _, rest = stripped.partition(":")
        value, _, comment = rest.partition(" #")
        value, comment = value.strip(), comment.strip().lstrip("#").strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            in_defaults = name == "defaults"
        if in_defaults or name in ("hydra",) or (stack and stack[0][1] == "hydra"):
            if not value:
                stack.append((indent, name))
            continue
        dotted = ".".join([part for _, part in stack] + [name])
        comment, pending = comment or " ".join(pending), []
        if value:
            rows.append((dotted, value, comment))
        else:
            stack.append((indent, name))
            if comment:
                rows.append((dotted, "", comment))
    return header, rows


def schema_types() -> dict[str, str]:
    """``{dotted key: type}`` of the typed groups."""
    from megabatch.config.schema import LOGGER_SECTIONS, SCHEMAS, EvalConfig

    types: dict[str, str] = {}

    def walk(schema, prefix: str) -> None:
        for spec in fields(schema):
            nested = spec.default_factory
            if isinstance(nested, type) and is_dataclass(nested):
                walk(nested, f"{prefix}.{spec.name}")
            else:
                types[f"{prefix}.{spec.name}"] = str(spec.type).replace("typing.", "")

    for group, schema in SCHEMAS.items():
        walk(schema, group)
    walk(EvalConfig, "eval.<name>")
    for name, schema in LOGGER_SECTIONS.items():
        walk(schema, f"logger.{name}")
    return types


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def option_section(group: str, path: Path, types: dict[str, str]) -> list[str]:
    header, rows = parse_yaml(path)
    lines = [f"### `{group}={path.stem}`", ""]
    if header:
        lines += [" ".join(header), ""]
    if group == "experiment":  # a recipe: its sources are in its header; its keys are other groups' keys
        lines += [f"Sets: {', '.join(f'`{key}`' for key, value, _ in rows if value)}.", ""]
        return lines
    if not rows:
        return lines
    package_global = path.read_text().lstrip().startswith("# @package _global_")
    lines += ["| key | default | type | what it does |", "|---|---|---|---|"]
    for key, value, comment in rows:
        if group == "eval":  # each set in its own package, eval.<name>
            full = f"eval.<name>.{key}"
        elif package_global or key.startswith(f"{group}."):  # '# @package _global_' files name whole keys
            full = key
        else:
            full = f"{group}.{key}"
        kind = types.get(full, "")
        lines.append(f"| `{full}` | {cell(f'`{value}`' if value else '')} | {cell(kind)} | {cell(comment)} |")
    return lines + [""]


def page() -> str:
    types = schema_types()
    lines = ["# Configuration reference", "",
             "[megabatch](../README.md) / Configuration reference. Written by `python scripts/config_reference.py` "
             "from the YAML files in `configs/` (each key's comment) and `src/megabatch/config/schema.py` (the "
             "types of the typed groups); do not edit it by hand. How the groups combine, and the command line: "
             "[getting-started.md](getting-started.md#configuration-configs). Every value is checked at start-up, "
             "before anything is built, and an error names the key and the fix.", "",
             "Groups: " + ", ".join(f"[`{g}`](#{g})" for g in ["top-level", *GROUPS]), ""]
    header, rows = parse_yaml(CONFIGS / "train.yaml")
    lines += ["## top-level", "", "`configs/train.yaml`: " + " ".join(header), "",
              "| key | default | what it does |", "|---|---|---|"]
    for key, value, comment in rows:
        if key.split(".")[0] not in GROUPS or key.startswith("model."):
            lines.append(f"| `{key}` | {cell(f'`{value}`' if value else '')} | {cell(comment)} |")
    lines.append("")
    for group in GROUPS:
        options = sorted((CONFIGS / group).glob("*.yaml"))
        lines += [f"## {group}", "", f"`configs/{group}/`: " + ", ".join(f"`{p.stem}`" for p in options), ""]
        for path in options:
            lines += option_section(group, path, types)
    return "\n".join(lines).rstrip("\n") + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/config_reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
