"""Generate Shoal's protobuf message modules from the .proto sources in this folder.

One function, used by the build (setup.py) and by the test that fails when the
generated code in the source tree is stale. The .proto files sit under
``proto/server/pb/`` so that their import paths, and so the Python modules that
protoc writes, are ``server/pb/*_pb2.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("server/pb/model_config.proto", "server/pb/grpc_service.proto")


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc on every Shoal .proto; return the files written."""
    from grpc_tools import protoc  # build-time dependency, pinned in pyproject.toml

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *(str(PROTO_ROOT / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for name in PROTO_FILES:
        stem = Path(name).with_suffix("")
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi"]
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    for path in generate(target):
        print(path)
