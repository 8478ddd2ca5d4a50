"""Grafana dashboards and the metric catalog agree: no panel on a missing metric, no metric without a panel."""
import json
import re
from pathlib import Path

import pytest
import yaml

from raypar.metrics.catalog import BY_NAME, CATALOG

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
BOARDS = sorted(DASHBOARDS.glob("*.json"))
NAME_RE = re.compile(r"raypar_[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Catalog metrics deliberately without a panel, each with the reason. Empty: all are shown.
NOT_ON_A_DASHBOARD: dict[str, str] = {}


def panels(board: dict):
    for p in board.get("panels", []):
        yield p
        yield from p.get("panels", [])  # panels inside collapsed rows


def queries(board: dict):
    """(where, PromQL) for every panel target and every query variable."""
    for p in panels(board):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r}", t["expr"]
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            yield f"variable {v['name']}", q


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in NAME_RE.findall(expr):
        for suffix in HISTOGRAM_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and BY_NAME.get(base) is not None and BY_NAME[base].kind == "histogram":
                name = base
        names.add(name)
    return names


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_dashboards_are_there():
    assert {p.name for p in BOARDS} >= {"raypar-overview.json", "raypar-pipeline.json",
                                        "raypar-checkpoints-elastic.json"}


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.name)
def test_dashboard_is_valid_grafana_json(path):
    board = load(path)
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "raypar_steps_total" in json.dumps(variables["run"]["query"])
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(board):
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


def test_uids_are_unique():
    uids = [load(p)["uid"] for p in BOARDS]
    assert len(uids) == len(set(uids))


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.name)
def test_queries_use_catalog_metrics_under_both_prefixes(path):
    for where, expr in queries(load(path)):
        names = metric_names(expr)
        assert names, f"{path.name} {where}: no raypar metric in {expr}"
        unknown = names - set(BY_NAME)
        assert not unknown, f"{path.name} {where}: {sorted(unknown)} not in raypar.metrics.catalog"
        # Ray's metrics agent exports ray_raypar_*, the standalone server raypar_*: match both.
        for m in re.finditer(r"raypar_[a-z_]+", expr):
            assert expr[:m.start()].endswith('__name__=~"(ray_)?'), f"{path.name} {where}: {expr}"
        assert 'run=~"$run"' in expr or where.startswith("variable"), f"{path.name} {where}: no run filter"


def test_every_catalog_metric_is_on_a_dashboard():
    shown = {name for path in BOARDS for _, expr in queries(load(path)) for name in metric_names(expr)}
    missing = {s.name for s in CATALOG} - shown - set(NOT_ON_A_DASHBOARD)
    assert not missing, (f"metrics without a panel (add one, or list them in NOT_ON_A_DASHBOARD with a reason): "
                         f"{sorted(missing)}")
    assert set(NOT_ON_A_DASHBOARD) <= set(BY_NAME)


def test_prometheus_config_scrapes_both_backends():
    cfg = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    static = [t for j in jobs.values() for sc in j.get("static_configs", []) for t in sc["targets"]]
    assert "127.0.0.1:9464" in static
    files = [f for j in jobs.values() for sd in j.get("file_sd_configs", []) for f in sd["files"]]
    assert any(f.endswith("prom_metrics_service_discovery.json") for f in files)
