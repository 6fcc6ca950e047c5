"""What each install brings: `pip install rlfeed` on an inference node (the core: no Ray, no
torch, the lowest grpcio/protobuf/numpy/pyarrow pyproject.toml allows) runs the README's
producer against a real sidecar; `rlfeed serve` there says which extra it needs; and
`rlfeed serve` itself never imports torch (the image installs `rlfeed[serve]` only).

The floor venv is made once (kept in pytest's cache, see `tests/scratch_venv.py`) from the
floors read off pyproject.toml, so a raised floor, or a heavy package added to the core, is
what this test installs and sees. rlfeed itself is installed afresh each run, from a copy
of this checkout, with those floors as constraints. The same example runs on the newest
versions in .venv in `test_readme_examples.py`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("scratch_venv", ROOT / "tests" / "scratch_venv.py")
scratch_venv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scratch_venv)
_spec = importlib.util.spec_from_file_location(
    "readme_examples", ROOT / "tests" / "integration" / "test_readme_examples.py"
)
readme_examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_examples)

# What the core must never pull in: the sidecar's and the trainer's libraries.
HEAVY = ("torch", "ray", "prometheus_client", "msgpack", "grpc_health")
# The package copied into the build (the rest of the checkout is not rlfeed's).
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE", "py.typed", "__init__.py", "__main__.py")
PACKAGE_DIRS = ("sched", "service", "client", "proto")


def core_floors() -> dict[str, str]:
    """Each core dependency of pyproject.toml -> the version its `>=` floor names."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(lower) == 1, f"core dependency {line!r} needs one >= floor to be tested"
        floors[requirement.name] = lower[0]
    return floors


@pytest.fixture(scope="module")
def floor_venv(request, tmp_path_factory) -> Path:
    """The bin/ of a venv with the core floors and rlfeed (no extras) installed."""
    floors = core_floors()
    pins = [f"{name}=={version}" for name, version in sorted(floors.items())]
    python = scratch_venv.scratch_venv(
        request.config.cache.mkdir("scratch-venvs"), [*pins, "setuptools>=68", "wheel"]
    )
    work = tmp_path_factory.mktemp("rlfeed-install")
    source = work / "rlfeed"
    source.mkdir()
    for name in PACKAGE_FILES:
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PACKAGE_DIRS:
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    constraints = work / "floors.txt"
    constraints.write_text("\n".join(pins) + "\n")
    scratch_venv.pip(python, "uninstall", "--yes", "rlfeed")
    scratch_venv.pip(
        python, "install", "--no-build-isolation", "--constraint", str(constraints), str(source)
    )
    return python.parent


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)


def test_the_core_install_has_the_floors_and_no_sidecar_or_trainer_library(floor_venv):
    floors = core_floors()
    assert set(floors) == {"numpy", "pyarrow", "grpcio", "protobuf"}
    versions = _run(
        [
            str(floor_venv / "python"),
            "-c",
            "import importlib.metadata as m, sys; "
            "print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))",
            *sorted(floors),
        ]
    )
    installed = dict(pin.split("==") for pin in versions.stdout.split())
    assert {n: Version(v) for n, v in installed.items()} == {
        n: Version(v) for n, v in floors.items()
    }
    for module in HEAVY:
        probe = _run([str(floor_venv / "python"), "-c", f"import {module}"])
        assert probe.returncode != 0, f"{module} is importable in the producer-only install"
        assert f"No module named '{module.split('.')[0]}'" in probe.stderr


def test_the_readme_producer_runs_on_the_floors_against_a_real_sidecar(
    floor_venv, make_sidecar, tmp_path
):
    sidecar = make_sidecar(
        batching={"token_budget": 1024, "world_size": 1},
        rollouts={"prompts_per_step": 8, "group_size": 8, "vocab_size": 1000},
    )
    script = tmp_path / "producer.py"
    script.write_text(
        readme_examples.example("producer-example")
        + "import sys\nprint(*sorted(m for m in sys.modules if m.split('.')[0] in sys.argv[1:]))\n"
    )
    run = _run(
        [str(floor_venv / "python"), str(script), *HEAVY],
        cwd=tmp_path,
        env={**os.environ, "RLFEED_ADDRESS": sidecar.address},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == ""  # it loaded none of the heavy libraries
    from rlfeed.client.transport import GrpcTransport

    transport = GrpcTransport(sidecar.address)
    try:
        status = transport.status()
    finally:
        transport.close()
    assert status.counters.rollouts_accepted == 2 * 8 * 8  # 2 rounds x 8 tasks x 8 attempts
    assert status.next_step == 2


def test_serve_without_the_serve_extra_says_what_to_install(floor_venv):
    started = time.monotonic()
    run = _run([str(floor_venv / "rlfeed"), "serve", "--port", "0"])
    assert time.monotonic() - started < 30
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        "rlfeed serve: this install lacks crc32c, grpc_health, grpc_reflection, msgpack, "
        "prometheus_client, ray: pip install 'rlfeed[serve]'"
    ]


def test_serve_runs_without_torch(tmp_path):
    """`rlfeed serve` with torch made unimportable (as in the image, which installs
    `rlfeed[serve]` only): it listens, and a SIGTERM stops it cleanly."""
    config = tmp_path / "sidecar.toml"
    config.write_text('[ray]\nactor_name = "no-torch"\n')
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
        "from rlfeed.service.cli import main\n"
        f"sys.exit(main(['serve', '--config', {str(config)!r}, '--port', '0']))\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        listening = False
        while not listening and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                break
            listening = line.startswith("rlfeed serve: listening on ")
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert listening, f"rlfeed serve did not start without torch:\n{stderr[-3000:]}"
    assert server.returncode == 0, stderr[-3000:]
