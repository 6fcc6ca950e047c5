"""The KubeRay deploy files, checked as files (no Kubernetes here): what they tell the sidecar
must be what the sidecar understands, and the pieces they wire together must agree: the
head's `rlfeed serve` with the `frontends` worker group, the headless Service with the pods
KubeRay labels, the shared journal with the PVC, Prometheus' discovery with the metrics port.
Every Prometheus config under deploy/ must pass `promtool check config`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import ray
import yaml
from rlfeed.service.cli import build_parser
from rlfeed.service.cli.serve import _resolved_config
from rlfeed.service.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFEST = DEPLOY / "ray" / "raycluster.yaml"
POD_MONITOR = DEPLOY / "prometheus" / "podmonitor.yaml"
PVC = DEPLOY / "ray" / "journal-pvc.yaml"
KUBERNETES_SCRAPE = DEPLOY / "prometheus" / "kubernetes.yml"
YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])


def _documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def _cluster() -> dict:
    return _documents()["RayCluster"]


def _head_containers() -> dict[str, dict]:
    pod = _cluster()["spec"]["headGroupSpec"]["template"]["spec"]
    return {container["name"]: container for container in pod["containers"]}


def _frontends_group() -> dict:
    (group,) = (g for g in _cluster()["spec"]["workerGroupSpecs"] if g["groupName"] == "frontends")
    return group


def _worker_container() -> dict:
    (container,) = _frontends_group()["template"]["spec"]["containers"]
    return container


def _security_sync_container() -> dict:
    (container,) = _frontends_group()["template"]["spec"]["initContainers"]
    return container


def _kubernetes_expanded(text: str) -> str:
    """What the kubelet passes for a command or args entry: `$(VAR)` references aside
    (none here), `$$` becomes `$`."""
    return text.replace("$$", "$")


def _all_containers() -> list[dict]:
    return [*_head_containers().values(), _worker_container()]


def _mounts(container: dict) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


def _custom_resources(group: dict) -> dict[str, float]:
    """`rayStartParams.resources` as Ray reads it: KubeRay passes the string to `ray start
    --resources=...` through a shell, hence the extra quotes around the JSON."""
    text = group["rayStartParams"].get("resources")
    if text is None:
        return {}
    assert text[0] == text[-1] == '"', f"KubeRay wants the JSON quoted: {text!r}"
    return json.loads(text[1:-1].replace('\\"', '"'))


def _pod_labels(group_name: str, node_type: str) -> dict[str, str]:
    """The labels KubeRay puts on a pod of this cluster (ray.io/cluster, ray.io/group,
    ray.io/node-type: its utils.RayClusterLabelKey, RayNodeGroupLabelKey, RayNodeTypeLabelKey;
    the head's group is "headgroup")."""
    return {
        "ray.io/cluster": _cluster()["metadata"]["name"],
        "ray.io/group": group_name,
        "ray.io/node-type": node_type,
    }


def _configmap_text() -> str:
    return _documents()["ConfigMap"]["data"]["rlfeed.toml"]


def _serve_command() -> list[str]:
    """The head's `rlfeed serve ...` tokens, from its shell script (after `exec`)."""
    script = _head_containers()["rlfeed"]["args"][0]
    command = shlex.split(script.split("exec ", 1)[1])
    assert command[:2] == ["rlfeed", "serve"], command
    return command


def _resolved_serve(tmp_path: Path):
    """The parsed arguments and the config `rlfeed serve` would run with: the real parser, the
    real merge of flags into the ConfigMap's file (written where the test can read it)."""
    args = build_parser().parse_args(_serve_command()[1:])
    mounted_config = Path(args.config)
    config_file = tmp_path / "rlfeed.toml"
    config_file.write_text(_configmap_text())
    args.config = str(config_file)
    return args, mounted_config, _resolved_config(args)


# ------------------------------------------------------------------ every file


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_under_deploy_parses(path: Path) -> None:
    documents = list(yaml.safe_load_all(path.read_text()))
    assert documents and all(isinstance(doc, dict) for doc in documents)


def _prometheus_configs() -> list[Path]:
    """Every file under deploy/ that is a Prometheus config (a single document with jobs)."""
    configs = []
    for path in YAML_FILES:
        documents = list(yaml.safe_load_all(path.read_text()))
        if len(documents) == 1 and "scrape_configs" in documents[0]:
            configs.append(path)
    return configs


def _promtool() -> str:
    path = shutil.which("promtool") or (
        "/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None
    )
    if path is None:
        reason = "promtool is not installed (Debian package `prometheus`)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must install it (make system-deps)")
        pytest.skip(reason)
    return path


def _promtool_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )


def test_the_prometheus_configs_are_the_three_deployments() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in _prometheus_configs()}
    assert names == {
        "prometheus/prometheus.yml",
        "prometheus/kubernetes.yml",
        "compose/prometheus.yml",
    }


@pytest.mark.parametrize("path", _prometheus_configs(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_prometheus_config_passes_promtool(path: Path) -> None:
    result = _promtool_check(path)
    if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        pytest.skip(
            "this promtool is built without Kubernetes discovery (Debian's is); "
            "test_the_kubernetes_job_passes_promtool_with_a_static_target checks the rest"
        )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_kubernetes_job_passes_promtool_with_a_static_target(tmp_path) -> None:
    config = yaml.safe_load(KUBERNETES_SCRAPE.read_text())
    (job,) = config["scrape_configs"]
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["10.0.0.1:9400"]}]
    copy = tmp_path / "kubernetes-static.yml"
    copy.write_text(yaml.safe_dump(config))
    result = _promtool_check(copy)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ the head and the group


def test_the_embedded_config_loads_and_binds_every_interface(tmp_path) -> None:
    config_file = tmp_path / "rlfeed.toml"
    config_file.write_text(_configmap_text())
    config = load_config(config_file)  # unknown keys would raise
    assert config.server.host == "0.0.0.0" and config.server.metrics_host == "0.0.0.0"
    assert config.frontends.ports == "same"  # one port for the headless Service


def test_the_head_runs_the_scheduler_and_one_frontend_per_worker_pod(tmp_path) -> None:
    args, mounted_config, config = _resolved_serve(tmp_path)
    assert args.ray_address == "auto"  # the head's Ray, through the shared /tmp/ray
    assert _mounts(_head_containers()["rlfeed"])["ray-tmp"] == "/tmp/ray"
    assert _mounts(_head_containers()["ray-head"])["ray-tmp"] == "/tmp/ray"
    assert mounted_config.parent == Path(_mounts(_head_containers()["rlfeed"])["rlfeed-config"])
    group = _frontends_group()
    assert config.frontends.count == group["replicas"] == group["minReplicas"]
    assert group["maxReplicas"] == group["replicas"]
    assert _custom_resources(group) == {config.frontends.resource: 1}
    head = _cluster()["spec"]["headGroupSpec"]
    assert config.frontends.resource not in _custom_resources(head)


def test_the_journal_is_one_shared_volume_at_the_same_path_everywhere(tmp_path) -> None:
    _, _, config = _resolved_serve(tmp_path)
    assert config.journal.dir
    for container in _all_containers():
        assert _mounts(container)["journal"] == config.journal.dir, container["name"]
    (pvc,) = yaml.safe_load_all(PVC.read_text())
    assert pvc["kind"] == "PersistentVolumeClaim"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # front-ends move between pods
    pods = [_cluster()["spec"]["headGroupSpec"], _frontends_group()]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["template"]["spec"]["volumes"]}
        assert volumes["journal"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_security_files_are_mounted_wherever_a_frontend_runs(tmp_path) -> None:
    """The ConfigMap's commented [security] example, switched on, loads, and its paths lie in
    the Secret's mount in every container (a front-end may run on any worker pod; the head's
    `rlfeed serve` resolves the same config)."""
    commented = re.findall(r"^# (\[security\]|\w+ = .*)$", _configmap_text(), flags=re.M)
    assert commented[0] == "[security]"
    config_file = tmp_path / "rlfeed.toml"
    config_file.write_text(_configmap_text() + "\n".join(commented) + "\n")
    security = load_config(config_file).security
    paths = [security.tls_cert, security.tls_key, security.auth_token_file]
    assert all(paths)
    for container in [*_all_containers(), _security_sync_container()]:
        private_dir = Path(_mounts(container)["security-private"])
        assert all(Path(path).parent == private_dir for path in paths), container["name"]
        assert _mounts(container)["security"] != str(private_dir)


def _pod_volumes() -> list[dict[str, dict]]:
    pods = [_cluster()["spec"]["headGroupSpec"], _frontends_group()]
    return [{v["name"]: v for v in pod["template"]["spec"]["volumes"]} for pod in pods]


def test_the_secret_is_0400_and_rlfeed_reads_0600_copies_in_memory():
    """defaultMode 0400 alone is not enough: under the pods' fsGroup the kubelet adds group
    read (kubernetes/kubernetes#57923), so [security] reads copies the script makes."""
    for volumes in _pod_volumes():
        secret = volumes["security"]["secret"]
        assert secret["secretName"] == "rlfeed-security" and secret["optional"] is True
        assert secret["defaultMode"] == 0o400
        assert volumes["security-private"]["emptyDir"] == {"medium": "Memory"}
    script = _documents()["ConfigMap"]["data"]["sync-security.sh"]
    assert "install -m 0600" in script
    for container in [*_all_containers(), _security_sync_container()]:
        mounts = _mounts(container)
        assert mounts["security"] == "/etc/rlfeed/security"
        assert mounts["security-private"] == "/etc/rlfeed/private"
        assert mounts["rlfeed-config"] == "/etc/rlfeed/config"  # where the script lies


def test_the_head_watches_the_secret_and_signals_rlfeed_serve_itself():
    """The watcher gets the shell's PID, which `exec` hands to rlfeed serve: the SIGHUP
    that rotates tokens (and which rlfeed serve passes on to every front-end actor)."""
    script = _kubernetes_expanded(_head_containers()["rlfeed"]["args"][0])
    once = script.index("sync-security.sh once || exit 1;")
    watch = script.index("sync-security.sh watch $$ &")
    assert once < watch < script.index("exec rlfeed serve")


def test_each_frontend_pod_runs_the_sync_as_a_native_sidecar_before_ray():
    sync = _security_sync_container()
    assert sync["restartPolicy"] == "Always"  # a sidecar: runs beside the Ray container
    assert sync["image"] == _worker_container()["image"]
    assert sync["command"] == ["bash", "/etc/rlfeed/config/sync-security.sh", "watch"]
    # Started (so the Ray container and its front-end start) only once the copies exist.
    probe = sync["startupProbe"]["exec"]["command"]
    assert probe == ["test", "-e", "/etc/rlfeed/private/.synced"]
    script = _documents()["ConfigMap"]["data"]["sync-security.sh"]
    assert 'touch "$dst/.synced"' in script


# ------------------------------------------------------------------ the Service


def test_the_headless_service_selects_the_frontend_pods_on_the_grpc_port(tmp_path) -> None:
    _, _, config = _resolved_serve(tmp_path)
    service = _documents()["Service"]
    assert service["metadata"]["name"] == "rlfeed-frontends"
    assert service["spec"]["clusterIP"] == "None"  # one DNS record per pod: client balancing
    selector = service["spec"]["selector"].items()
    assert selector <= _pod_labels("frontends", "worker").items()
    assert not selector <= _pod_labels("headgroup", "head").items()
    container = _worker_container()
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": config.server.port, "metrics": config.server.metrics_port}
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for name, expected in ports.items():
        target = service_ports[name]["targetPort"]
        assert ports.get(target, target) == expected and service_ports[name]["port"] == expected
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[0] == "rlfeed"
    args = build_parser().parse_args(probe[1:])
    # grpc.health.v1 only: no token needed with [security] tokens on, TLS through RLFEED_TLS_*.
    assert args.command == "health"
    assert args.address == f"127.0.0.1:{config.server.port}"
    assert args.timeout < container["readinessProbe"]["timeoutSeconds"]


def test_every_container_shares_the_image_ray_version_and_the_cluster_token() -> None:
    containers = _all_containers()
    assert len({c["image"] for c in containers}) == 1
    assert _cluster()["spec"]["rayVersion"] == ray.__version__
    envs = [{e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]} for c in containers]
    assert all(env == envs[0] for env in envs)
    assert envs[0]["RAY_AUTH_MODE"] == "token"
    assert envs[0]["RAY_AUTH_TOKEN"]["secretKeyRef"]["name"] == "rlfeed-ray-token"


# ------------------------------------------------------------------ Prometheus discovery


def _relabelled(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling (`keep`, `drop`, `replace`) of one discovered target; None when
    dropped. Regexes are anchored at both ends, as Prometheus anchors them."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        value = rule.get("separator", ";").join(
            labels.get(s, "") for s in rule.get("source_labels", [])
        )
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        assert action in ("keep", "drop", "replace"), action
        if (action == "keep" and match is None) or (action == "drop" and match is not None):
            return None
        if action == "replace" and match is not None:
            replacement = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule.get("replacement", "$1"))
            labels[rule["target_label"]] = match.expand(replacement)
    return labels


def _discovered_targets(cluster_name: str) -> list[dict[str, str]]:
    """What Kubernetes pod discovery finds for the manifest's pods: one target per container
    port, with the pod's labels (sanitised: ray.io/group -> ray_io_group)."""
    pods = [("headgroup", "head", _head_containers().values())]
    pods += [("frontends", "worker", [_worker_container()])]
    # Another worker group with a port named metrics (e.g. trainers added to the cluster).
    pods += [("other-workers", "worker", [_worker_container()])]
    targets = []
    for number, (group, node_type, containers) in enumerate(pods):
        labels = {**_pod_labels(group, node_type), "ray.io/cluster": cluster_name}
        meta = {
            f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v
            for k, v in labels.items()
        }
        meta |= {
            "__meta_kubernetes_namespace": "rl",
            "__meta_kubernetes_pod_name": f"{cluster_name}-{group}-{number}",
            "__meta_kubernetes_pod_node_name": f"node-{number}",
            "__meta_kubernetes_pod_phase": "Running",
        }
        for container in containers:
            for port in container.get("ports", []):
                address = f"10.0.0.{number}:{port['containerPort']}"
                name = {"__meta_kubernetes_pod_container_port_name": port.get("name", "")}
                targets.append({**meta, **name, "__address__": address})
    return targets


def test_the_kubernetes_job_scrapes_exactly_each_frontends_metrics_port(tmp_path) -> None:
    _, _, config = _resolved_serve(tmp_path)
    (job,) = yaml.safe_load(KUBERNETES_SCRAPE.read_text())["scrape_configs"]
    assert [sd["role"] for sd in job["kubernetes_sd_configs"]] == ["pod"]
    assert job["metrics_path"] == "/metrics"
    discovered = _discovered_targets(_cluster()["metadata"]["name"])
    discovered += _discovered_targets("another-cluster")
    kept = [t for t in (_relabelled(d, job["relabel_configs"]) for d in discovered) if t]
    (target,) = kept
    assert target["__address__"].endswith(f":{config.server.metrics_port}")
    assert target["pod"] == f"{_cluster()['metadata']['name']}-frontends-1"
    assert target["node"] == "node-1" and target["namespace"] == "rl"


# ------------------------------------------------------------------ prometheus-operator


def test_the_pod_monitor_scrapes_exactly_each_frontends_metrics_port(tmp_path) -> None:
    _, _, config = _resolved_serve(tmp_path)
    (monitor,) = yaml.safe_load_all(POD_MONITOR.read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "PodMonitor"
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    assert selector <= _pod_labels("frontends", "worker").items()
    assert not selector <= _pod_labels("headgroup", "head").items()
    assert not selector <= _pod_labels("other-workers", "worker").items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {port["name"]: port["containerPort"] for port in _worker_container()["ports"]}
    assert ports[endpoint["port"]] == config.server.metrics_port
    assert endpoint["path"] == "/metrics"
    # The same extra labels as the plain Prometheus job of kubernetes.yml.
    (job,) = yaml.safe_load(KUBERNETES_SCRAPE.read_text())["scrape_configs"]
    extra = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    added = {r["targetLabel"] for r in endpoint["relabelings"]}
    assert added == extra - {"namespace", "pod"}  # the operator adds those two itself
