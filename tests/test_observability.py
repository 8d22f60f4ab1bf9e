"""The observability kit: Prometheus alert rules (checked and unit-tested by promtool) and the
Grafana dashboard, whose every query names only metrics a live service exposes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvevents.events import BlockStored, KVEventBatch
from kvevents.http import serve
from kvevents.metrics import subscriber_collector
from kvevents.service.core import IndexService, WorkerRegistration
from kvevents.testing.publisher import started_publisher
from kvevents.testing.sockets import Deadline

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "kvevents-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvevents-alerts-test.yml"
ROUTE_ALERTS = ROOT / "deploy" / "prometheus" / "kvevents-route-alerts.yml"
ROUTE_ALERT_TESTS = ROOT / "deploy" / "prometheus" / "kvevents-route-alerts-test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvevents-dashboard.json"
# Metrics Prometheus itself makes, not the service.
PROMETHEUS_OWN = {"up"}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("KVEVENTS_REQUIRE_PROMTOOL") == "1":
            pytest.fail("promtool is required (KVEVENTS_REQUIRE_PROMTOOL=1) but not installed")
        pytest.skip("promtool not installed (make promtool installs it with apt)")
    return found


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", ())]


def _alert_exprs(path: Path = ALERTS) -> list[str]:
    return re.findall(
        r"^\s+expr: (?:>-\n)?((?:.+\n?)+?)(?=^\s+(?:for|labels):)", path.read_text(), re.M
    )


def _metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (label values, functions and keywords left out)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    words = set(re.findall(r"\b[a-z_][a-z0-9_]*\b", without_strings))
    return {w for w in words if w.startswith(("kvevents_", "process_", "python_")) or w == "up"}


def test_the_alert_rules_pass_promtools_checks_and_unit_tests() -> None:
    """promtool accepts the rules and every alert's unit test (fires when it should, names the
    right labels and summary, and stays quiet otherwise)."""
    promtool = _promtool()
    check = subprocess.run([promtool, "check", "rules", str(ALERTS)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 9 rules found" in check.stdout
    tested = subprocess.run([promtool, "test", "rules", str(ALERT_TESTS)],
                            capture_output=True, text=True, timeout=60, cwd=ALERT_TESTS.parent)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tested_alerts = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested_alerts == set(re.findall(r"- alert: (\w+)", ALERTS.read_text()))


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Each panel's query parses as PromQL: promtool checks them as recording rules."""
    promtool = _promtool()
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(_dashboard_exprs()):
        concrete = expr.replace("$instance", ".*")
        rules += [
            f"      - record: kvevents_dashboard:panel_{i}",
            f"        expr: {json.dumps(concrete)}",
        ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text("\n".join(rules) + "\n")
    check = subprocess.run([promtool, "check", "rules", str(path)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    """Grafana's required keys, a datasource and an instance variable, unique panel ids,
    panels inside the 24-column grid without overlapping, and a query with a datasource in
    every panel."""
    doc = _dashboard()
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in doc, key
    variables = {v["name"]: v["type"] for v in doc["templating"]["list"]}
    assert variables == {"datasource": "datasource", "instance": "query"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(box["x"], box["x"] + box["w"])
                 for y in range(box["y"], box["y"] + box["h"])}  # fmt: skip
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert "$instance" in target["expr"], panel["title"]


@pytest.fixture(scope="module")
def scraped() -> Iterator[set[str]]:
    """Metric names of a live service with one worker fed by a real publisher and queried."""
    service = IndexService()
    server = serve("127.0.0.1", 0, service=service, collectors=[subscriber_collector(service.feed)])
    try:
        with started_publisher() as publisher:
            service.register(WorkerRegistration("w0", publisher.endpoint, 4, (0,),
                                                publisher.replay_endpoint))  # fmt: skip
            tokens = list(range(8))
            stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens,
                                 block_size=4)  # fmt: skip
            deadline = Deadline(20)
            while service.index_stats().blocks == 0 and not deadline.expired:
                publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
                time.sleep(0.02)
            assert service.index_stats().blocks == 2
            with httpx.Client(base_url=server.url, timeout=10) as client:
                assert client.post("/query", json={"token_ids": tokens}).status_code == 200
                text = client.get("/metrics").text
        names = set()
        for line in text.splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
        yield names
    finally:
        server.close()


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_query_names_a_metric_the_service_exposes(scraped: set[str], source: str) -> None:
    """No dashboard panel or alert reads a metric that a live service does not export (a
    renamed metric would leave an empty panel or an alert that never fires)."""
    exprs = _dashboard_exprs() if source == "dashboard" else _alert_exprs()
    assert exprs
    named = set().union(*(_metric_names(e) for e in exprs)) - PROMETHEUS_OWN
    assert named - scraped == set()


def test_the_front_doors_alert_rules_pass_promtools_checks_and_unit_tests() -> None:
    """promtool accepts the front door's rules and each one's unit test passes (the drift
    alert fires on 20% mispredictions, not on exact ones nor on too few answers)."""
    promtool = _promtool()
    check = subprocess.run([promtool, "check", "rules", str(ROUTE_ALERTS)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 3 rules found" in check.stdout
    tested = subprocess.run([promtool, "test", "rules", str(ROUTE_ALERT_TESTS)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_front_doors_alerts_read_metrics_it_exposes(tmp_path: Path) -> None:
    """Every metric the front door's rules read is one a live front door exports."""
    from kvevents.route._frontdoor import EngineSpec, FrontDoor
    from kvevents.route._tokens import ModelTokenizer
    from kvevents.testing.chat_model import build_tokenizer
    from kvevents.testing.openai_engine import StandInEngine

    tokenizer = ModelTokenizer.load(build_tokenizer(tmp_path), model_name="tiny")
    with (
        StandInEngine(("tiny",)).start() as engine,
        FrontDoor([EngineSpec(engine.url, "a")], {None: tokenizer}) as front,
    ):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{front.url}/v1/chat/completions", json=body).status_code == 200
        text = httpx.get(f"{front.url}/metrics").text
    scraped = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    named = set().union(*(_metric_names(e) for e in _alert_exprs(ROUTE_ALERTS))) - PROMETHEUS_OWN
    assert named and named - scraped == set()
