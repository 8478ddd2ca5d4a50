"""The documentation under docs/ stays true to the code.

1. docs/configuration.md is exactly what `python -m raypar.docgen` generates.
2. Every config key is in the reference, with a description taken from raypar/config.py.
3. Every exception class raised in raypar/, actors/ and checkpoint/ is in troubleshooting.md.
4. Every relative link between the docs pages resolves (file and heading).
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from raypar import docgen

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_TREES = ("raypar", "actors", "checkpoint")
REGENERATE = "python -m raypar.docgen"


# ---------------------------------------------------------------------------------------
# 1. The generated configuration reference is current


def test_configuration_reference_is_generated_and_current():
    path = DOCS / "configuration.md"
    assert path.is_file(), f"{path} is missing; run `{REGENERATE}`"
    expected = docgen.render_config_reference()
    current = path.read_text(encoding="utf-8")
    if current != expected:
        pytest.fail(
            f"docs/configuration.md is stale: the config dataclasses or their comments in "
            f"raypar/config.py changed. Run `{REGENERATE}` and commit the result.",
            pytrace=False,
        )


def test_docgen_check_flags_a_stale_file(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert docgen.main(["--out", str(out), "--check"]) == 1  # missing counts as stale
    assert docgen.main(["--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == docgen.render_config_reference()
    assert docgen.main(["--out", str(out), "--check"]) == 0
    out.write_text(out.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")
    assert docgen.main(["--out", str(out), "--check"]) == 1
    capsys.readouterr()


# ---------------------------------------------------------------------------------------
# 2. Every key is documented


ENTRIES = docgen.config_entries()
MISSING_DESCRIPTIONS = [e.key for e in ENTRIES if not e.description.strip()]


def test_every_config_key_is_in_the_reference():
    text = docgen.render_config_reference()
    absent = [e.key for e in ENTRIES if f"### `{e.key}`" not in text]
    assert not absent, f"config keys missing from the reference: {absent}"
    assert len({e.key for e in ENTRIES}) == len(ENTRIES), "a config key is listed twice"


def test_rendered_types_and_defaults():
    by_key = {e.key: e for e in ENTRIES}
    assert by_key["parallel.schedule"].type == ('one of "fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", '
                                                 '"zb-v-half", "auto"')
    assert by_key["parallel.layers_per_stage"].type == 'list[int | float] | one of "auto" | None'
    assert by_key["data.path"].type == "str | None"
    assert by_key["runtime.release"].type == "bool"
    assert by_key["model.dim"].type == "int"
    assert by_key["parallel.layers_per_stage"].default == "null"
    # Floats render as YAML reads them back as floats (PyYAML needs the decimal point).
    assert by_key["model.norm_eps"].default == "1.0e-05"


def test_every_config_key_has_a_description():
    assert not MISSING_DESCRIPTIONS, (
        "these config fields have no comment in raypar/config.py (add a trailing `# ...` or "
        f"a comment line above the field, then run `{REGENERATE}`): {', '.join(MISSING_DESCRIPTIONS)}"
    )


# ---------------------------------------------------------------------------------------
# 3. Every raised exception class is in the troubleshooting page


def _raised_exception_classes() -> dict[str, list[str]]:
    """Exception class name -> 'path:line' of every `raise Name(...)` in the source trees.

    Calls of lower-case names (`raise fail(...)`) build an exception of a class raised
    elsewhere; only CapWords names are classes.
    """
    found: dict[str, list[str]] = defaultdict(list)
    for tree in SOURCE_TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            module = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(module):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                    continue
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name and name.lstrip("_")[:1].isupper():
                    found[name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return dict(found)


def test_the_scan_finds_raypar_errors():
    raised = _raised_exception_classes()
    for name in ("ConfigError", "DataError", "ScheduleError", "ResourceError", "CheckpointError"):
        assert name in raised, f"the scan no longer finds `raise {name}(`"


def test_every_raised_exception_is_in_troubleshooting():
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    missing = {name: sites for name, sites in _raised_exception_classes().items()
               if not re.search(rf"\b{re.escape(name)}\b", text)}
    assert not missing, "exceptions raised but not in docs/troubleshooting.md: " + "; ".join(
        f"{name} (raised at {', '.join(sites[:3])})" for name, sites in sorted(missing.items()))


# ---------------------------------------------------------------------------------------
# 4. Links between the pages resolve


_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _strip_code(text: str) -> str:
    return _CODE.sub("", _FENCE.sub("", text))


def _anchors(text: str) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_the_docs_pages_exist():
    names = {p.name for p in _pages()}
    for page in ("index.md", "quickstart.md", "concepts.md", "configuration.md", "operations.md",
                 "troubleshooting.md"):
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("page", [p.name for p in _pages()])
def test_relative_links_resolve(page):
    source = DOCS / page
    broken = []
    for target in _LINK.findall(_strip_code(source.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
            continue
        if fragment and dest.suffix == ".md" and fragment not in _anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    assert not broken, f"broken links in docs/{page}: " + "; ".join(broken)


def test_index_links_every_page():
    text = _strip_code((DOCS / "index.md").read_text(encoding="utf-8"))
    linked = {t.partition("#")[0] for t in _LINK.findall(text)}
    unlinked = [p.name for p in _pages() if p.name != "index.md" and p.name not in linked]
    assert not unlinked, f"docs/index.md does not link to: {unlinked}"
