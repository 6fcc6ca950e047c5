"""Regenerate the committed Python gencode from `proto/rlfeed.proto`.

Run: `make gencode` from a source checkout: it runs this file with grpcio-tools
GRPCIO_TOOLS_VERSION in a venv of its own (`.venv/gencode`), since that grpcio-tools needs a
protobuf older than the project's .venv has. Any python with grpcio-tools can run it.
Writes `rlfeed_pb2.py`, `rlfeed_pb2.pyi` and `rlfeed_pb2_grpc.py` next to this file, and
only there if this file is in a source checkout (the repository's `pyproject.toml` beside
`proto/`): an installed rlfeed's gencode is what its wheel shipped, and rewriting it in
`site-packages` would be a silent change of an installed package. `--out-dir DIR` writes
the three files elsewhere (any installation).

protoc derives import paths from the file's path under its include root, so the .proto is
copied to `<tmp>/rlfeed/proto/rlfeed.proto` first: the gRPC module then imports
`from rlfeed.proto import rlfeed_pb2`, which works from any working directory. The output is
a pure function of the .proto and the grpcio-tools version; `tests/proto/test_proto_generated.py`
checks that the committed files are up to date.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import sys
import tempfile
from pathlib import Path

# The oldest grpcio-tools with wheels for Python 3.11 (1.49.0 was yanked; 1.49.1 has wheels
# for 3.7 to 3.11, so `make gencode` needs one of those). Its protoc writes .pyi stubs and
# proto3 `optional`; its gencode carries no runtime version checks (those came with 1.63 /
# protobuf 5.26): the message module needs protobuf >= 3.20 (`internal.builder`) and runs
# unchanged on every protobuf since, 7.x included. A newer grpcio-tools would raise the
# floors of a producer-only install to the versions that generated the code.
GRPCIO_TOOLS_VERSION = "1.49.1"

PROTO_DIR = Path(__file__).resolve().parent
PROTO_NAME = "rlfeed.proto"
GENERATED = ("rlfeed_pb2.py", "rlfeed_pb2.pyi", "rlfeed_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile rlfeed.proto into `out_dir`; returns the generated file paths."""
    from grpc_tools import protoc  # a build-time tool, not a runtime dependency

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        package_dir = root / "rlfeed" / "proto"
        package_dir.mkdir(parents=True)
        shutil.copyfile(PROTO_DIR / PROTO_NAME, package_dir / PROTO_NAME)
        build = root / "out"
        build.mkdir()
        args = [
            "grpc_tools.protoc",
            f"--proto_path={root}",
            f"--python_out={build}",
            f"--pyi_out={build}",
            f"--grpc_python_out={build}",
            f"rlfeed/proto/{PROTO_NAME}",
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_DIR / PROTO_NAME}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(build / "rlfeed" / "proto" / name, target)
            written.append(target)
    return written


def is_source_checkout(proto_dir: Path = PROTO_DIR) -> bool:
    """Whether `proto_dir` is the `proto/` of an rlfeed source tree (whose root holds the
    project's pyproject.toml; a wheel ships none)."""
    pyproject = proto_dir.parent / "pyproject.toml"
    return pyproject.is_file() and 'name = "rlfeed"' in pyproject.read_text()


def _tools_version() -> str | None:
    """The installed grpcio-tools' version; None if there is none."""
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlfeed.proto.generate",
        description="Regenerate the Python gencode (rlfeed_pb2.py, .pyi, rlfeed_pb2_grpc.py) "
        "from rlfeed.proto with grpcio-tools.",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        help=f"write the files here (default: {PROTO_DIR}, only in a source checkout)",
    )
    args = parser.parse_args(argv)
    if args.out_dir is None and not is_source_checkout():
        print(
            f"{parser.prog}: {PROTO_DIR} is an installed rlfeed, not a source checkout: "
            "refusing to rewrite its gencode (use --out-dir DIR)",
            file=sys.stderr,
        )
        return 1
    tools = _tools_version()
    if args.out_dir is None and tools not in (None, GRPCIO_TOOLS_VERSION):
        print(
            f"{parser.prog}: the committed gencode is made with grpcio-tools=="
            f"{GRPCIO_TOOLS_VERSION} (its runtime floors are rlfeed's), this is {tools}: "
            "run `make gencode`, or pass --out-dir DIR",
            file=sys.stderr,
        )
        return 1
    try:
        written = generate(args.out_dir or PROTO_DIR)
    except ImportError:
        print(
            f"{parser.prog}: needs grpcio-tools: pip install grpcio-tools=={GRPCIO_TOOLS_VERSION}",
            file=sys.stderr,
        )
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
