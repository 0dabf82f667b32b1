"""Build hook: generate the protobuf modules before the package is built.

Everything else about the package lives in pyproject.toml. The generated modules
are written into the source tree (server/pb/), so editable and regular installs
both see them, and they are git-ignored.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _generate_protos() -> None:
    spec = importlib.util.spec_from_file_location("shoal_proto_generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(ROOT)


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        _generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
