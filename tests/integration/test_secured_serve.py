"""`rlfeed serve --auth-token-file` as a user runs it: the CLI clients pick their token up
from RLFEED_TOKEN, the token file rotates on SIGHUP without a restart, and
`rlfeed demo --address` runs end to end against the secured sidecar."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
from helpers import serve_in_background, stop_serve
from rlfeed.client.transport import AuthenticationError, GrpcTransport


def _rlfeed(*args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "rlfeed", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def _write_tokens(path, **roles) -> None:
    path.write_text("".join(f"{token} {role}\n" for role, token in roles.items()))
    path.chmod(0o600)


@pytest.fixture
def secured_serve(tmp_path):
    """A background `rlfeed serve` with a token file; yields (address, token file, tokens)."""
    tokens = {role: secrets.token_urlsafe(32) for role in ("producer", "trainer", "admin")}
    token_file = tmp_path / "tokens.txt"
    _write_tokens(token_file, **tokens)
    config = tmp_path / "sidecar.toml"
    config.write_text(
        '[batching]\ntoken_budget = 2048\nworld_size = 2\n[ray]\nactor_name = "secured"\n'
        "[rollouts]\nprompts_per_step = 4\ngroup_size = 4\nvocab_size = 512\n"
    )
    server, address, line = serve_in_background(
        "--config", str(config), "--auth-token-file", str(token_file)
    )
    try:
        # Whoever reads the log sees what guards the port.
        assert line.rstrip().endswith("(embedded Ray; TLS off, mTLS off, tokens on)"), line
        yield server, address, token_file, tokens
    finally:
        stop_serve(server)


def test_status_needs_an_admin_token_from_the_environment(secured_serve):
    _, address, _, tokens = secured_serve
    refused = _rlfeed("status", "--address", address, "--timeout", "5")
    assert refused.returncode != 0
    assert tokens["admin"] not in refused.stdout + refused.stderr
    shown = _rlfeed("status", "--address", address, env={"RLFEED_TOKEN": tokens["admin"]})
    assert shown.returncode == 0, shown.stderr


def test_sighup_rotates_the_tokens_without_a_restart(secured_serve):
    server, address, token_file, tokens = secured_serve
    old, new = tokens["admin"], secrets.token_urlsafe(32)
    assert GrpcTransport(address, token=old, call_timeout_s=10).status() is not None
    _write_tokens(token_file, admin=new)
    server.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:  # the handler runs when the main thread next wakes (within half a second)
        try:
            GrpcTransport(address, token=old, call_timeout_s=5).status()
        except AuthenticationError as refused:
            assert refused.code == "UNAUTHENTICATED"
            break
        assert time.monotonic() < deadline, "the old token still works after SIGHUP"
        time.sleep(0.2)
    assert GrpcTransport(address, token=new, call_timeout_s=10).status() is not None
    assert server.poll() is None  # the same process: no restart


@pytest.mark.timeout(300)
def test_demo_runs_against_the_secured_sidecar(secured_serve):
    _, address, _, tokens = secured_serve
    result = _rlfeed(
        "demo", "--address", address, "--steps", "1",
        env={"RLFEED_TOKEN": tokens["admin"]}, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert tokens["admin"] not in result.stdout + result.stderr
