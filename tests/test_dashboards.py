"""Grafana dashboards and the metric catalog agree: no panel on a missing metric, no metric without a panel."""
import json
import re

import pytest
import yaml

from raypar.metrics.catalog import BY_NAME, CATALOG

from dashboard_queries import (BOARDS, DASHBOARDS, all_queries, board_queries, board_variables, broken_dashboard, load,
                               metric_names, panels, static_problems, to_promql)
from prometheus_harness import prometheus_args

# Catalog metrics deliberately without a panel, each with the reason. Empty: all are shown.
NOT_ON_A_DASHBOARD: dict[str, str] = {}


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
    board = load(path)
    for q in board_queries(board, path.name):
        problems = static_problems(q, board_variables(board))
        assert not problems, "\n".join(problems)
        # Ray's metrics agent exports ray_raypar_*, the standalone server raypar_*: match both.
        for m in re.finditer(r"raypar_[a-z_]+", q.expr):
            assert q.expr[:m.start()].endswith('__name__=~"(ray_)?'), str(q)
        assert 'run=~"$run"' in q.expr or q.is_variable, f"{q}: no run filter"


def test_a_query_on_a_metric_that_does_not_exist_is_caught():
    """The static half of tests/test_prometheus.py's broken-dashboard test: a panel naming a
    metric the catalog lacks fails, and the message names the dashboard, panel and query."""
    board, broken = broken_dashboard()
    problems = [p for q in board_queries(board, "broken.json") for p in static_problems(q, board_variables(board))]
    assert len(problems) == 1, problems
    assert "broken.json panel 'Loss' target A" in problems[0] and broken.expr in problems[0]
    assert "['raypar_no_such_metric'] not in raypar.metrics.catalog" in problems[0]


def test_every_catalog_metric_is_on_a_dashboard():
    shown = {name for q in all_queries() for name in metric_names(q.expr)}
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
    # Ray rewrites the file behind a link, out of sight of Prometheus's file watch: without
    # a short refresh Prometheus scrapes a new cluster's metrics agent only after 5 minutes.
    refresh = [sd.get("refresh_interval") for j in jobs.values() for sd in j.get("file_sd_configs", [])]
    assert refresh and all(r and parse_seconds(r) <= 30 for r in refresh), refresh


def parse_seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert m, f"not a simple Prometheus duration: {duration}"
    return float(m.group(1)) * units[m.group(2)]


def test_readme_shows_the_prometheus_command_the_live_test_runs():
    """dashboards/README.md's command line is the one tests/test_prometheus.py starts (with
    its own port, data folder and a config rewritten from dashboards/prometheus.yml)."""
    readme = (DASHBOARDS / "README.md").read_text()
    command = " ".join(prometheus_args("prometheus", "dashboards/prometheus.yml", 9090, "prometheus-data"))
    assert command in readme, f"dashboards/README.md should show `{command}`"


def test_readme_describes_every_panel():
    readme = (DASHBOARDS / "README.md").read_text()
    missing = [f"{path.name}: {p['title']}" for path in BOARDS for p in panels(load(path))
               if p["type"] != "row" and f"**{p['title']}**" not in readme]
    assert not missing, "panels dashboards/README.md does not describe (as **title**):\n" + "\n".join(missing)


def test_queries_are_filled_in_as_grafana_sends_them():
    """What tests/test_prometheus.py sends: variables regex-escaped as Grafana does (a '-' is
    left alone, a '.' escaped for the regex inside the PromQL string), $__rate_interval at
    least four scrape intervals."""
    expr = 'sum by (run) (rate({__name__=~"(ray_)?raypar_steps_total", run=~"$run"}[$__rate_interval]))'
    sent = to_promql(expr, {"run": "tiny-run.1"}, scrape_interval_s=5, step_s=1, range_s=600)
    assert sent == 'sum by (run) (rate({__name__=~"(ray_)?raypar_steps_total", run=~"tiny-run\\\\.1"}[20s]))'
    assert to_promql("x[$__rate_interval]", {}, scrape_interval_s=1, step_s=30, range_s=600) == "x[31s]"
    with pytest.raises(KeyError, match=r"\$stage"):
        to_promql('x{stage=~"$stage"}', {"run": "r"}, 1, 1, 1)
