"""The image and the one-machine deployment, checked as files (no Docker daemon here):
deploy/Dockerfile, .dockerignore, deploy/docker-compose.yml with its rlfeed.toml, Prometheus
and Grafana. Command lines are parsed by the real `rlfeed` parser; names, ports, paths and
the image agree across the files and with the KubeRay manifest."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import sys
from pathlib import Path

import ray
import yaml
from rlfeed.service.cli import build_parser
from rlfeed.service.config import load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _service(name: str) -> dict:
    return _compose()["services"][name]


def _bind_mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of the service's bind mounts (relative to the compose
    file's folder, as compose resolves them)."""
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (COMPOSE_FILE.parent / source).resolve()
    return mounts


def _named_volumes(service: dict) -> dict[str, str]:
    """container path -> volume name of the service's named volumes."""
    pairs = (volume.split(":")[:2] for volume in service["volumes"])
    return {target: source for source, target in pairs if not source.startswith((".", "/"))}


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile as (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def _one(instruction: str) -> str:
    (arguments,) = [a for i, a in _instructions() if i == instruction]
    return arguments


def _published(service: dict) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each of the service's published ports,
    from compose's short syntax "[HOST_IP:]HOST_PORT:CONTAINER_PORT"."""
    published = []
    for entry in service.get("ports", []):
        *address, host_port, container_port = str(entry).split(":")
        published.append((address[0] if address else "", int(host_port), int(container_port)))
    return published


def _compose_config():
    return load_config(_bind_mounts(_service("rlfeed"))["/etc/rlfeed/rlfeed.toml"])


def _parsed(tokens: list[str]):
    assert tokens[0] == "rlfeed", tokens
    return build_parser().parse_args(tokens[1:])


# ------------------------------------------------------------------ the sidecar service


def test_the_compose_sidecar_command_parses_and_its_paths_are_mounted() -> None:
    rlfeed = _service("rlfeed")
    args = _parsed(shlex.split(rlfeed["command"]))
    assert args.command == "serve"
    config_file = _bind_mounts(rlfeed)[args.config]
    assert config_file.is_file()
    assert args.journal_dir in _named_volumes(rlfeed)
    assert set(_named_volumes(rlfeed).values()) <= set(_compose()["volumes"])


def test_the_compose_config_binds_every_interface_and_the_published_ports() -> None:
    server = _compose_config().server
    # Every interface of the container: what docker publishes reaches the sidecar.
    assert server.host == "0.0.0.0" and server.metrics_host == "0.0.0.0"
    published = {container for _, _, container in _published(_service("rlfeed"))}
    assert published == {server.port, server.metrics_port}


def test_every_published_port_is_bound_to_the_hosts_loopback_only() -> None:
    """gRPC without TLS or tokens, /metrics, Prometheus and Grafana: none is reachable from
    another machine until someone decides so (the file's header says how, safely)."""
    services = _compose()["services"]
    ports = [(name, *port) for name, svc in services.items() for port in _published(svc)]
    assert {name for name, *_ in ports} == {"rlfeed", "prometheus", "grafana"}
    for name, address, host_port, container_port in ports:
        assert address == "127.0.0.1", f"{name} publishes {host_port} on {address or 'all'}"
        assert host_port == container_port  # localhost:PORT as the README and comments say
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    assert "TLS" in header and "tokens" in header and '"50051:50051"' in header


def test_grafana_has_no_default_admin_password() -> None:
    """Compose refuses to start without GRAFANA_ADMIN_PASSWORD (`${VAR:?message}`): no
    admin/admin, not even on loopback."""
    environment = _service("grafana")["environment"]
    password = environment["GF_SECURITY_ADMIN_PASSWORD"]
    match = re.fullmatch(r"\$\{(\w+):\?([^}]+)\}", password)
    assert match, password
    assert match.group(1) == "GRAFANA_ADMIN_PASSWORD" and match.group(1) in match.group(2)
    assert environment["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "admin" not in environment.values()
    assert f"export {match.group(1)}=" in COMPOSE_FILE.read_text()  # the header says so


def test_the_healthcheck_asks_the_grpc_health_service_of_the_sidecar() -> None:
    rlfeed = _service("rlfeed")
    test = rlfeed["healthcheck"]["test"]
    assert test[0] == "CMD"
    args = _parsed(test[1:])
    # grpc.health.v1 only: open without a token once [security] tokens are on (`rlfeed
    # status` is not); exits 0 only while SERVING (tests/integration/test_cli_health.py).
    assert args.command == "health"
    assert args.address == f"127.0.0.1:{_compose_config().server.port}"
    assert args.timeout < float(rlfeed["healthcheck"]["timeout"].removesuffix("s"))
    # A stop asked for is exit status 0 for rlfeed serve: on-failure restarts crashes only.
    assert rlfeed["stop_signal"] == "SIGTERM" and rlfeed["restart"] == "on-failure"


# ------------------------------------------------------------------ the image


def test_the_image_default_command_is_the_compose_command() -> None:
    command = json.loads(_one("CMD"))
    assert command == shlex.split(_service("rlfeed")["command"])
    args = _parsed(command)
    (copied,) = [a.split() for i, a in _instructions() if i == "COPY"]
    assert copied[-1] == args.config  # the image carries a default config there
    assert (ROOT / copied[-2]).is_file()


def test_the_dockerfile_installs_the_serve_extra_without_torch_and_exposes_the_ports() -> None:
    runs = [a for i, a in _instructions() if i == "RUN"]
    assert not [run for run in runs if "torch" in run]  # `rlfeed serve` never imports it
    (install,) = [run for run in runs if "rlfeed-src[" in run]
    extras = re.search(r"rlfeed-src\[([^\]]*)\]", install).group(1).split(",")
    assert "serve" in extras and not {"train", "all"} & set(extras)
    server = _compose_config().server
    assert {int(p) for p in _one("EXPOSE").split()} == {server.port, server.metrics_port}
    users = [a for i, a in _instructions() if i == "USER"]
    assert users[-1] not in ("root", "0")


def test_the_base_image_is_rays_own_at_the_installed_ray() -> None:
    base = _one("FROM")
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3(\d+)-cpu", base)
    assert match, base
    assert match.group(1) == ray.__version__
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert int(match.group(2)) >= int(requires.removeprefix(">=3."))


def test_one_image_everywhere_tagged_with_rlfeeds_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    built = re.search(r"docker build -f deploy/Dockerfile -t (\S+) \.", DOCKERFILE.read_text())
    assert built.group(1) == f"rlfeed:{version}"
    rlfeed = _service("rlfeed")
    assert rlfeed["image"] == built.group(1)
    assert (COMPOSE_FILE.parent / rlfeed["build"]["context"]).resolve() == ROOT
    assert ROOT / rlfeed["build"]["dockerfile"] == DOCKERFILE
    manifest = list(yaml.safe_load_all((DEPLOY / "ray/raycluster.yaml").read_text()))
    images = set(re.findall(r"\bimage: (\S+)", yaml.safe_dump_all(manifest)))
    assert {image.split("/", 1)[-1] for image in images} == {built.group(1)}


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops `path` (a pattern drops what it matches and all below)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for pattern in patterns:
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(prefix.rsplit("/")[-1], pattern[3:])
            ):
                return True
    return False


def test_dockerignore_drops_local_state_and_keeps_what_the_build_reads() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for local in (".venv/bin/python", ".git/HEAD", "service/__pycache__/config.cpython-311.pyc"):
        assert _ignored(local, patterns), local
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = {
        p.removeprefix("rlfeed").lstrip(".").replace(".", "/") or "."
        for p in project["tool"]["setuptools"]["packages"]
    }
    needed = ["pyproject.toml", project["project"]["readme"], "deploy/compose/rlfeed.toml"]
    # A module of every package folder (sched/ is a namespace portion: no __init__.py).
    needed += [str(min((ROOT / d).glob("*.py")).relative_to(ROOT)) for d in package_dirs]
    for path in needed:
        assert (ROOT / path).is_file(), path
        assert not _ignored(path, patterns), path


# ------------------------------------------------------------------ Prometheus and Grafana


def test_the_compose_prometheus_scrapes_the_sidecars_metrics_port() -> None:
    prometheus = _service("prometheus")
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    scrape_file = _bind_mounts(prometheus)[config_flag.split("=", 1)[1]]
    (job,) = yaml.safe_load(scrape_file.read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    (static,) = job["static_configs"]
    assert static["targets"] == [f"rlfeed:{_compose_config().server.metrics_port}"]


def test_grafana_gets_the_repositorys_provisioning_and_its_datasource_is_the_compose_one():
    grafana = _service("grafana")
    mounts = _bind_mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards/rlfeed.yaml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert dashboards == DEPLOY / "grafana" / "dashboards" and any(dashboards.glob("*.json"))
    (source,) = yaml.safe_load((provisioning / "datasources/rlfeed.yaml").read_text())[
        "datasources"
    ]
    # Grafana expands $VAR and ${VAR} in provisioning values from its environment.
    variables = set(re.findall(r"\$\{?(\w+)\}?", source["url"]))
    environment = grafana["environment"]
    assert variables <= set(environment)
    url = re.sub(r"\$\{?(\w+)\}?", lambda m: environment[m.group(1)], source["url"])
    ((_, _, prometheus_port),) = _published(_service("prometheus"))
    assert url == f"http://prometheus:{prometheus_port}"
    # The single `docker run` of deploy/grafana/README.md sets them too.
    readme = (DEPLOY / "grafana/README.md").read_text()
    assert all(f"-e {name}=" in readme for name in variables)


def test_the_images_journal_folder_is_owned_by_ray_and_private() -> None:
    """The named volume starts as a copy of it: the journal (training data) is 0700, as the
    folders rlfeed creates are (service/journal/files.py)."""
    (run,) = [a for i, a in _instructions() if i == "RUN" and "/journal" in a]
    steps = [step.strip() for step in run.split("&&")]
    assert "chown ray:users /journal" in steps and "chmod 0700 /journal" in steps
    assert _parsed(shlex.split(_service("rlfeed")["command"])).journal_dir == "/journal"
