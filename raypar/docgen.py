"""Generate the configuration reference (docs/configuration.md) from the config dataclasses.

Every key `section.key` of `raypar.config.Config` gets its type, its default and a
description. The description is the comment written next to the field in
`raypar/config.py`: a trailing `# comment` on the field's line, or the `#` comment lines
directly above it (both, above first, when a field has both). The source is parsed with
`ast` and `tokenize`, so the reference says exactly what the code says.

    python -m raypar.docgen            # rewrite docs/configuration.md
    python -m raypar.docgen --check    # exit 1 if docs/configuration.md is stale
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from raypar.config import Config

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m raypar.docgen"

# One line per section, shown above its keys. Sections not listed here get none.
SECTION_INTROS: dict[str, str] = {
    "model": "The transformer (and its mixture-of-experts layers). "
             "See [concepts](concepts.md#mixture-of-experts).",
    "parallel": "The `dp x pp x ep` grid of stage workers and the pipeline schedule. "
                "See [concepts](concepts.md#the-grid).",
    "train": "Optimizer, learning-rate schedule, batch size and seed.",
    "data": "Token data: where the corpus is, how much of it a process keeps, prefetch. See [concepts](concepts.md#data-streamed-prefetched-in-a-fixed-order).",
    "runtime": "Ray, devices, memory release and recompute, timeouts, outputs and metrics. "
               "See [operations](operations.md).",
    "checkpoint": "Saving checkpoints during training, and resuming from them. "
                  "See [concepts](concepts.md#checkpoints).",
}


@dataclass(frozen=True)
class Entry:
    key: str  # "section.key"
    type: str  # rendered for people, e.g. "int | None"
    default: str  # as it would be written in YAML, e.g. "null", "1.0e-05", "runs/default"
    description: str  # from the source comment; "" when the field has none
    type_md: str = ""  # the type as Markdown (code spans)


# ---------------------------------------------------------------------------------------
# Comments from the source


@functools.lru_cache(maxsize=None)
def _source_comments(path: str) -> tuple[dict[int, str], frozenset[int]]:
    """(line -> comment text without '#', lines that hold nothing but a comment)."""
    text = Path(path).read_text(encoding="utf-8")
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER, tokenize.ENCODING):
            for line in range(tok.start[0], tok.end[0] + 1):
                code_lines.add(line)
    comment_only = frozenset(line for line in comments if line not in code_lines)
    return comments, comment_only


@functools.lru_cache(maxsize=None)
def _class_nodes(path: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment that documents it in `cls`'s source ("" if none)."""
    path = inspect.getsourcefile(cls)
    if path is None:
        return {}
    node = _class_nodes(path).get(cls.__name__)
    if node is None:
        return {}
    comments, comment_only = _source_comments(path)
    out: dict[str, str] = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        line = stmt.lineno - 1
        while line in comment_only:
            above.append(comments[line])
            line -= 1
        above.reverse()
        trailing = [comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                    if n in comments and n not in comment_only]
        out[stmt.target.id] = " ".join(part for part in above + trailing if part)
    return out


# ---------------------------------------------------------------------------------------
# Types and defaults


def render_type(tp: Any) -> str:
    """A type as people read it: `int`, `str | None`, `list[int] | None`, `one of "a", "b"`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        parts = [render_type(a) for a in non_none]
        if len(non_none) < len(args):
            if len(parts) == 1 and typing.get_origin(non_none[0]) is Literal:
                return parts[0] + ", or None"
            parts.append("None")
        return " | ".join(parts)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(render_type(a) for a in args)}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def render_type_md(tp: Any) -> str:
    """`render_type` as Markdown: code spans, with each choice of a Literal in its own."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(non_none) == 1 and typing.get_origin(non_none[0]) is Literal:
            return render_type_md(non_none[0]) + ", or `None`"
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(a)}`" for a in typing.get_args(tp))
    return f"`{render_type(tp)}`"


def render_default(value: Any) -> str:
    """A default as it would be written in a YAML config (and in a `key=value` override)."""
    if isinstance(value, str):
        # Unquoted where YAML reads the text back as this string; quoted where it would not
        # (e.g. "", "true", "1").
        return value if value and yaml.safe_load(value) == value else json.dumps(value)
    text = yaml.safe_dump(value, default_flow_style=True)
    lines = [ln for ln in text.splitlines() if ln.strip() not in ("", "...")]
    return " ".join(lines)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


# ---------------------------------------------------------------------------------------
# The reference


def config_entries(cls: type = Config, prefix: str = "") -> list[Entry]:
    """Every leaf key of `cls`, depth first in declaration order."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out: list[Entry] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(config_entries(tp, key))
            continue
        default = _default_of(f)
        out.append(Entry(
            key=key,
            type=render_type(tp),
            type_md=render_type_md(tp),
            default="(required)" if default is dataclasses.MISSING else render_default(default),
            description=comments.get(f.name, ""),
        ))
    return out


def sections(cls: type = Config) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]


def missing_descriptions() -> list[str]:
    """Keys whose field has no comment in raypar/config.py."""
    return [e.key for e in config_entries() if not e.description.strip()]


_HEADER = """\
<!-- Generated by `{regen}` from the comments in raypar/config.py. Do not edit by hand:
     change the comment next to the field and regenerate. -->

# Configuration reference

A run is configured by one YAML file with the sections below (every section and every key
is optional; a missing one keeps its default). Any key can be overridden on the command
line as `section.key=value`, where `value` is parsed as YAML:

```sh
raypar train --config configs/tiny.yaml parallel.pp=4 parallel.schedule=fthenb data.path=null
```

The same holds for `load_config(path, overrides)` in Python. Keys and values are checked
when the config is loaded: an unknown key, a value of the wrong type, a value outside its
choices or an impossible combination (for example a batch that does not split into the
grid's micro-batches) raises `ConfigError` naming the key; [troubleshooting](troubleshooting.md#configuration)
lists every such message.

Defaults are shown as they are written in YAML (`null` is Python's `None`). Numbers such
as `1e-5`, which YAML 1.1 reads as strings, are accepted wherever a number is expected.
"""


def render_config_reference() -> str:
    """The whole of docs/configuration.md."""
    entries = config_entries()
    lines = [_HEADER.format(regen=REGENERATE)]
    lines.append("## Sections\n")
    for name, _ in sections():
        lines.append(f"- [`{name}`](#{name})")
    lines.append("")
    for name, cls in sections():
        lines.append(f"## {name}\n")
        intro = SECTION_INTROS.get(name) or (inspect.getdoc(cls) or "").strip()
        if intro and not intro.startswith(cls.__name__ + "("):  # dataclasses' generated docstring
            lines.append(intro + "\n")
        for e in entries:
            if e.key.split(".", 1)[0] != name:
                continue
            lines.append(f"### `{e.key}`\n")
            lines.append(f"Type: {e.type_md}. Default: `{e.default}`.\n")
            lines.append((e.description or "(no description yet)") + "\n")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raypar.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale, write nothing")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output file (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    text = render_config_reference()
    current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
    missing = missing_descriptions()
    if missing:
        print(f"warning: no comment in raypar/config.py for: {', '.join(missing)}", file=sys.stderr)
    if args.check:
        if current != text:
            print(f"{args.out} is stale; run `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    if current == text:
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
