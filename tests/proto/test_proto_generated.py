"""The committed gencode is exactly what `python -m rlfeed.proto.generate` produces."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from rlfeed.proto import generate


def test_committed_gencode_matches_regeneration(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    from rlfeed.proto import rlfeed_pb2_grpc

    tools = importlib.metadata.version("grpcio-tools")
    if tools != rlfeed_pb2_grpc.GRPC_GENERATED_VERSION:
        pytest.skip(
            f"gencode was made by grpcio-tools {rlfeed_pb2_grpc.GRPC_GENERATED_VERSION}, "
            f"this is {tools}: regeneration would differ in its version stamps only"
        )
    for fresh in generate.generate(tmp_path):
        committed = generate.PROTO_DIR / fresh.name
        assert committed.exists(), f"{committed} missing: run python -m rlfeed.proto.generate"
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.name} is out of date with rlfeed.proto: "
            "run .venv/bin/python -m rlfeed.proto.generate and commit the result"
        )


def test_grpc_module_imports_message_module_through_the_package() -> None:
    from rlfeed.proto import rlfeed_pb2, rlfeed_pb2_grpc

    source = Path(rlfeed_pb2_grpc.__file__).read_text()
    assert "from rlfeed.proto import rlfeed_pb2" in source
    assert rlfeed_pb2.DESCRIPTOR.package == "rlfeed.v1"
    services = set(rlfeed_pb2.DESCRIPTOR.services_by_name)
    assert services == {"RolloutIngest", "TaskSampling", "BatchServing", "SidecarStatus"}
