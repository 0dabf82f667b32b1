"""Generate Shoal's protobuf message modules from the .proto sources in this folder.

One function, used by the build (``proto/setup.py``) and by the test that fails when the
generated code in the source tree is stale. The .proto files sit in the package they are
compiled into, ``proto/shoal/protocol/``, so that their import paths, and so the imports protoc
writes into the Python modules, are ``shoal.protocol.*_pb2``: the modules' own names.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_PATH = Path("shoal/protocol")  # the import path of the .proto files and of the modules
PROTO_FILES = ("model_config.proto", "grpc_service.proto")


def generate(out_dir: Path) -> list[Path]:
    """Run grpcio-tools' protoc on every Shoal .proto, put the modules in ``out_dir``; return them."""
    from grpc_tools import protoc  # build-time dependency, pinned in pyproject.toml

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            *(str(PROTO_ROOT / PACKAGE_PATH / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for name in PROTO_FILES:
            stem = Path(name).stem
            for suffix in ("_pb2.py", "_pb2.pyi"):
                target = out_dir / f"{stem}{suffix}"
                shutil.copyfile(Path(scratch) / PACKAGE_PATH / f"{stem}{suffix}", target)
                written.append(target)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT / PACKAGE_PATH
    for path in generate(target):
        print(path)
