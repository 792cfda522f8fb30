"""Generates the Python gRPC stubs in `reflow/v1/` from `protos/` (run `make protos`)."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
STUB_ROOT = Path(__file__).resolve().parent.parent


def proto_files() -> list[Path]:
    """The contract's .proto files, relative to `protos/`."""
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_root: Path = STUB_ROOT) -> list[Path]:
    """Writes `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` under `out_root`; returns them."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    files = [str(p) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    return sorted(
        out_root / p.parent / f"{p.stem}{suffix}"
        for p in proto_files()
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    )


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_ROOT):
        print(path)
