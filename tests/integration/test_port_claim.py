"""Two sidecars on one port: with `--replicas` each binds it with SO_REUSEPORT, which the
kernel allows, so the check that the port is free (before Ray starts) is not enough when
both start within one Ray start-up. The first one claims the port; the second fails as
for any port in use. Real `rlfeed serve` processes, each on its own embedded Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import free_port


@pytest.mark.timeout(300)
def test_two_sidecars_with_replicas_started_together_on_one_port_one_refuses() -> None:
    """Both start within one Ray start-up, so both find the port free; with SO_REUSEPORT
    both could bind it and split the clients between two schedulers. Exactly one serves;
    the other fails as for any port in use (exit 1, one line naming the port), before its
    Ray starts (no Ray start-up record on its stderr). Once the first stops,
    the port is free for the next sidecar."""
    port = free_port()
    command = [sys.executable, "-m", "rlfeed", "serve", "--port", str(port), "--replicas", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RLFEED_ADDRESS", "RAY_ADDRESS")}
    env["PYTHONUNBUFFERED"] = "1"
    started = time.monotonic()
    sidecars = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        while all(sidecar.poll() is None for sidecar in sidecars):
            assert time.monotonic() - started < 120, "neither sidecar refused"
            time.sleep(0.05)
        (refused,) = [sidecar for sidecar in sidecars if sidecar.poll() is not None]
        (serving,) = [sidecar for sidecar in sidecars if sidecar is not refused]
        seconds = time.monotonic() - started
        stdout, stderr = refused.communicate()
        print(f"the second sidecar: exit {refused.returncode} after {seconds:.2f} s: {stderr}")
        assert refused.returncode == 1 and "Traceback" not in stderr, stderr
        expected = f"rlfeed serve: cannot listen on 127.0.0.1:{port}: the port is in use"
        assert len(stderr.splitlines()) == 1, stderr  # refused before its Ray started
        assert stderr.startswith(expected), stderr
        assert "listening on" not in stdout
        while "listening on" not in (line := serving.stdout.readline()):
            assert line, f"the first sidecar exited ({serving.wait()})"
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=60) == 0
        # Stopped, it let go of the port: the next sidecar on it serves.
        sidecars.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env,
                                         start_new_session=True))  # fmt: skip
        while "listening on" not in (line := sidecars[-1].stdout.readline()):
            assert line, f"the next sidecar exited ({sidecars[-1].wait()})"
        sidecars[-1].send_signal(signal.SIGTERM)
        assert sidecars[-1].wait(timeout=60) == 0
    finally:
        for sidecar in sidecars:
            if sidecar.poll() is None:
                os.killpg(sidecar.pid, signal.SIGKILL)
                sidecar.wait()
