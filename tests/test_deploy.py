"""deploy/: the alert rules pass `promtool check rules`, the dashboard's queries parse (promtool, as recording rules),
every metric name the rules and the dashboard select is one `tracer record --metrics` serves (the names of
tracer/recorder/metrics.py), and the DaemonSet and systemd unit hold what a BPF recorder needs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.need import need, need_module
from tracer.recorder.metrics import served_names

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yml"
UNIT = DEPLOY / "systemd" / "tracer-record@.service"

# PromQL words that are not metric names: keywords, and the aggregations' grouping clauses (their label lists are
# removed before names are read)
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_KEYWORDS |= {"inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Return the metric names a PromQL expression selects: identifiers left once strings, label matchers, range
    selectors and grouping label lists are removed, that are not a function call or a keyword."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def test_metric_names_reads_selectors_not_functions_or_labels():
    e = 'histogram_quantile(0.99, sum by (le, op) (rate(x_bucket{op=~"a|b"}[5m]))) / on(pid) y_total > bool 2e3'
    assert metric_names(e) == {"x_bucket", "y_total"}


def _rules() -> list[dict]:
    yaml = need_module("yaml")
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def _promtool() -> str:
    path = shutil.which("promtool")
    need(path, "promtool not installed (Debian's prometheus package: setup.sh installs it)")
    return str(path)


def test_promtool_accepts_the_alert_rules():
    r = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_the_alerts_fire_on_their_failure_mode_and_not_on_a_healthy_job():
    # deploy/prometheus/alerts_test.yml: synthetic series with known shares (sync-bound, data-bound, straggler
    # ranks; a healthy job), each alert's expected labels and rendered annotations, for promtool's evaluator
    tests = RULES.with_name("alerts_test.yml")
    r = subprocess.run([_promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_accepts_the_scrape_config_with_the_rules(tmp_path):
    yaml = need_module("yaml")
    cfg = yaml.safe_load(RULES.with_name("scrape.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["cuda-host-tracer"]["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]  # the systemd unit's
    k8s = jobs["cuda-host-tracer-k8s"]
    assert k8s["authorization"]["type"] == "Bearer" and k8s["kubernetes_sd_configs"]  # the DaemonSet's, with a token
    # Debian's Prometheus is built without Kubernetes discovery: promtool checks the rest
    cfg["scrape_configs"] = [j for j in cfg["scrape_configs"] if "kubernetes_sd_configs" not in j]
    cfg["rule_files"] = [str(RULES)]
    f = tmp_path / "prometheus.yml"
    f.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([_promtool(), "check", "config", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboards_queries_parse(tmp_path):
    yaml = need_module("yaml")
    exprs = _dashboard_exprs()
    assert len(exprs) >= 12
    # Grafana's $__rate_interval is a duration at query time; as recording rules, promtool parses each query
    rules = [
        {"record": f"dashboard:query_{i}", "expr": e.replace("$__rate_interval", "1m")} for i, e in enumerate(exprs)
    ]
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([_promtool(), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_selected_is_served(source):
    exprs = [r["expr"] for r in _rules()] if source == "alerts" else _dashboard_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, source
    assert used <= served_names(), sorted(used - served_names())


def test_the_dashboard_reads_by_failure_mode_with_the_overview_first():
    d = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in sorted(d["panels"], key=lambda p: p["gridPos"]["y"]) if p["type"] == "row"]
    assert rows[0].startswith("Read first")
    for mode in ("Sync-bound", "Host-bound", "Data-bound", "Straggler"):
        assert any(r.startswith(mode) for r in rows), mode
    for p in d["panels"]:
        assert p["type"] == "row" or p.get("description"), p["title"]  # every panel says what it shows


def test_the_alerts_cover_the_failure_modes():
    modes = {r.get("labels", {}).get("failure_mode") for r in _rules()}
    assert {"sync-bound", "host-bound", "data-bound", "straggler"} <= modes
    assert all(r["annotations"].get("summary") for r in _rules())


def test_the_daemonset_runs_a_privileged_host_pid_recorder_with_the_bpf_mounts():
    yaml = need_module("yaml")
    ds = yaml.safe_load(DAEMONSET.read_text())
    assert ds["kind"] == "DaemonSet" and ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    (c,) = spec["containers"]
    assert c["securityContext"]["privileged"] is True
    assert c["args"][0] == "record" and "--metrics" in c["args"]
    port = int(c["args"][c["args"].index("--metrics") + 1].rpartition(":")[2])
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
    # a non-loopback --metrics needs the bearer token: it comes from a Secret
    assert any(e["name"] == "TRACER_MCP_TOKEN" and "secretKeyRef" in e["valueFrom"] for e in c["env"])
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounted = {host[m["name"]] for m in c["volumeMounts"]}
    assert {"/sys/kernel/debug", "/sys/fs/bpf", "/sys/kernel/btf", "/lib/modules", "/proc"} <= mounted


def test_the_systemd_unit_records_with_metrics_on_loopback():
    text = UNIT.read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.*(?:\\\n.*)*)", text, re.M)
    args = exec_start.replace("\\\n", " ").split()
    assert args[0].endswith("/tracer") and args[1] == "record"
    assert args[args.index("--metrics") + 1] == "127.0.0.1:9464"
    assert "KillSignal=SIGINT" in text  # the recorder's Ctrl-C path writes the full DB
    # the flags it uses exist: `tracer record --help` lists each of them
    from tracer.commands.cli import main

    flags = [a for a in args if a.startswith("--")]
    assert flags and all(f in _record_help(main) for f in flags), flags


def _record_help(main) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["record", "--help"])
    return buf.getvalue()
