"""The import rules that keep the layers apart, checked on every run.

- `proto/` (the wire contract and its framing) imports no other rlfeed layer;
- `sched/` imports only `sched/`, and no torch, Ray, gRPC or pyarrow;
- `client/` imports nothing from `service/` (trainers never import server internals);
- the scheduler's state class imports no Ray, gRPC, pyarrow or torch;
- no import cycle between rlfeed modules, counting imports inside functions and under
  TYPE_CHECKING (a cycle there is still two modules that cannot be read apart);
- between folders, only the arrows `FOLDER_ARROWS` lists, and those form no cycle: no two
  folders import each other, even through a third;
- `service/inprocess.py`, the sidecar without gRPC or Ray, loads neither.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("client", "proto", "sched", "service")
HEAVY = ("torch", "ray", "grpc", "pyarrow")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("rlfeed", *parts))


def _source_modules() -> dict[str, Path]:
    modules = {}
    for directory in SOURCE_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                modules[_module_name(path)] = path
    return modules


def _imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports, at any depth (lazy and TYPE_CHECKING included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _rlfeed_edges() -> dict[str, set[str]]:
    """module -> the rlfeed source modules it imports."""
    modules = _source_modules()
    return {
        module: {name for name in _imports(path, module) if name in modules and name != module}
        for module, path in modules.items()
    }


def _layer(module: str) -> str:
    return module.split(".")[1]


def _violations(edges: dict[str, set[str]], importer: str, forbidden: tuple[str, ...]) -> list:
    return sorted(
        (module, target)
        for module, targets in edges.items()
        if _layer(module) == importer
        for target in targets
        if _layer(target) in forbidden
    )


def test_client_imports_nothing_from_service():
    assert _violations(_rlfeed_edges(), "client", ("service",)) == []


def test_proto_imports_no_other_layer():
    assert _violations(_rlfeed_edges(), "proto", ("client", "sched", "service")) == []


def test_sched_imports_only_sched():
    assert _violations(_rlfeed_edges(), "sched", ("client", "proto", "service")) == []


def test_the_rules_see_an_added_import(tmp_path):
    """The check itself can fail: a client module importing the service is caught."""
    path = ROOT / "client" / "loader.py"
    edges = _rlfeed_edges()
    imports = _imports(
        _with_line(path, tmp_path, "from rlfeed.service.config import SidecarConfig"),
        "rlfeed.client.loader",
    )
    edges["rlfeed.client.loader"] |= {name for name in imports if name in edges}
    assert ("rlfeed.client.loader", "rlfeed.service.config") in _violations(
        edges, "client", ("service",)
    )


def _with_line(path: Path, tmp_path: Path, line: str) -> Path:
    copy = tmp_path / path.name
    copy.write_text(path.read_text() + f"\n{line}\n")
    return copy


# Which folder may import which: every arrow between two folders (a top-level module of
# `service/` counts as a folder of its own). A new arrow is a design decision: add it here.
FOLDER_ARROWS: dict[str, set[str]] = {
    "proto": set(),
    "sched": set(),
    "client": {"proto"},
    "service/config": {"client", "sched"},
    "service/errors.py": set(),
    "service/interrupts.py": set(),
    "service/journal": {"service/config"},
    "service/security": {"client", "proto", "service/config"},
    "service/scheduler": {"sched", "service/config", "service/errors.py", "service/journal"},
    "service/codec": {
        "proto",
        "sched",
        "service/config",
        "service/errors.py",
        "service/scheduler",
    },
    "service/frontend": {
        "client",
        "proto",
        "sched",
        "service/codec",
        "service/config",
        "service/errors.py",
        "service/journal",
        "service/scheduler",
        "service/security",
    },
    "service/metrics": {
        "proto",
        "sched",
        "service/codec",
        "service/config",
        "service/errors.py",
        "service/frontend",
        "service/scheduler",
    },
    # client: its allocator settings, given to front-end actors as environment variables.
    "service/scaleout": {
        "client",
        "service/config",
        "service/frontend",
        "service/metrics",
        "service/scheduler",
    },
    "service/gym": set(),
    # The curriculum experiment starts a sidecar of its own per run.
    "service/learning": {"client", "service/config", "service/frontend", "service/gym"},
    "service/demo": {
        "client",
        "sched",
        "service/config",
        "service/frontend",
        "service/gym",
        "service/learning",
        "service/metrics",
    },
    "service/cli": {
        "client",
        "proto",
        "sched",
        "service/config",
        "service/demo",
        "service/frontend",
        "service/interrupts.py",
        "service/metrics",
        "service/scaleout",
        "service/security",
    },
    "service/inprocess.py": {
        "client",
        "proto",
        "sched",
        "service/codec",
        "service/config",
        "service/errors.py",
        "service/scheduler",
    },
    "service/inprocess_server.py": {"client", "proto", "service/inprocess.py"},
    "service/testing.py": {"proto", "service/codec", "service/scheduler"},
    "service/__init__.py": set(),
}


def _folder(module: str, modules: dict[str, Path]) -> str:
    """The folder a module belongs to; a module directly in `service/` is its own."""
    path = modules[module].relative_to(ROOT)
    folder = path.parent.as_posix()
    return path.as_posix() if folder == "service" else folder


def _folder_arrows(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    modules = _source_modules()
    arrows: dict[str, set[str]] = {_folder(module, modules): set() for module in modules}
    for module, targets in edges.items():
        source = _folder(module, modules)
        arrows[source] |= {_folder(t, modules) for t in targets} - {source}
    return arrows


def _unlisted_arrows(arrows: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (source, target)
        for source, targets in arrows.items()
        for target in targets
        if target not in FOLDER_ARROWS.get(source, set())
    )


def test_folders_import_only_along_the_listed_arrows():
    arrows = _folder_arrows(_rlfeed_edges())
    assert sorted(set(arrows) - set(FOLDER_ARROWS)) == [], "a new folder: list its arrows"
    assert _unlisted_arrows(arrows) == []


def test_the_listed_folder_arrows_form_no_cycle():
    cycles = [c for c in _strongly_connected(FOLDER_ARROWS) if len(c) > 1]
    assert cycles == []


def test_the_folder_rule_sees_an_added_arrow(tmp_path):
    """The check can fail: the front-end importing the scale-out code is caught."""
    path = ROOT / "service" / "frontend" / "state.py"
    edges = _rlfeed_edges()
    imports = _imports(
        _with_line(path, tmp_path, "from rlfeed.service.scaleout.placement import FrontendPlace"),
        "rlfeed.service.frontend.state",
    )
    edges["rlfeed.service.frontend.state"] |= {name for name in imports if name in edges}
    assert ("service/frontend", "service/scaleout") in _unlisted_arrows(_folder_arrows(edges))


def test_no_import_cycles():
    edges = _rlfeed_edges()
    cycles = [component for component in _strongly_connected(edges) if len(component) > 1]
    assert cycles == []


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (the graph is small, recursion would do too)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


@pytest.mark.parametrize(
    "modules",
    [
        ["rlfeed.sched." + p.stem for p in sorted((ROOT / "sched").glob("*.py"))],
        ["rlfeed.service.scheduler.state", "rlfeed.service.scheduler.records"],
    ],
    ids=["sched", "scheduler-state"],
)
def test_pure_layers_load_no_heavy_library(modules):
    """Imported in a fresh interpreter: torch, Ray, gRPC and pyarrow stay unloaded."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_inprocess_loads_no_grpc_or_ray():
    """The sidecar without gRPC or Ray, imported in a fresh interpreter: neither loads."""
    code = (
        "import sys, rlfeed.service.inprocess\n"
        "print(sorted(m for m in ('grpc', 'ray', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


def test_client_modules_load_no_service_code():
    """Every client module imported in a fresh interpreter: no rlfeed.service module loads."""
    modules = ["rlfeed.client." + p.stem for p in sorted((ROOT / "client").glob("*.py"))]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('rlfeed.service')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]"
