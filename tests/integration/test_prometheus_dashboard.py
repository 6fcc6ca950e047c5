"""Every PromQL expression of the Grafana dashboard returns data from a real Prometheus
scraping a live sidecar.

The integration test starts a real Prometheus server (Debian package `prometheus`) on a free
loopback port with a temporary config (1 s scrape interval) and storage, and `rlfeed demo
--synthetic --steps 3 --metrics-port P` as a user runs it: an embedded sidecar (Ray actor,
gRPC), the synthetic fleet and two trainer processes, the sidecar exporting its metrics on
P. Prometheus scrapes it while the demo trains; the moment every step was assembled and
served, every expression found in `deploy/grafana/dashboards/rlfeed.json` is evaluated at
that moment through `/api/v1/query`: each must return at least one sample with a finite
value. The test also fetches `/layout.png` from the live endpoint, checks the pass-rate
panel holds the curriculum's real estimates, and checks the demo's printed summary against
the metrics where they overlap (steps, rollouts, tokens, padding shares, GPU-hours, rollouts
saved). Without the binary the test is skipped, or fails when the environment variable CI is
set. Prometheus and the demo are always torn down.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import free_port
from rlfeed.service.demo.fleet import FleetConfig
from rlfeed.service.metrics.http import MetricsServer
from rlfeed.service.metrics.recorder import PASS_RATE_BUCKETS, MetricsConfig, SidecarMetrics
from rlfeed.service.testing import step_record

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/rlfeed.json"
PROVISIONING = ROOT / "deploy/grafana/provisioning"
# What Grafana's built-in interval variables become in the test's instant queries: the
# rate interval Grafana picks for the shipped 5 s scrape interval (4 x 5 s).
# The job and instance variables as the test's Prometheus has them: its one job, and "All"
# front-ends (the variable's allValue).
GRAFANA_VARIABLES = {
    "$__rate_interval": "20s",
    "$__interval": "1s",
    "$__range": "1m",
    "$job": "rlfeed",
    "$instance": ".+",
}
# What every metric selector of the dashboard carries: one run (job), the chosen front-ends.
SCOPE = 'job="$job",instance=~"$instance"'

# Three steps: the fleet submits the last step's groups only after the trainers report the
# first, so ingest, serving and trainer reports are all inside the last rate interval.
DEMO_STEPS = 3


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested panels included."""
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_queries(dashboard: dict, *, substituted: bool = True) -> list[tuple[str, str]]:
    """(panel title, expression) of every target, Grafana variables substituted."""
    queries = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items() if substituted else ():
                expr = expr.replace(name, value)
            queries.append((panel["title"], expr))
    return queries


def _substituted(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# ------------------------------------------------------------------ static checks


def test_dashboard_uses_the_datasource_variable_and_has_the_issues_rows():
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for panel in dashboard_panels(dashboard):
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
    rows = " ".join(p["title"].lower() for p in dashboard["panels"] if p["type"] == "row")
    for topic in ("ingest", "batching", "curriculum", "cost", "trainers"):
        assert topic in rows
    assert all("$" not in expr for _, expr in dashboard_queries(dashboard))


def test_every_query_is_scoped_to_the_chosen_job_and_front_ends():
    """Two runs scraped by one Prometheus are never summed: `job` picks one run (a single
    value, no "All"), `instance` its front-ends (All by default, summed as one sidecar)."""
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    job, instance = variables["job"], variables["instance"]
    assert job["type"] == instance["type"] == "query"
    assert not job["multi"] and not job["includeAll"]
    assert job["query"] == "label_values(rlfeed_build_info, job)"
    assert instance["query"] == 'label_values(rlfeed_build_info{job="$job"}, instance)'
    assert instance["includeAll"] and instance["allValue"] == GRAFANA_VARIABLES["$instance"]
    for variable in (job, instance):
        assert variable["datasource"]["uid"] == "${DS_PROMETHEUS}"
    queries = dashboard_queries(dashboard, substituted=False)
    assert len(queries) > 50
    for title, expr in queries:
        selectors = re.findall(r"\brlfeed_\w+(\{[^}]*\})?", expr)
        assert selectors, f"panel {title!r} queries no rlfeed metric: {expr}"
        for selector in selectors:
            assert selector.endswith(SCOPE + "}"), f"panel {title!r}: {expr}"


def test_rates_of_counts_are_in_counts_per_second_not_requests():
    for panel in dashboard_panels(load_dashboard()):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert unit != "reqps", panel["title"]
        if panel["title"] in ("Rollouts per second", "Tasks sampled per second"):
            assert unit == "cps", panel["title"]


def test_every_metric_the_dashboard_queries_is_exported():
    text = SidecarMetrics().exposition().decode()
    # Declared families, labelled ones included before their first series exists.
    families = set(re.findall(r"^# TYPE (rlfeed_\w+) ", text, flags=re.MULTILINE))
    suffixes = ("", "_bucket", "_sum", "_count")
    for title, expr in dashboard_queries(load_dashboard()):
        for name in re.findall(r"\brlfeed_\w+", expr):
            assert any(name.removesuffix(s) in families for s in suffixes if name.endswith(s)), (
                f"panel {title!r} queries {name}, which is not exported"
            )


def test_provisioning_points_grafana_at_the_dashboard_and_a_prometheus_datasource():
    datasources = yaml.safe_load((PROVISIONING / "datasources/rlfeed.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    providers = yaml.safe_load((PROVISIONING / "dashboards/rlfeed.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    # The README mounts deploy/grafana/dashboards at this path.
    readme = (ROOT / "deploy/grafana/README.md").read_text()
    assert f"deploy/grafana/dashboards:{provider['options']['path']}" in readme
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] == "/metrics"


# ------------------------------------------------------------------ live Prometheus


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None
    )
    if path is None:
        reason = "the prometheus binary is not installed (Debian package `prometheus`)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must install it (make system-deps)")
        pytest.skip(reason)
    return path


def http_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, *targets: str):
    """A Prometheus scraping `targets` every second; yields its base URL."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "rlfeed",
                        "metrics_path": "/metrics",
                        "static_configs": [{"targets": list(targets)}],
                    }
                ],
            }
        )
    )
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {process.returncode}: "
                    f"{(tmp_path / 'prometheus.log').read_text()[-2000:]}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response,
            ):
                if response.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("prometheus did not become ready in 20 s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()


def query(prometheus: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query, evaluated now or at unix time `at`."""
    params = {"query": expr} | ({} if at is None else {"time": repr(at)})
    answer = http_json(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode(params))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@contextlib.contextmanager
def running_demo(tmp_path: Path, metrics_port: int, steps: int):
    """`rlfeed demo --synthetic --steps N --metrics-port P` as a user runs it; yields the
    Popen (its output goes to tmp_path/demo.log). Interrupted like Ctrl-C if still running
    at the end, so it stops its trainers and sidecar itself."""
    log = (tmp_path / "demo.log").open("w")
    command = [sys.executable, "-m", "rlfeed.service.cli", "demo", "--synthetic"]
    command += ["--steps", str(steps)]
    process = subprocess.Popen(
        [*command, "--metrics-port", str(metrics_port)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        log.close()


def demo_summary(output: str) -> dict[str, str]:
    block = output.split("\nsummary\n", 1)[1]
    return dict(
        re.match(r"\s+(\S.*?)\s{2,}(\S.*)", line).groups() for line in block.splitlines() if line
    )


def number(text: str) -> float:
    """The first number of a summary value ("54,707 (32,158 policy tokens)" -> 54707)."""
    return float(re.match(r"[-+]?[\d,.]+", text).group().replace(",", ""))


def scalar(prometheus: str, expr: str, at: float) -> float:
    (sample,) = query(prometheus, expr, at)
    return float(sample["value"][1])


NEWEST_STEP_ONLY = _substituted(
    f"and on(instance) (rlfeed_step{{{SCOPE}}} == scalar(max(rlfeed_step{{{SCOPE}}})))"
)


def test_per_step_panels_draw_the_newest_step_as_one_series_across_front_ends(tmp_path):
    """With `rlfeed serve --replicas N` each front-end exports the per-step gauges of the
    steps it assembled, so a bare gauge draws one line per front-end, each stuck at its own
    last step. Every per-step panel keeps the front-end holding the newest step and drops
    the instance label: one line (one per phase for GPU-hours) with the newest step's
    figures, also across a change of the front-end that holds it."""
    dashboard = load_dashboard()
    per_step = [
        (title, expr)
        for title, expr in dashboard_queries(dashboard)
        if re.search(r"\brlfeed_step_(?!latency)\w+", expr) and "_total" not in expr
    ]
    assert len(per_step) >= 10
    for title, expr in per_step:
        assert NEWEST_STEP_ONLY in expr, f"panel {title!r}: {expr}"
    real_tokens = next(e for _, e in per_step if "rlfeed_step_real_tokens{" in e)
    first, second = (SidecarMetrics(MetricsConfig(world_size=2)) for _ in range(2))
    first.on_step(step_record(step=6, real_tokens=300))
    second.on_step(step_record(step=7, real_tokens=350))
    with (
        MetricsServer(first) as first_server,
        MetricsServer(second) as second_server,
        running_prometheus(
            tmp_path, f"127.0.0.1:{first_server.port}", f"127.0.0.1:{second_server.port}"
        ) as prometheus,
    ):

        def wait_for_step(step: int) -> float:
            deadline = time.monotonic() + 20
            while scalar_or_none(prometheus, "max(rlfeed_step)") != step:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {step} not scraped in 20 s")
                time.sleep(0.2)
            return time.time()

        start = wait_for_step(7)  # held by the second front-end
        assert scalar(prometheus, real_tokens, time.time()) == 350
        first.on_step(step_record(step=8, real_tokens=380))
        wait_for_step(8)  # now by the first
        assert scalar(prometheus, real_tokens, time.time()) == 380
        time.sleep(2.5)  # so the range's last 1 s points are past the change
        end = time.time()
        for title, expr in per_step:
            series = query_range(prometheus, expr, start, end)
            phases = 3 if "gpu_seconds" in expr else 1
            assert len(series) == phases, f"panel {title!r}: {[s['metric'] for s in series]}"


def query_range(prometheus: str, expr: str, start: float, end: float) -> list[dict]:
    """Range query at 1 s resolution: one entry per series a panel would draw."""
    params = {"query": expr, "start": repr(start), "end": repr(end), "step": "1"}
    answer = http_json(f"{prometheus}/api/v1/query_range?" + urllib.parse.urlencode(params))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def scalar_or_none(prometheus: str, expr: str) -> float | None:
    samples = query(prometheus, expr)
    return float(samples[0]["value"][1]) if samples else None


def test_every_dashboard_query_returns_data_from_prometheus_scraping_a_live_demo(tmp_path):
    prometheus_binary()
    metrics_port = free_port()
    target = f"127.0.0.1:{metrics_port}"
    layout = tmp_path / "layout.png"
    with (
        running_prometheus(tmp_path, target) as prometheus,
        running_demo(tmp_path, metrics_port, DEMO_STEPS) as demo,
    ):
        # While the demo runs: the layout picture once a step exists, then the moment every
        # step was assembled and served, at which the dashboard is evaluated.
        deadline = time.monotonic() + 150
        while True:
            assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the demo never served its steps"
            progress = {
                name: query(prometheus, f"rlfeed_{name}_total")
                for name in ("steps_assembled", "steps_served")
            }
            counts = {k: float(v[0]["value"][1]) if v else 0.0 for k, v in progress.items()}
            if counts["steps_assembled"] >= 1 and not layout.exists():
                url = f"http://{target}/layout.png"
                with urllib.request.urlopen(url, timeout=30) as response:
                    assert response.status == 200
                    layout.write_bytes(response.read())
            if min(counts.values()) >= DEMO_STEPS:
                at = float(progress["steps_served"][0]["value"][0])
                break
            time.sleep(0.5)
        assert demo.wait(timeout=60) == 0, (tmp_path / "demo.log").read_text()[-3000:]

        failures = []
        for title, expr in dashboard_queries(load_dashboard()):
            values = [float(s["value"][1]) for s in query(prometheus, expr, at)]
            if not any(math.isfinite(v) for v in values):
                failures.append(f"{title!r}: {expr} -> {values or 'no data'}")
        assert not failures, "panels without data:\n" + "\n".join(failures)

        # The pass-rate panel shows the curriculum's real estimates: every task, spread out.
        buckets = {
            s["metric"]["le"]: float(s["value"][1])
            for s in query(prometheus, "max by (le) (rlfeed_curriculum_pass_rate_bucket)", at)
        }
        assert buckets["+Inf"] == FleetConfig().num_tasks
        counts = np.diff([0.0] + [buckets[repr(b)] for b in PASS_RATE_BUCKETS])
        assert (counts > 0).sum() >= 3, buckets  # not one spike at the initial estimate

        # The demo's summary and the metrics count the same steps the same way.
        summary = demo_summary((tmp_path / "demo.log").read_text())
        assert number(summary["steps"]) == scalar(prometheus, "rlfeed_steps_assembled_total", at)
        assert number(summary["rollouts trained"]) == scalar(
            prometheus, "rlfeed_rollouts_trained_total", at
        )
        assert number(summary["tokens"]) == scalar(prometheus, "rlfeed_real_tokens_total", at)
        policy_tokens = number(summary["tokens"].split("(", 1)[1])
        assert policy_tokens == scalar(prometheus, "rlfeed_policy_tokens_total", at)
        packed_share, padded_share = (
            float(share) / 100 for share in re.findall(r"([\d.]+)%", summary["padding share"])
        )
        for share, expr in (
            (packed_share, "1 - rlfeed_real_tokens_total / rlfeed_computed_positions_total"),
            (
                padded_share,
                "1 - rlfeed_real_tokens_total / rlfeed_padded_alternative_positions_total",
            ),
        ):
            assert share == pytest.approx(scalar(prometheus, expr, at), abs=0.0006), expr
        gpu_hours = scalar(
            prometheus,
            "sum(rlfeed_predicted_gpu_seconds_total) / 3600 / sum(rlfeed_steps_assembled_total)",
            at,
        )
        assert number(summary["predicted GPU-hours per step"]) == pytest.approx(gpu_hours, rel=1e-3)
        assert number(summary["rollouts saved by the filter"]) == scalar(
            prometheus, "rlfeed_curriculum_rollouts_saved_total", at
        )
    assert layout.read_bytes().startswith(b"\x89PNG") and layout.stat().st_size > 10_000
