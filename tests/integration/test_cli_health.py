"""`rlfeed health`, the probe the compose healthcheck and the KubeRay readiness probe run:
against a real `rlfeed serve --auth-token-file` it answers without a token (where `rlfeed
status` is refused), and it fails within its --timeout when nothing serves, including a
port that accepts connections and never answers."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import serve_in_background, stop_serve

# Start-up of a Python process with grpc imported, on a loaded 2-core machine.
PROCESS_SLACK_S = 15.0


def _rlfeed(*args: str, env: dict | None = None, timeout: float = 60):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLFEED_")}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "rlfeed", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return result, time.monotonic() - started


@pytest.fixture
def tokened_serve(tmp_path):
    """A background `rlfeed serve` whose every call but health needs a token."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{secrets.token_urlsafe(32)} admin\n")
    tokens.chmod(0o600)
    config = tmp_path / "sidecar.toml"
    config.write_text(
        '[batching]\ntoken_budget = 2048\n[ray]\nactor_name = "health-probe"\n'
        "[rollouts]\nprompts_per_step = 2\ngroup_size = 2\nvocab_size = 512\n"
    )
    server, address, _ = serve_in_background(
        "--config", str(config), "--auth-token-file", str(tokens)
    )
    try:
        yield server, address
    finally:
        stop_serve(server)


def test_health_answers_a_tokened_sidecar_without_a_token_and_fails_once_it_stops(
    tokened_serve,
):
    server, address = tokened_serve
    probe, _ = _rlfeed("health", "--address", address, "--timeout", "5")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout == f"rlfeed sidecar at {address}: SERVING\n"
    status, _ = _rlfeed("status", "--address", address, "--timeout", "5")
    assert status.returncode != 0  # what the compose healthcheck used to run

    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)
    down, seconds = _rlfeed("health", "--address", address, "--timeout", "2")
    assert down.returncode == 1
    assert down.stdout == ""
    assert down.stderr == (
        f"rlfeed health: nothing answers at {address} (is `rlfeed serve` running?)\n"
    )
    assert seconds < 2 + PROCESS_SLACK_S


def test_health_gives_up_within_its_timeout_on_a_port_that_never_answers():
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        probe, seconds = _rlfeed("health", "--address", address, "--timeout", "2")
    assert probe.returncode == 1
    assert probe.stderr.startswith("rlfeed health: nothing answers at ")
    assert 2 <= seconds < 2 + PROCESS_SLACK_S


def test_health_with_an_unreadable_ca_file_is_one_line_and_exit_status_2(tmp_path):
    missing = tmp_path / "nope.pem"
    probe, _ = _rlfeed("health", "--address", "127.0.0.1:1", env={"RLFEED_TLS_CA": str(missing)})
    assert probe.returncode == 2
    assert probe.stderr.startswith(f"rlfeed health: tls_ca: cannot read {missing}: ")
    assert probe.stderr.count("\n") == 1
