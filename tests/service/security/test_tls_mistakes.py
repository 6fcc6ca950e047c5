"""TLS mistakes as a user makes them, against real sidecars on loopback (`start_server`,
real Ray, real gRPC TLS): each is `TLSHandshakeError` at once, naming what to check, from
the client library and from `rlfeed status` alike; never "nothing answers" and never the
30 s connect budget. And `rlfeed serve` refuses a certificate it could not serve with
before Ray starts, in one line with exit status 2.

The certain readings (a verify failure, a wrong name, TLS against plaintext) fail on the
first answer; gRPC's "Socket closed" (plaintext against TLS, mutual TLS without a client
certificate) is raised after `SUSPECT_FOR_S` = 1.5 s of nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from rlfeed.client import BatchLoader, RolloutWriter, TLSHandshakeError
from rlfeed.client.transport import GrpcTransport
from rlfeed.service.config.security import SecurityConfig

FAIL_WITHIN_S = 5.0  # a handshake failure never heals: no retry budget is spent on it
CLI_FAIL_WITHIN_S = 10.0  # plus a Python start-up and gRPC import on a busy machine


@pytest.fixture(scope="module")
def sidecars(ray_local, pki):
    """Three real sidecars: "plaintext", "tls" and "mtls" (client certificates from ca)."""
    from rlfeed.service.config import SidecarConfig, with_overrides
    from rlfeed.service.frontend.server import start_server

    tls = {"tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key)}
    securities = {"plaintext": {}, "tls": tls, "mtls": {**tls, "tls_client_ca": str(pki.ca)}}
    started = {}
    try:
        for name, security in securities.items():
            config = with_overrides(
                SidecarConfig(),
                server={"host": "127.0.0.1", "port": 0},
                ray={"actor_name": f"rlfeed-scheduler-tls-mistakes-{name}"},
                security=security,
            )
            started[name] = start_server(config)
        yield {name: sidecar.address for name, sidecar in started.items()}
    finally:
        for sidecar in started.values():
            sidecar.stop(grace=0.5)


# (sidecar, the client's credentials as pki attribute names, what the line must say)
MISTAKES = {
    "plaintext client on a TLS port": (
        "tls",
        {},
        "it may speak TLS only; set RLFEED_TLS_CA to the CA of its certificate",
    ),
    "TLS client on a plaintext port": (
        "plaintext",
        {"tls_ca": "ca"},
        "the sidecar does not speak TLS there (a plaintext port)",
    ),
    "a CA that did not sign the sidecar's certificate": (
        "tls",
        {"tls_ca": "other_ca"},
        "does not verify against the CA in RLFEED_TLS_CA: set RLFEED_TLS_CA (tls_ca)",
    ),
    "no CA: the system's roots": (
        "mtls",
        {"tls_cert": "client_cert", "tls_key": "client_key"},
        "does not verify against the system's root certificates (RLFEED_TLS_CA is not set)",
    ),
    "a server name the certificate does not carry": (
        "tls",
        {"tls_ca": "ca", "tls_server_name": "other.example"},
        "does not carry the name 'other.example': set RLFEED_TLS_SERVER_NAME",
    ),
    "mutual TLS without a client certificate": (
        "mtls",
        {"tls_ca": "ca"},
        "it may require a client certificate (mutual TLS); set RLFEED_TLS_CERT and RLFEED_TLS_KEY",
    ),
}


def _credentials(pki, names: dict[str, str]) -> dict[str, str]:
    """Client arguments: every credential "" (none, the environment skipped) unless named."""
    given = {key: "" for key in ("token", "tls_ca", "tls_cert", "tls_key", "tls_server_name")}
    for key, value in names.items():
        given[key] = value if key == "tls_server_name" else str(getattr(pki, value))
    return given


def _environment(pki, names: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLFEED_", "GRPC_"))}
    for key, value in _credentials(pki, names).items():
        if value:
            env[f"RLFEED_{key.upper()}"] = value
    return env


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_writer_raises_the_tls_mistake_at_once_naming_what_to_check(sidecars, pki, mistake):
    target, names, expected = MISTAKES[mistake]
    address = sidecars[target]
    started = time.monotonic()
    writer = RolloutWriter(address, **_credentials(pki, names))
    with pytest.raises(TLSHandshakeError) as raised, writer:
        writer.register_tasks(["task-0"])
    seconds = time.monotonic() - started
    print(f"{mistake}: {seconds:.2f} s: {raised.value}")
    message = str(raised.value)
    assert message.startswith(f"UNAVAILABLE: TLS handshake with the sidecar at {address} failed: ")
    assert expected in message
    assert "\n" not in message and "is `rlfeed serve` running" not in message
    assert seconds < FAIL_WITHIN_S  # the writer's connect budget is 30 s


@pytest.mark.parametrize(
    "mistake",
    ["a CA that did not sign the sidecar's certificate", "mutual TLS without a client certificate"],
)
def test_a_loader_raises_the_tls_mistake_at_once(sidecars, pki, mistake):
    target, names, expected = MISTAKES[mistake]
    started = time.monotonic()
    loader = BatchLoader(sidecars[target], rank=0, world_size=1, **_credentials(pki, names))
    with pytest.raises(TLSHandshakeError, match="set RLFEED_TLS_") as raised, loader:
        loader.fetch(0)
    assert expected in str(raised.value)
    assert time.monotonic() - started < FAIL_WITHIN_S


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_rlfeed_status_names_the_tls_mistake_in_one_line(sidecars, pki, mistake):
    target, names, expected = MISTAKES[mistake]
    address = sidecars[target]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlfeed", "status", "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(pki, names),
    )
    seconds = time.monotonic() - started
    print(f"{mistake}: exit {done.returncode} after {seconds:.2f} s: {done.stderr}")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line
    assert done.stderr.startswith(
        f"rlfeed status: TLS handshake with the sidecar at {address} failed: "
    )
    assert expected in done.stderr
    assert seconds < CLI_FAIL_WITHIN_S


@pytest.mark.parametrize("command", ["demo", "layout"])
def test_the_other_client_commands_name_the_tls_mistake_in_one_line(
    sidecars, pki, command, tmp_path
):
    address = sidecars["tls"]
    extra = ["--step", "0", "-o", str(tmp_path / "step.png")] if command == "layout" else []
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlfeed", command, "--address", address, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(pki, {"tls_ca": "other_ca"}),
    )
    seconds = time.monotonic() - started
    print(f"rlfeed {command}: exit {done.returncode} after {seconds:.2f} s: {done.stderr}")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(
        f"rlfeed {command}: TLS handshake with the sidecar at {address} failed: "
    )
    assert "set RLFEED_TLS_CA (tls_ca) to the CA that signed it" in done.stderr
    assert seconds < CLI_FAIL_WITHIN_S


def test_the_right_credentials_still_answer(sidecars, pki):
    """The control: the same sidecars, the credentials that fit."""
    for target, names in (
        ("plaintext", {}),
        ("tls", {"tls_ca": "ca"}),
        ("mtls", {"tls_ca": "ca", "tls_cert": "client_cert", "tls_key": "client_key"}),
    ):
        transport = GrpcTransport(sidecars[target], **_credentials(pki, names))
        try:
            assert transport.status().world_size == 1
        finally:
            transport.close()


@pytest.mark.parametrize(
    ("cert", "expected"),
    [
        ("expired_server_cert", "the sidecar's certificate has expired: renew its"),
        ("future_server_cert", "the sidecar's certificate is not valid yet: renew its"),
    ],
)
def test_a_sidecar_certificate_out_of_its_dates_is_named_by_the_client(
    serve_fake, pki, cert, expected
):
    """A server that started before its certificate expired (rlfeed serve refuses one that
    is out of its dates at start-up: below)."""
    config = SecurityConfig(tls_cert=str(getattr(pki, cert)), tls_key=str(pki.server_key))
    server, _, (address,) = serve_fake([], config)
    try:
        transport = GrpcTransport(address, **_credentials(pki, {"tls_ca": "ca"}))
        started = time.monotonic()
        with pytest.raises(TLSHandshakeError, match=expected):
            transport.status()
        assert time.monotonic() - started < FAIL_WITHIN_S
        transport.close()
    finally:
        server.stop(None)


# ------------------------------------------------------------- rlfeed serve's own files
def _serve(*flags: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlfeed", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize(
    ("cert", "key", "expected"),
    [
        ("server_cert", "client_key", "the key is not the certificate's (KEY_VALUES_MISMATCH)"),
        ("server_key", "server_key", "holds no PEM certificate"),
        ("server_cert", "server_cert", "holds no unencrypted PEM private key"),
        ("expired_server_cert", "server_key", "expired on"),
        ("future_server_cert", "server_key", "is not valid until"),
    ],
)
def test_serve_refuses_a_certificate_it_could_not_serve_before_ray_starts(pki, cert, key, expected):
    cert_path, key_path = str(getattr(pki, cert)), str(getattr(pki, key))
    done, seconds = _serve("--tls-cert", cert_path, "--tls-key", key_path)
    print(f"{cert} + {key}: exit {done.returncode} after {seconds:.2f} s: {done.stderr}")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line, no Ray
    assert done.stderr.startswith("rlfeed serve: [security] tls_cert")
    assert expected in done.stderr and cert_path in done.stderr
    if "not valid" not in expected and "expired" not in expected:
        assert key_path in done.stderr  # a pair that does not fit names both files
    assert done.stdout == ""  # not even the config: nothing started
    assert seconds < CLI_FAIL_WITHIN_S


def test_a_missing_tls_file_and_a_half_pair_are_the_same_config_error(pki, tmp_path):
    missing = str(tmp_path / "nope.pem")
    for flags, expected in (
        (("--tls-cert", missing, "--tls-key", str(pki.server_key)), f"{missing} is not a file"),
        (("--tls-cert", str(pki.server_cert)), "tls_cert and tls_key are set together"),
    ):
        done, seconds = _serve(*flags)
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
        assert expected in done.stderr
        assert seconds < CLI_FAIL_WITHIN_S


def test_serve_says_tls_is_on_and_status_answers_with_the_right_credentials(pki, tmp_path):
    """The real `rlfeed serve` with mutual TLS: its `listening on` line says what is on,
    and `rlfeed status` with RLFEED_TLS_CA / CERT / KEY answers (exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    config = tmp_path / "sidecar.toml"
    config.write_text('[ray]\nactor_name = "rlfeed-scheduler-tls-listening"\n')
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "serve", "--config", str(config), "--port", "0",
         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
         "--tls-client-ca", str(pki.ca)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        for line in serve.stdout:
            if line.startswith("rlfeed serve: listening on "):
                break
        else:
            raise AssertionError(f"rlfeed serve exited ({serve.wait()}) before listening")
        address = line.split()[4]
        assert line.rstrip().endswith("(embedded Ray; TLS on, mTLS on, tokens off)"), line
        names = {"tls_ca": "ca", "tls_cert": "client_cert", "tls_key": "client_key"}
        shown = subprocess.run(
            [sys.executable, "-m", "rlfeed", "status", "--address", address],
            capture_output=True, text=True, timeout=60, env=_environment(pki, names),
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"rlfeed sidecar at {address}: SERVING")
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
