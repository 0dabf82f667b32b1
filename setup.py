"""Build hook and package layout; everything else about the package lives in pyproject.toml.

The repository's folders are installed under one import namespace, ``shoal``, so that no
generic top-level name (``server``, ``clients``) lands in site-packages, where a user's own
``server.py`` or ``clients/`` would shadow it: ``server/`` is the package ``shoal`` and
``clients/`` is ``shoal.clients``.

The protobuf modules are generated before the build into the source tree
(``server/protocol/``), so editable and regular installs both see them; they are git-ignored.
"""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE_FOLDERS = {"shoal": "server", "shoal.clients": "clients"}


def _packages() -> list[str]:
    found = []
    for package, folder in PACKAGE_FOLDERS.items():
        found += [package, *(f"{package}.{sub}" for sub in find_packages(str(ROOT / folder)))]
    return found


def _generate_protos() -> None:
    spec = importlib.util.spec_from_file_location("shoal_proto_generate", ROOT / "proto" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(ROOT / "server" / "protocol")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        _generate_protos()
        super().run()


setup(
    packages=_packages(),
    package_dir=PACKAGE_FOLDERS,
    package_data={"shoal": ["py.typed"], "shoal.protocol": ["*.pyi"]},
    cmdclass={"build_py": BuildPyWithProtos},
)
