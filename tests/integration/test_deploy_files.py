"""The KubeRay manifest, checked as files (no Kubernetes here): what it tells the sidecar
must be what the sidecar understands, and the pieces it wires together must agree."""

from __future__ import annotations

import shlex
from pathlib import Path

import ray
import yaml
from rlfeed.service.cli import build_parser
from rlfeed.service.config import load_config

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "raycluster.yaml"


def _documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def _head_containers() -> dict[str, dict]:
    pod = _documents()["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]
    return {container["name"]: container for container in pod["containers"]}


def _serve_arguments() -> list[str]:
    script = _head_containers()["rlfeed"]["args"][0]
    command = shlex.split(script.split("exec ", 1)[1])
    assert command[:2] == ["rlfeed", "serve"], command
    return command[1:]


def test_the_embedded_config_loads_and_the_sidecar_command_parses(tmp_path) -> None:
    config_file = tmp_path / "rlfeed.toml"
    config_file.write_text(_documents()["ConfigMap"]["data"]["rlfeed.toml"])
    config = load_config(config_file)  # unknown keys would raise
    args = build_parser().parse_args(_serve_arguments())
    assert args.ray_address == "auto"
    mounts = {m["name"]: m["mountPath"] for m in _head_containers()["rlfeed"]["volumeMounts"]}
    assert Path(args.config).parent == Path(mounts["rlfeed-config"])
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"


def test_ports_probe_and_service_agree_with_the_config(tmp_path) -> None:
    config_file = tmp_path / "rlfeed.toml"
    config_file.write_text(_documents()["ConfigMap"]["data"]["rlfeed.toml"])
    server = load_config(config_file).server
    sidecar = _head_containers()["rlfeed"]
    ports = {port["name"]: port["containerPort"] for port in sidecar["ports"]}
    assert ports == {"grpc": server.port, "metrics": server.metrics_port}
    assert sidecar["readinessProbe"]["grpc"]["port"] == server.port
    service = {p["name"]: p["targetPort"] for p in _documents()["Service"]["spec"]["ports"]}
    assert service == ports


def test_both_containers_share_image_ray_files_and_the_cluster_token() -> None:
    containers = _head_containers()
    head, sidecar = containers["ray-head"], containers["rlfeed"]
    assert head["image"] == sidecar["image"]
    assert _documents()["RayCluster"]["spec"]["rayVersion"] == ray.__version__
    ray_tmp = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (head, sidecar)]
    assert ray_tmp[0]["ray-tmp"] == ray_tmp[1]["ray-tmp"] == "/tmp/ray"
    envs = [
        {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]} for c in (head, sidecar)
    ]
    assert envs[0] == envs[1]
    assert envs[0]["RAY_AUTH_MODE"] == "token"
    assert envs[0]["RAY_AUTH_TOKEN"]["secretKeyRef"]["name"] == "rlfeed-ray-token"
