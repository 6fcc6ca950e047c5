"""The KubeRay manifest's `sync-security.sh`, run for real by bash on a folder laid out as the
kubelet lays out a mounted Secret (`..data` -> a timestamped folder, each key a link into
it, files group-readable as fsGroup leaves them), and rotated as the kubelet rotates it (a
new folder, `..data` swapped in one rename): the private copies are 0600 with the new
content, and the PID it watches for gets SIGHUP at once and once more after the settle
time; with a real `rlfeed serve`, that SIGHUP is the token rotation."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import serve_in_background, stop_serve
from rlfeed.client.transport import AuthenticationError, GrpcTransport

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "raycluster.yaml"


def _script(tmp_path: Path) -> Path:
    (configmap,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "ConfigMap"]
    path = tmp_path / "sync-security.sh"
    path.write_text(configmap["data"]["sync-security.sh"])
    return path


def _publish(secret: Path, files: dict[str, str], version: int) -> None:
    """Write the Secret's data as the kubelet's AtomicWriter does."""
    data = secret / f"..2026_01_01_00_00_0{version}.000"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
        (data / name).chmod(0o440)  # defaultMode 0400 plus fsGroup's group read
    link = secret / "..data_tmp"
    link.symlink_to(data.name)
    os.replace(link, secret / "..data")
    for name in files:
        if not (secret / name).is_symlink():
            (secret / name).symlink_to(f"..data/{name}")


@pytest.fixture
def secret_dirs(tmp_path):
    secret, private = tmp_path / "security", tmp_path / "private"
    secret.mkdir()
    private.mkdir()
    env = {
        **os.environ,
        "RLFEED_SECURITY_SECRET_DIR": str(secret),
        "RLFEED_SECURITY_PRIVATE_DIR": str(private),
        "RLFEED_SECURITY_POLL_S": "0.2",
        "RLFEED_SECURITY_SETTLE_S": "2",
    }
    return secret, private, env


@pytest.fixture
def watcher(tmp_path, secret_dirs):
    """Start `sync-security.sh watch PID` (stopped at the end)."""
    started = []

    def start(pid: int) -> subprocess.Popen:
        process = subprocess.Popen(
            ["bash", str(_script(tmp_path)), "watch", str(pid)],
            env=secret_dirs[2],
            stderr=subprocess.DEVNULL,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=10)


def _private_files(private: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (p.read_text(), stat.S_IMODE(p.stat().st_mode))
        for p in private.iterdir()
        if not p.name.startswith(".")
    }


def test_once_copies_each_key_0600_and_marks_the_folder_synced(tmp_path, secret_dirs):
    secret, private, env = secret_dirs
    _publish(secret, {"tokens": "t1 admin\n", "tls.key": "KEY\n"}, version=1)
    subprocess.run(["bash", str(_script(tmp_path)), "once"], env=env, check=True, timeout=30)
    assert _private_files(private) == {"tokens": ("t1 admin\n", 0o600), "tls.key": ("KEY\n", 0o600)}
    assert (private / ".synced").exists()
    assert sorted(p.name for p in private.iterdir()) == [".synced", "tls.key", "tokens"]


def test_once_with_no_secret_mounted_still_marks_the_folder_synced(tmp_path, secret_dirs):
    _, private, env = secret_dirs  # `optional: true` and no Secret: an empty mount
    subprocess.run(["bash", str(_script(tmp_path)), "once"], env=env, check=True, timeout=30)
    assert [p.name for p in private.iterdir()] == [".synced"]


def test_a_rotation_is_copied_and_signalled_at_once_and_after_the_settle_time(secret_dirs, watcher):
    secret, private, _ = secret_dirs
    _publish(secret, {"tokens": "t1 admin\n"}, version=1)
    counter = subprocess.Popen(
        [sys.executable, "-u", "-c",
         "import signal, time\n"
         "signal.signal(signal.SIGHUP, lambda *a: print(round(time.monotonic(), 2)))\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        watcher(counter.pid)
        deadline = time.monotonic() + 15
        while "tokens" not in _private_files(private):
            assert time.monotonic() < deadline, "no first copy"
            time.sleep(0.1)
        time.sleep(1.0)  # several polls with no change: no signal
        _publish(secret, {"tokens": "t2 admin\n"}, version=2)
        rotated = time.monotonic()
        first = float(counter.stdout.readline())
        assert _private_files(private) == {"tokens": ("t2 admin\n", 0o600)}
        second = float(counter.stdout.readline())
        assert first - rotated < 5
        assert 0.9 < second - first < 6  # RLFEED_SECURITY_SETTLE_S = 2, in whole seconds
    finally:
        counter.kill()
        counter.wait()


def test_a_rotated_secret_reaches_a_running_rlfeed_serve(tmp_path, secret_dirs, watcher):
    """The chain the head pod runs: Secret -> private copy -> SIGHUP -> rlfeed serve re-reads
    `auth_token_file`: the old token is refused, the new one works, no restart."""
    secret, private, env = secret_dirs
    old, new = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    _publish(secret, {"tokens": f"{old} admin\n"}, version=1)
    subprocess.run(["bash", str(_script(tmp_path)), "once"], env=env, check=True, timeout=30)
    config = tmp_path / "sidecar.toml"
    config.write_text(
        '[batching]\ntoken_budget = 2048\n[ray]\nactor_name = "sync-security"\n'
        "[rollouts]\nprompts_per_step = 2\ngroup_size = 2\nvocab_size = 512\n"
    )
    server, address, _ = serve_in_background(
        "--config", str(config), "--auth-token-file", str(private / "tokens")
    )
    try:
        assert GrpcTransport(address, token=old, call_timeout_s=10).status() is not None
        (private / ".synced").unlink()
        watcher(server.pid)
        deadline = time.monotonic() + 15
        while not (private / ".synced").exists():  # its first copy: it now compares
            assert time.monotonic() < deadline, "the watcher made no first copy"
            time.sleep(0.1)
        _publish(secret, {"tokens": f"{new} admin\n"}, version=2)
        deadline = time.monotonic() + 20
        while True:
            try:
                GrpcTransport(address, token=old, call_timeout_s=5).status()
            except AuthenticationError as refused:
                assert refused.code == "UNAUTHENTICATED"
                break
            assert time.monotonic() < deadline, "the old token still works after rotation"
            time.sleep(0.2)
        assert GrpcTransport(address, token=new, call_timeout_s=10).status() is not None
        assert server.poll() is None
    finally:
        stop_serve(server)
