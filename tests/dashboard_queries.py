"""The PromQL in the Grafana dashboards, as data: what each panel queries, which metric names
and labels it needs, and the query Grafana would send once its variables are filled in.

Shared by tests/test_dashboards.py (checks against the metric catalog, no server) and
tests/test_prometheus.py (evaluates every query in a real Prometheus).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from raypar.metrics.catalog import BY_NAME

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
BOARDS = sorted(DASHBOARDS.glob("*.json"))
NAME_RE = re.compile(r"raypar_[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
LEGEND_LABEL_RE = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
BY_RE = re.compile(r"\bby\s*\(([^)]*)\)")
VARIABLE_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
LABEL_VALUES_RE = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S)
# Grafana's own variables the panels may use; Grafana fills them from the time range and the
# panel's width (see `to_promql`).
GRAFANA_MACROS = {"__rate_interval", "__interval", "__range"}
# histogram_quantile consumes the bucket label: it is grouped by, but never in the result.
CONSUMED_LABELS = {"le"}


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a dashboard: a panel target or a query variable."""

    board: str  # the dashboard's file name
    where: str  # "panel 'Loss' target A" or "variable run"
    expr: str
    legend: str = ""  # the target's legendFormat; "" for variables

    @property
    def is_variable(self) -> bool:
        return self.where.startswith("variable")

    def __str__(self) -> str:
        return f"{self.board} {self.where}: {self.expr}"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(board: dict) -> Iterator[dict]:
    for p in board.get("panels", []):
        yield p
        yield from p.get("panels", [])  # panels inside collapsed rows


def board_queries(board: dict, name: str) -> list[Query]:
    """Every panel target and query variable of `board` (`name`: its file name, for messages)."""
    found = []
    for p in panels(board):
        for t in p.get("targets", []):
            found.append(Query(name, f"panel {p['title']!r} target {t.get('refId', '?')}", t["expr"],
                               t.get("legendFormat", "")))
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            found.append(Query(name, f"variable {v['name']}", q))
    return found


def all_queries(paths: list[Path] = BOARDS) -> list[Query]:
    return [q for path in paths for q in board_queries(load(path), path.name)]


def metric_names(expr: str) -> set[str]:
    """The catalog names an expression reads (histogram series count as their histogram)."""
    names = set()
    for name in NAME_RE.findall(expr):
        for suffix in HISTOGRAM_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and BY_NAME.get(base) is not None and BY_NAME[base].kind == "histogram":
                name = base
        names.add(name)
    return names


def panel_labels(q: Query) -> set[str]:
    """Labels the panel shows or groups by, which every result series must carry: those its
    legend prints ({{stage}}) and those its aggregations keep (`by (run, stage)`)."""
    labels = set(LEGEND_LABEL_RE.findall(q.legend))
    for group in BY_RE.findall(q.expr):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels - CONSUMED_LABELS


def variables(expr: str) -> set[str]:
    """Grafana variables an expression uses ($run, ${run}, $__rate_interval)."""
    return {a or b for a, b in VARIABLE_RE.findall(expr)}


def static_problems(q: Query, known_variables: set[str]) -> list[str]:
    """What is wrong with a query before any server sees it: metric names the catalog
    lacks, no metric at all, variables the dashboard does not define."""
    problems = []
    names = metric_names(q.expr)
    if not names:
        problems.append(f"{q}: names no raypar metric")
    unknown = names - set(BY_NAME)
    if unknown:
        problems.append(f"{q}: {sorted(unknown)} not in raypar.metrics.catalog")
    undefined = variables(q.expr) - known_variables - GRAFANA_MACROS
    if undefined:
        problems.append(f"{q}: uses undefined variables {sorted(undefined)}")
    return problems


def board_variables(board: dict) -> set[str]:
    return {v["name"] for v in board["templating"]["list"]}


def to_promql(expr: str, values: dict[str, str], scrape_interval_s: float, step_s: float, range_s: float) -> str:
    """`expr` as Grafana sends it to Prometheus: dashboard variables replaced by `values`
    (regex-escaped as Grafana does for a single value in =~), and Grafana's macros by what Grafana
    computes for a data source whose scrape interval is `scrape_interval_s` and a graph
    of step `step_s` over `range_s` seconds: $__interval is the step, $__rate_interval is
    max($__interval + scrape interval, 4 x scrape interval)."""
    macros = {
        "__interval": f"{step_s:g}s",
        "__rate_interval": f"{max(step_s + scrape_interval_s, 4 * scrape_interval_s):g}s",
        "__range": f"{range_s:g}s",
    }
    filled = {**macros, **{k: promql_regex_escape(v) for k, v in values.items()}}

    def fill(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in filled:
            raise KeyError(f"no value for the Grafana variable ${name} in {expr}")
        return filled[name]

    return VARIABLE_RE.sub(fill, expr)


def promql_regex_escape(value: str) -> str:
    """`value` as a regex matching only itself, written inside a PromQL double-quoted string
    (the backslash itself doubled, as the string literal needs); like Grafana's escaping of
    a Prometheus variable's value, which leaves characters such as '-' alone."""
    out = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]'+?.()|]", lambda m: "\\\\" + m.group(0), out)


def label_values_query(expr: str) -> tuple[str, str]:
    """(series selector, label) of a Grafana `label_values(selector, label)` variable query."""
    m = LABEL_VALUES_RE.match(expr)
    if not m:
        raise ValueError(f"not a label_values(selector, label) query: {expr}")
    return m.group(1).strip(), m.group(2)


def broken_dashboard() -> tuple[dict, Query]:
    """raypar-overview.json with its 'Loss' panel querying a metric that does not exist,
    and that broken query (what the checks must catch)."""
    board = load(DASHBOARDS / "raypar-overview.json")
    panel = next(p for p in panels(board) if p["title"] == "Loss")
    target = panel["targets"][0]
    assert "raypar_loss" in target["expr"], target["expr"]
    target["expr"] = target["expr"].replace("raypar_loss", "raypar_no_such_metric")
    broken = next(q for q in board_queries(board, "broken.json") if "raypar_no_such_metric" in q.expr)
    return board, broken
