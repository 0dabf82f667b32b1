"""Build hook of the ``shoal-protocol`` distribution: protoc runs before the package is built.

The ``*_pb2`` modules are generated into the source tree, beside the .proto files they come
from (``shoal/protocol/``), so editable and regular installs both see them; they are
git-ignored. Everything else about the distribution lives in ``pyproject.toml``.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _generate_protos() -> None:
    spec = importlib.util.spec_from_file_location("shoal_compile_protos", ROOT / "compile_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(ROOT / "shoal" / "protocol")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        _generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
