"""The committed gencode is exactly what `proto/generate.py` produces with the grpcio-tools
it names (GRPCIO_TOOLS_VERSION, in a scratch venv: it needs an older protobuf than .venv's),
and it carries no runtime version check that would raise a producer's grpcio/protobuf floor."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

from rlfeed.proto import generate

_spec = importlib.util.spec_from_file_location(
    "scratch_venv", Path(__file__).resolve().parents[1] / "scratch_venv.py"
)
scratch_venv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scratch_venv)


def test_committed_gencode_matches_regeneration(tmp_path: Path, request) -> None:
    python = scratch_venv.scratch_venv(
        request.config.cache.mkdir("scratch-venvs"),
        [f"grpcio-tools=={generate.GRPCIO_TOOLS_VERSION}"],
    )
    run = subprocess.run(
        [str(python), str(Path(generate.__file__)), "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    for name in generate.GENERATED:
        committed = generate.PROTO_DIR / name
        assert committed.exists(), f"{committed} missing: run make gencode"
        assert committed.read_bytes() == (tmp_path / name).read_bytes(), (
            f"{name} is out of date with rlfeed.proto: run `make gencode` and commit the result"
        )


def test_gencode_checks_no_runtime_version() -> None:
    """Gencode from grpcio-tools >= 1.63 refuses to import under an older grpcio/protobuf
    than made it; the committed one must not, or the floors in pyproject.toml are a lie."""
    for name in ("rlfeed_pb2.py", "rlfeed_pb2_grpc.py"):
        source = (generate.PROTO_DIR / name).read_text()
        for guard in ("ValidateProtobufRuntimeVersion", "GRPC_GENERATED_VERSION"):
            assert guard not in source, f"{name} checks {guard}: regenerate with make gencode"


def test_regenerating_with_another_grpcio_tools_into_the_checkout_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(generate, "_tools_version", lambda: "9.9.9")
    assert generate.main([]) == 1
    assert "made with grpcio-tools==1.49.1" in capsys.readouterr().err


def test_grpc_module_imports_message_module_through_the_package() -> None:
    from rlfeed.proto import rlfeed_pb2, rlfeed_pb2_grpc

    source = Path(rlfeed_pb2_grpc.__file__).read_text()
    assert "from rlfeed.proto import rlfeed_pb2" in source
    assert rlfeed_pb2.DESCRIPTOR.package == "rlfeed.v1"
    services = set(rlfeed_pb2.DESCRIPTOR.services_by_name)
    assert services == {"RolloutIngest", "TaskSampling", "BatchServing", "SidecarStatus"}


def test_the_policy_version_fields_have_presence() -> None:
    """Unset means "not published", distinct from version 0."""
    from rlfeed.proto import rlfeed_pb2 as pb

    for message, field in (
        (pb.TrainerReport, "policy_version"),
        (pb.StatusResponse, "trainer_policy_version"),
    ):
        assert not message().HasField(field)
        assert message(**{field: 0}).HasField(field)
