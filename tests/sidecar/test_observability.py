"""Metrics endpoints, the shipped dashboard and alert rules, and `kvoffload systemd print`."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvoffload.sidecar.metrics import Metrics
from kvoffload.store import Store
from tests.helpers.paths import REPO

REPO = REPO
NS = bytes(range(32))


def _metrics(store: Store) -> Metrics:
    def usage() -> dict[str, tuple[int, int, int | None]]:
        return {
            t: (u.count, u.bytes, 1 << 30 if t == "acme" else None)
            for t, u in store.tenant_usage().items()
        }

    return Metrics(store.stats, usage)


def exported_names(text: str) -> set[str]:
    """Every sample name the exposition can hold (from its TYPE lines)."""
    names: set[str] = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M):
        name, kind = m.groups()
        names.add(name)
        if kind == "counter":
            names |= {f"{name}_total", f"{name}_created"}
        elif kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
        elif kind == "info":
            names.add(f"{name}_info")
    names |= set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))
    return names


def test_tenant_usage_build_info_and_process_metrics(store: Store) -> None:
    store.put("acme", NS, bytes([1]) * 32, [b"a" * 1000])
    store.put("beta", NS, bytes([2]) * 32, [b"b" * 2000], encrypt=False)
    text = _metrics(store).render().decode()
    assert re.search(r'^kvoffload_tenant_chunks\{tenant="acme"\} 1\.0$', text, re.M)
    assert re.search(
        r'^kvoffload_tenant_quota_bytes\{tenant="acme"\} 1\.073741824e\+09$', text, re.M
    )
    assert 'kvoffload_tenant_quota_bytes{tenant="beta"}' not in text  # no quota
    assert re.search(r'^kvoffload_tenant_used_bytes\{tenant="beta"\} \d', text, re.M)
    assert re.search(r'^kvoffload_build_info\{version="[^"]+"\} 1\.0$', text, re.M)
    assert "process_resident_memory_bytes" in text
    assert "kvoffload_in_bytes_total" in text and "kvoffload_bytes_in" not in text


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_http_serves_metrics_health_and_readiness_only(store: Store) -> None:
    m = _metrics(store)
    port = m.start_http("127.0.0.1", _free_port())
    base = f"http://127.0.0.1:{port}"
    try:
        status, body = _get(base + "/metrics")
        assert status == 200 and b"kvoffload_chunks" in body
        assert _get(base + "/healthz")[0] == 200
        assert _get(base + "/readyz")[0] == 503
        m.ready = True
        assert _get(base + "/readyz")[0] == 200
        for path in ("/", "/metrics/x", "/favicon.ico", "/debug"):
            assert _get(base + path)[0] == 404, path
    finally:
        m.stop_http()


def _exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + [
            e for v in node.values() for e in _exprs(v)
        ]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_dashboard_and_alerts_name_only_metrics_that_exist(store: Store) -> None:
    store.put("acme", NS, bytes([1]) * 32, [b"a" * 1000])
    m = _metrics(store)
    m.observe("lookup", 0.001)
    m.error("NO_SPACE")
    names = exported_names(m.render().decode())
    dashboard = json.loads((REPO / "systemd/grafana-dashboard.json").read_text())
    alerts = yaml.safe_load((REPO / "systemd/prometheus-alerts.yml").read_text())
    assert alerts["groups"][0]["rules"]
    for source, exprs in (("dashboard", _exprs(dashboard)), ("alerts", _exprs(alerts))):
        assert exprs, source
        used = {n for e in exprs for n in re.findall(r"\b((?:kvoffload|process)_\w+)", e)}
        assert used, source
        assert not used - names, f"{source} names metrics nobody exports: {used - names}"
    titles = {r["alert"] for r in alerts["groups"][0]["rules"]}
    assert {
        "KvoffloadSidecarDown",
        "KvoffloadDiskNearCapacity",
        "KvoffloadWritesRefused",
        "KvoffloadErrorRate",
        "KvoffloadEvictionStorm",
        "KvoffloadKeyCacheBoundTooLong",
    } <= titles


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    return subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_systemd_print_gives_units_that_point_at_this_install() -> None:
    r = _cli("systemd", "print", "service")
    assert r.returncode == 0, r.stderr
    doc = re.search(r"^Documentation=file://(\S+)$", r.stdout, re.M)
    assert doc is not None and Path(doc.group(1)).is_file()
    exe = re.search(r"^ExecStart=(\S+) .*\bserve$", r.stdout, re.M)
    assert exe is not None and os.access(exe.group(1), os.X_OK), r.stdout
    shipped = (REPO / "systemd/kvoffload.sysusers.conf").read_text()
    assert _cli("systemd", "print", "sysusers").stdout == shipped
    bad = _cli("systemd", "print", "servce")
    assert bad.returncode == 2 and "one of service, socket" in bad.stderr


def _rule(alerts: dict[str, Any], name: str) -> dict[str, Any]:
    (rule,) = [r for r in alerts["groups"][0]["rules"] if r.get("alert") == name]
    return rule


def _firing(alerts: dict[str, Any], name: str, **labels: str) -> dict[str, Any]:
    """promtool's expectation of ``name`` firing with ``labels``: its own labels
    and its annotations as Prometheus renders them for that instance."""
    rule = _rule(alerts, name)
    instance = labels["instance"]
    return {
        "exp_labels": {**rule.get("labels", {}), **labels},
        "exp_annotations": {
            k: v.replace("{{ $labels.instance }}", instance)
            for k, v in rule.get("annotations", {}).items()
        },
    }


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Prometheus)")
def test_capacity_alerts_fire_when_an_operator_must_act(tmp_path: Path) -> None:
    """Three nodes for 40 minutes (promtool's rule unit tests): ``full`` is a
    working cache, kept between the watermarks by eviction (above 90%, one
    short burst over the high watermark); ``stuck`` stays above the high
    watermark; ``refusing`` answers writes with NO_SPACE. Only the last two
    need an operator."""
    rules = REPO / "systemd/prometheus-alerts.yml"
    alerts = yaml.safe_load(rules.read_text())

    def node(instance: str, used: str, no_space: str) -> list[dict[str, str]]:
        at = f'{{job="kvoffload",instance="{instance}"}}'
        return [
            {"series": f"kvoffload_capacity_bytes{at}", "values": "1000x40"},
            {"series": f"kvoffload_used_bytes{at}", "values": used},
            {"series": f"kvoffload_reserved_bytes{at}", "values": "0x40"},
            {"series": f"kvoffload_high_watermark_ratio{at}", "values": "0.95x40"},
            {
                "series": f'kvoffload_errors_total{{job="kvoffload",instance="{instance}",'
                'code="NO_SPACE"}',
                "values": no_space,
            },
        ]

    stuck = {"job": "kvoffload", "instance": "stuck"}
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    *node("full", "930x10 990x3 920x27", "0x40"),
                    *node("stuck", "980x40", "0x40"),
                    *node("refusing", "900x40", "0+3x40"),
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "30m",
                        "alertname": "KvoffloadDiskNearCapacity",
                        "exp_alerts": [_firing(alerts, "KvoffloadDiskNearCapacity", **stuck)],
                    },
                    {
                        "eval_time": "30m",
                        "alertname": "KvoffloadWritesRefused",
                        "exp_alerts": [
                            _firing(alerts, "KvoffloadWritesRefused", instance="refusing")
                        ],
                    },
                ],
            }
        ],
    }
    spec = tmp_path / "alerts-test.yml"
    spec.write_text(yaml.safe_dump(test, sort_keys=False))
    for cmd in (["check", "rules", str(rules)], ["test", "rules", str(spec)]):
        proc = subprocess.run(["promtool", *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_request_latency_is_a_histogram_with_inclusive_buckets(store: Store) -> None:
    """Counted in plain numbers, exported as Prometheus' histogram: a bucket ``le``
    counts every observation <= its bound; count and +Inf agree."""
    m = _metrics(store)
    for seconds in (0.00005, 0.0001, 0.0003, 0.0025, 5.0):
        m.observe("lookup", seconds)
    m.observe("stats", 0.01)
    text = m.render().decode()

    def bucket(verb: str, le: str) -> float:
        found = re.search(
            rf'^kvoffload_request_seconds_bucket\{{le="{re.escape(le)}",verb="{verb}"\}} (\S+)$',
            text,
            re.M,
        )
        assert found is not None, (verb, le)
        return float(found.group(1))

    assert [bucket("lookup", le) for le in ("0.0001", "0.00025", "0.0005", "0.0025", "2.5")] == [
        2.0, 2.0, 3.0, 4.0, 4.0,
    ]  # fmt: skip
    assert bucket("lookup", "+Inf") == 5.0 and bucket("stats", "0.005") == 0.0
    assert bucket("stats", "0.01") == 1.0
    assert re.search(r'^kvoffload_request_seconds_count\{verb="lookup"\} 5\.0$', text, re.M)
    total = re.search(r'^kvoffload_request_seconds_sum\{verb="lookup"\} (\S+)$', text, re.M)
    assert total is not None and float(total.group(1)) == pytest.approx(5.00295)
    assert m.summary()["requests"]["lookup"]["count"] == 5
