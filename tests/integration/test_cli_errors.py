"""What users meet first when something is off, run as they run it: the real `rlfeed`
command in a subprocess. Each failure is one line on stderr, a documented exit status, no
traceback, within seconds (the time to fail is printed), and leaves nothing running.

Tests needing a sidecar share the session's Ray (`make_sidecar`); those that need a
`rlfeed serve` or `rlfeed demo` of their own start its embedded Ray (the demo stopped by
SIGTERM is marked slow).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import free_port
from rlfeed import __version__

_spec = importlib.util.spec_from_file_location(
    "sidecar_memory", Path(__file__).with_name("sidecar_memory.py")
)
sidecar_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sidecar_memory)

ROOT = Path(__file__).resolve().parents[2]
FAIL_WITHIN_S = 10.0
# Ray's own log records (its start-up notes on stderr): "2026-12-01 16:13:58,071\tINFO ...".
RAY_LOG_RECORD = re.compile(r"^(\[)?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")


def rlfeed(*args: str, env: dict | None = None, timeout: float = 120) -> tuple:
    """(CompletedProcess, seconds) of `python -m rlfeed ARGS`; RLFEED_ADDRESS and
    RAY_ADDRESS only as `env` gives them."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RLFEED_ADDRESS", "RAY_ADDRESS")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlfeed", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **(env or {})},
    )
    return done, time.monotonic() - started


def assert_fails_in_one_line(done, seconds: float, code: int, expected: str) -> None:
    command = " ".join(map(str, done.args[2:4]))
    print(f"{command}: exit {done.returncode} after {seconds:.2f} s: {done.stderr}")
    assert "Traceback" not in done.stderr + done.stdout
    assert done.returncode == code, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert expected in done.stderr, done.stderr
    assert seconds < FAIL_WITHIN_S


# ------------------------------------------------------------------ nothing answers there
@pytest.mark.parametrize("via", ["flag", "RLFEED_ADDRESS"])
def test_demo_against_nothing_says_so_in_one_line(via):
    address = f"127.0.0.1:{free_port()}"
    if via == "flag":
        done, seconds = rlfeed("demo", "--address", address)
    else:
        done, seconds = rlfeed("demo", env={"RLFEED_ADDRESS": address})
    expected = f"rlfeed demo: nothing answers at {address} (is `rlfeed serve` running?)"
    assert_fails_in_one_line(done, seconds, 1, expected)
    assert "starting the sidecar" not in done.stdout


def test_layout_of_a_served_step_against_nothing_says_so_in_one_line(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    done, seconds = rlfeed("layout", "-o", str(tmp_path / "x.png"), "--address", address)
    assert_fails_in_one_line(done, seconds, 1, f"rlfeed layout: nothing answers at {address}")


def test_status_reads_rlfeed_address_and_the_flag_wins_over_it():
    env_address, flag_address = (f"127.0.0.1:{free_port()}" for _ in range(2))
    done, seconds = rlfeed("status", env={"RLFEED_ADDRESS": env_address})
    assert_fails_in_one_line(done, seconds, 1, f"nothing answers at {env_address}")
    done, seconds = rlfeed("status", "--address", flag_address, env={"RLFEED_ADDRESS": env_address})
    assert_fails_in_one_line(done, seconds, 1, f"nothing answers at {flag_address}")


def test_status_tells_a_name_that_does_not_resolve_from_a_refused_connection():
    done, seconds = rlfeed("status", "--address", "nosuch.invalid:50051")
    assert_fails_in_one_line(done, seconds, 1, "cannot resolve the host name of nosuch.invalid")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--address", "localhost"], "must be HOST:PORT"),  # gRPC would dial port 443
        (["--address", "localhost:http"], "must be HOST:PORT"),
        (["--timeout", "0"], "must be a finite number > 0"),
    ],
)
def test_status_refuses_an_address_without_a_port_and_a_zero_timeout(flags, expected):
    done, _ = rlfeed("status", *flags)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert expected in done.stderr.splitlines()[-1], done.stderr


# ------------------------------------------------------------------------- serve's port
@pytest.mark.parametrize("holder", ["a plain listener", "another sidecar's replicas"])
def test_serve_refuses_a_port_in_use_before_ray_starts(holder):
    """A second sidecar's front-ends share their port with SO_REUSEPORT: one more bind
    with it would split the producers' traffic between two schedulers, so the probe binds
    without it and is refused too."""
    with socket.socket() as taken:
        if holder == "another sidecar's replicas":
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done, seconds = rlfeed("serve", "--port", str(port), "--replicas", "2")
    expected = f"rlfeed serve: cannot listen on 127.0.0.1:{port}: the port is in use"
    assert_fails_in_one_line(done, seconds, 1, expected)
    assert "listening on" not in done.stdout


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_serve_print_config_prints_the_resolved_config_and_starts_nothing(fmt, tmp_path):
    from rlfeed.service.config import config_to_dict, load_config

    flags = ["--print-config"] if fmt == "toml" else ["--print-config", "json"]
    done, seconds = rlfeed("serve", "--world-size", "2", "--port", "7000", *flags)
    print(f"--print-config {fmt}: exit {done.returncode} after {seconds:.2f} s")
    assert (done.returncode, done.stderr) == (0, ""), done.stderr  # no Ray start-up notes
    if fmt == "toml":  # `> cfg.toml` is a config file `--config` takes
        (tmp_path / "cfg.toml").write_text(done.stdout)
        printed = config_to_dict(load_config(str(tmp_path / "cfg.toml")))
    else:
        printed = json.loads(done.stdout)
    assert printed["batching"]["world_size"] == 2 and printed["server"]["port"] == 7000
    assert "listening on" not in done.stdout
    assert seconds < FAIL_WITHIN_S


def test_status_with_an_unreadable_tls_ca_says_so_in_one_line():
    done, seconds = rlfeed("status", env={"RLFEED_TLS_CA": "/nonexistent/ca.pem"})
    expected = "rlfeed status: tls_ca: cannot read /nonexistent/ca.pem: No such file or directory"
    assert_fails_in_one_line(done, seconds, 2, expected)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tls-cert", "/nonexistent/server.pem", "--tls-key", "/nonexistent/server.key"],
         "[security] tls_cert: /nonexistent/server.pem is not a file"),
        (["--tls-cert", "/nonexistent/server.pem"], "tls_cert and tls_key are set together"),
    ],
)  # fmt: skip
def test_serve_a_missing_tls_file_and_a_half_pair_are_both_config_errors(flags, expected):
    done, seconds = rlfeed("serve", "--port", "0", *flags)
    assert_fails_in_one_line(done, seconds, 2, expected)
    assert done.stdout == ""  # before Ray, before the config print


def test_serve_help_states_the_ray_address_precedence():
    done, _ = rlfeed("serve", "--help")
    text = " ".join(done.stdout.split())
    assert "Default: $RAY_ADDRESS when set" in text and "'local' starts an embedded one" in text


def test_client_commands_help_state_the_address_precedence():
    for command in ("status", "layout", "demo"):
        done, _ = rlfeed(command, "--help")
        assert "$RLFEED_ADDRESS when set" in " ".join(done.stdout.split()), command


# ------------------------------------------------------------------- version and renames
def test_version():
    done, seconds = rlfeed("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"rlfeed {__version__}\n", "")
    assert seconds < FAIL_WITHIN_S


def test_the_old_example_flags_still_work_and_say_their_new_names(tmp_path):
    done, _ = rlfeed("plan", "--example", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["num_sequences"] == 512
    assert done.stderr == "rlfeed plan: --example is now --bundled-lengths\n"
    done, _ = rlfeed("layout", "--example", "-o", str(tmp_path / "x.png"))
    assert done.returncode == 0, done.stderr
    assert done.stderr == "rlfeed layout: --example is now --synthetic-step\n"
    assert "--example" not in rlfeed("plan", "--help")[0].stdout


# ------------------------------------------------------------------------ layout formats
def test_layout_writes_a_jpeg_for_jpg_and_refuses_what_it_cannot_write(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("step.jpg", "step.JPEG"):
        done, _ = rlfeed("layout", "--synthetic-step", "-o", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        assert (tmp_path / name).read_bytes()[:3] == b"\xff\xd8\xff"  # JPEG's SOI marker
    done, _ = rlfeed("layout", "--synthetic-step", "-o", str(tmp_path / "step.svg"))
    assert done.returncode == 0 and b"<svg" in (tmp_path / "step.svg").read_bytes()[:500]
    done, seconds = rlfeed("layout", "--synthetic-step", "-o", str(tmp_path / "step.gif"))
    assert_fails_in_one_line(done, seconds, 2, "step.gif: .gif is not a format it writes")
    assert not (tmp_path / "step.gif").exists()


# ------------------------------------------------------------------- proto regeneration
def test_proto_generate_has_help_and_refuses_to_rewrite_an_installed_rlfeed(tmp_path):
    """An installed layout (no pyproject.toml beside the package) as a wheel leaves it."""
    package = tmp_path / "site-packages" / "rlfeed"
    shutil.copytree(ROOT / "proto", package / "proto", ignore=shutil.ignore_patterns("__py*"))
    shutil.copyfile(ROOT / "__init__.py", package / "__init__.py")
    before = {p.name: p.read_bytes() for p in (package / "proto").iterdir()}
    command = [sys.executable, "-m", "rlfeed.proto.generate"]
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env)
    assert shown.returncode == 0 and "--out-dir" in shown.stdout
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert_fails_in_one_line(
        done, time.monotonic() - started, 1, "is an installed rlfeed, not a source checkout"
    )
    assert {p.name: p.read_bytes() for p in (package / "proto").iterdir()} == before


# ------------------------------------------------------------- against a running sidecar
@pytest.fixture
def demo_sidecar(make_sidecar):
    return make_sidecar(
        batching={"token_budget": 2048, "world_size": 2},
        rollouts={"prompts_per_step": 4, "group_size": 4, "vocab_size": 512},
    )


def test_status_json_is_strict_json_with_nan_as_null(demo_sidecar):
    from rlfeed.client.transport import GrpcTransport
    from rlfeed.proto import rlfeed_pb2 as pb

    transport = GrpcTransport(demo_sidecar.address)
    try:  # a trainer whose step had no ratio to report (unset: NaN inside the sidecar)
        transport.report(pb.TrainerReport(step=0, rank=0))
    finally:
        transport.close()
    done, _ = rlfeed("status", "--address", demo_sidecar.address, "--json")
    assert done.returncode == 0, done.stderr

    def refuse(token: str):
        raise AssertionError(f"not JSON: {token}")

    status = json.loads(done.stdout, parse_constant=refuse)
    assert status["last_reports"][0].get("ratio_outlier_share") is None


def _until_first_step(demo: subprocess.Popen) -> None:
    for line in demo.stdout:
        if line.startswith("step "):
            return
    raise AssertionError(f"rlfeed demo ended before a step: {demo.stderr.read()[-3000:]}")


@pytest.mark.parametrize(
    ("signum", "code", "message"),
    [
        (signal.SIGINT, 130, "rlfeed demo: interrupted"),
        (signal.SIGTERM, 143, "rlfeed demo: terminated (SIGTERM)"),
    ],
)
def test_demo_stops_on_ctrl_c_and_sigterm_in_one_line(demo_sidecar, signum, code, message):
    """Ctrl-C as a terminal sends it, to the whole process group; SIGTERM as `docker stop`
    sends it, to the process. Either way the trainer ranks are stopped too."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "demo", "--address", demo_sidecar.address,
         "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _until_first_step(demo)
        trainers = sidecar_memory.children_by_parent().get(demo.pid, [])
        assert len(trainers) == 2, trainers
        sent = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(demo.pid, signum)
        else:
            demo.send_signal(signum)
        _, stderr = demo.communicate(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    print(f"{signal.Signals(signum).name}: exit {demo.returncode} after {seconds:.2f} s")
    assert "Traceback" not in stderr
    assert stderr.splitlines() == [message]
    assert demo.returncode == code
    assert seconds < FAIL_WITHIN_S
    assert [pid for pid in trainers if Path(f"/proc/{pid}").exists()] == []


@pytest.mark.slow
def test_embedded_demo_stops_on_sigterm_and_shuts_ray_down():
    """The demo's own sidecar and Ray: SIGTERM once it trains gives exit 143, one line of
    rlfeed's (Ray's start-up notes aside), no stack dump, and no process left behind:
    every process the demo started carries a tag in its environment, and none outlives it."""
    tag = uuid.uuid4().hex
    demo = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "demo", "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RLFEED_TEST_TAG": tag},
    )
    try:
        _until_first_step(demo)
        sent = time.monotonic()
        demo.send_signal(signal.SIGTERM)
        _, stderr = demo.communicate(timeout=120)
        seconds = time.monotonic() - sent
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    print(f"SIGTERM: exit {demo.returncode} after {seconds:.2f} s; stderr:\n{stderr}")
    assert demo.returncode == 143
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr
    ours = [line for line in stderr.splitlines() if not RAY_LOG_RECORD.match(line)]
    assert ours == ["rlfeed demo: terminated (SIGTERM)"]
    assert seconds < 30  # Ray's shutdown included
    deadline = time.monotonic() + 20  # Ray's processes exit on their own once told to
    while (left := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"processes left behind: {left}"


def _tagged_processes(tag: str) -> list[str]:
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"RLFEED_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes():
                left.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:120]!r}")
        except OSError:
            continue
    return left


# --------------------------------------------------------- the scheduler dies, no journal
def _scheduler_actor_of(serve_pid: int) -> int:
    """The `ray::SchedulerActor` process of this `rlfeed serve`'s embedded Ray (never
    another sidecar's: only this process's descendants are searched)."""
    for pid in sidecar_memory.process_tree(serve_pid)[1:]:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::SchedulerActor"):
                return pid
        except OSError:
            continue
    raise AssertionError("no ray::SchedulerActor under this rlfeed serve")


def test_serve_without_a_journal_stops_with_one_clear_message_when_the_scheduler_dies(tmp_path):
    """SIGKILL to the scheduler actor of a sidecar without a journal: exit 1 with the one
    message that says why, not a traceback a second while it waits to be sure."""
    errors = tmp_path / "serve.err"
    serve = subprocess.Popen(
        [sys.executable, "-m", "rlfeed", "serve", "--port", "0"],
        stdout=subprocess.PIPE, stderr=errors.open("w"), text=True,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )  # fmt: skip
    try:
        for line in serve.stdout:
            if "listening on" in line:
                break
        else:
            raise AssertionError(f"rlfeed serve exited ({serve.wait()}): {errors.read_text()}")
        os.kill(_scheduler_actor_of(serve.pid), signal.SIGKILL)
        killed = time.monotonic()
        code = serve.wait(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    lines = errors.read_text().splitlines()
    print(f"exit {code} {seconds:.1f} s after the kill; stderr ({len(lines)} lines):")
    print("\n".join(lines))
    assert code == 1
    assert lines[-1] == (
        "rlfeed serve: the scheduler actor is gone (ActorDiedError) and without [journal] dir "
        "it cannot come back with its state; stopping"
    )
    assert "Traceback" not in errors.read_text()
    assert len(lines) <= 10  # Ray's start-up notes, the watch's warning, the message
    assert seconds < 20  # the watch waits 5 s to be sure the actor is not coming back
