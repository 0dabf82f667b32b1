"""A thread instance's own import context: its version folder's files, apart from every other model's.

Thread instances (``process_instances: false``) share the server's ``sys.modules``, so the folder
cannot go on ``sys.path``: the first model to import ``helper`` would serve every other model's
``import helper``, and a reload would keep the old version's modules. The rule instead:

- Each instance gets a package of its own, ``_shoal_model_<n>``, whose ``__path__`` is the version
  folder; ``model.py`` runs as ``_shoal_model_<n>.model``, and every file of the folder it imports
  becomes a submodule of that package (``helper`` → ``_shoal_model_<n>.helper``). Nothing of a
  model's folder enters ``sys.modules`` under a bare name.
- The modules loaded from the folder see builtins of their own whose ``__import__`` maps a bare
  top-level name the folder provides (``name.py``, a package ``name/``, an extension module) to the
  package, so ``import helper``, ``from helper import f`` and ``import subpkg.mod`` in model.py or
  in any of its files, at load or later in ``execute``, and from any thread, mean this version's
  files. A name the folder does not provide is imported as usual; so is a relative import.
  ``triton_python_backend_utils`` is always Shoal's, and a standard library module's name always
  the standard library's: a server has most of them imported already, which a folder on
  ``sys.path`` never shadowed either, and shadowing only the others would hang on import order.
  Other ways of importing by name (``importlib.import_module``, pickle) do not see the folder: a
  model that needs them runs as a process instance, whose folder is on its process's ``sys.path``
  as in Triton's stub. A file shipped only as bytecode (``.pyc``) loads with the server's builtins.
- The folder's files are compiled from their source at each load (no ``__pycache__`` is read or
  written), so a changed file runs after a reload whatever its timestamps.
- ``close`` (at unload) drops the package and its modules from ``sys.modules``.

Only installing the finder (once) takes a lock: each context touches only its own names, and
Python's import lock is per module, so models loading or importing on several threads at once do
not meet.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

PACKAGE_PREFIX = "_shoal_model_"
UTILS_NAME = "triton_python_backend_utils"
_real_import = builtins.__import__
_numbers = itertools.count(1)
_contexts: dict[str, ModelImports] = {}  # package name → its context, read by the finder
_install_lock = threading.Lock()


class _FolderFileLoader(importlib.machinery.SourceFileLoader):
    """Loads a file of a model's folder with the context's builtins, always from its source."""

    def __init__(self, fullname: str, path: str, model_builtins: dict[str, Any]) -> None:
        super().__init__(fullname, path)
        self._builtins = model_builtins

    def get_code(self, fullname: str) -> CodeType:
        return self.source_to_code(self.get_data(self.path), self.path)

    def exec_module(self, module: ModuleType) -> None:
        module.__builtins__ = self._builtins  # type: ignore[attr-defined]  # a module's own builtins
        super().exec_module(module)


class _ContextFinder(importlib.abc.MetaPathFinder):
    """Finds the submodules of a context's package in its folder, to be loaded with its builtins."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, dot, _ = fullname.partition(".")
        context = _contexts.get(package)
        if context is None or not dot:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader and spec.origin:
            spec.loader = _FolderFileLoader(fullname, spec.origin, context.builtins)
        return spec


_FINDER = _ContextFinder()


def _install_finder() -> None:
    with _install_lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


class ModelImports:
    """One instance's package over its version folder (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.package = f"{PACKAGE_PREFIX}{next(_numbers)}"
        self.builtins: dict[str, Any] = dict(vars(builtins))
        self.builtins["__import__"] = self._import
        self._provides: dict[str, bool] = {}  # bare name → whether the folder has it (files fixed per load)
        _install_finder()
        spec = importlib.machinery.ModuleSpec(self.package, None, is_package=True)
        spec.submodule_search_locations = [str(self.folder)]
        module = importlib.util.module_from_spec(spec)
        _forget_finders(self.folder)  # a reloaded folder is listed afresh
        _contexts[self.package] = self
        sys.modules[self.package] = module

    def load(self, model_file: Path) -> ModuleType:
        """Run ``model_file`` (in the folder) as this package's submodule and return the module."""
        name = f"{self.package}.{model_file.stem}"
        loader = _FolderFileLoader(name, str(model_file), self.builtins)
        spec = importlib.util.spec_from_file_location(name, model_file, loader=loader)
        if spec is None:
            raise ImportError(f"cannot import {model_file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader.exec_module(module)
        return module

    def close(self) -> None:
        """Drop the package and every module loaded into it."""
        _contexts.pop(self.package, None)
        prefix = self.package + "."
        for name in [name for name in list(sys.modules) if name == self.package or name.startswith(prefix)]:
            sys.modules.pop(name, None)
        _forget_finders(self.folder)

    def _import(
        self,
        name: str,
        globals: Mapping[str, Any] | None = None,  # noqa: A002 - __import__'s names
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),  # noqa: A002
        level: int = 0,
    ) -> ModuleType:
        """``__import__`` for the folder's modules: a bare name the folder provides means the package's."""
        top = name.partition(".")[0]
        if level != 0 or not self._has(top):
            return _real_import(name, globals, locals, fromlist or (), level)
        module = _real_import(f"{self.package}.{name}", globals, locals, fromlist or (), 0)
        return module if fromlist else sys.modules[f"{self.package}.{top}"]

    def _has(self, top: str) -> bool:
        known = self._provides.get(top)
        if known is None:
            known = self._provides[top] = _folder_provides(self.folder, top)
        return known


def _folder_provides(folder: Path, top: str) -> bool:
    """Whether ``import top`` means the folder's: a module or regular package of it; a plain directory
    (a namespace package) only where nothing else by that name is importable."""
    if top == UTILS_NAME or top in sys.stdlib_module_names:
        return False
    spec = importlib.machinery.PathFinder.find_spec(top, [str(folder)])
    if spec is None:
        return False
    if spec.origin is not None and spec.has_location:
        return True
    return importlib.machinery.PathFinder.find_spec(top) is None


def _forget_finders(folder: Path) -> None:
    """Drop the cached directory finders of ``folder`` and its subfolders, so files are looked up anew."""
    root = str(folder)
    for key in [key for key in list(sys.path_importer_cache) if key == root or key.startswith(root + os.sep)]:
        sys.path_importer_cache.pop(key, None)
