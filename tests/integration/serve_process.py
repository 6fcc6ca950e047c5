"""`rlfeed serve --journal-dir` as a process the tests stop and start again: in a process
group of its own, on one port and one journal, with its output in a log file.

Loaded by path (`importlib`) by the crash-loop and restart tests, as `exactly_once.py` is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from helpers import free_port
from rlfeed.proto import rlfeed_pb2 as pb
from rlfeed.proto import rlfeed_pb2_grpc as pb_grpc


class ServeProcess:
    """`rlfeed serve` in a process group of its own, restartable on one port and journal."""

    def __init__(self, workdir: Path, *flags: str, config: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.flags = flags  # more `rlfeed serve` flags (`--replicas 2`)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = workdir / "rlfeed.toml"
        self.config.write_text(config)
        self.journal = workdir / "journal"
        self.log_path = workdir / "serve.log"
        self.log = self.log_path.open("ab")
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 120.0) -> None:
        command = [
            sys.executable, "-m", "rlfeed", "serve", "--config", str(self.config),
            "--port", str(self.port), "--journal-dir", str(self.journal), *self.flags,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            status = pb_grpc.SidecarStatusStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise AssertionError(
                        f"rlfeed serve exited {self.process.returncode}: "
                        f"{self.log_path.read_text()[-2000:]}"
                    )
                try:
                    status.GetStatus(pb.GetStatusRequest(), timeout=1)
                    return
                except grpc.RpcError:
                    time.sleep(0.2)
        raise AssertionError(f"rlfeed serve did not answer within {timeout_s} s")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as `docker stop` or `kill` send it: the exit status once it stopped."""
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout_s)
        self._wait_for_group()
        return code

    def kill(self) -> None:
        """SIGKILL to the whole group: no handler runs, nothing is flushed or handed over."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._wait_for_group()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
        self.log.close()

    def _wait_for_group(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and group_alive(self.process.pid):
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
