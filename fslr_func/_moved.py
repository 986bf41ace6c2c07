"""Import paths of 0.2 that moved in 0.3, when the flat modules became layer subpackages.

``import fslr_func.recorder`` (and every other old path in :data:`MOVED`) still works for one
release: it gives the module at its new path (the same module object, so ``isinstance`` checks
and monkeypatching see one class) with a ``DeprecationWarning`` naming the new path.
``fslr_func.policies`` is a stable name of the public surface (``ff.policies``) and gives
:mod:`fslr_func.training.policies` without a warning.

Examples:
    >>> import importlib, warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     old = importlib.import_module("fslr_func.recorder")
    >>> old is importlib.import_module("fslr_func.training.recorder")
    True
    >>> str(caught[0].message)  # doctest: +ELLIPSIS
    'fslr_func.recorder moved to fslr_func.training.recorder in fslr_func 0.3; ...'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "STABLE", "install", "moved_attribute"]

MOVED: dict[str, str] = {
    "fslr_func.atomic": "fslr_func.io.atomic",
    "fslr_func.cli": "fslr_func.experiments.cli",
    "fslr_func.connectivity": "fslr_func.probe.connectivity",
    "fslr_func.control_options": "fslr_func.training.controller",
    "fslr_func.estimator": "fslr_func.stats.estimator",
    "fslr_func.fallback": "fslr_func.probe.fallback",
    "fslr_func.flerm": "fslr_func.training.flerm",
    "fslr_func.flerm_rule": "fslr_func.training.flerm_rule",
    "fslr_func.fsdp": "fslr_func.parallel.fsdp",
    "fslr_func.functional": "fslr_func.probe.functional",
    "fslr_func.names": "fslr_func.probe.names",
    "fslr_func.options": "fslr_func.probe.options",
    "fslr_func.plot": "fslr_func.experiments.plot",
    "fslr_func.probe_schedule": "fslr_func.training.probe_schedule",
    "fslr_func.process_group": "fslr_func.parallel.process_group",
    "fslr_func.record": "fslr_func.io.record",
    "fslr_func.record_meta": "fslr_func.io.record_meta",
    "fslr_func.recorder": "fslr_func.training.recorder",
    "fslr_func.step_hooks": "fslr_func.training.step_hooks",
    "fslr_func.transform": "fslr_func.training.wrapper",
    "fslr_func.update_scaling": "fslr_func.training.update_scaling",
    "fslr_func.vjp": "fslr_func.probe.vjp",
    "fslr_func.wrap": "fslr_func.training.wrap",
}
"""Old module path (0.2) -> new path; importing the old one warns."""
STABLE: dict[str, str] = {"fslr_func.policies": "fslr_func.training.policies"}
"""Public names that live in a subpackage; importing them does not warn."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED or fullname in STABLE:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED.get(spec.name)
        if new is not None:
            warnings.warn(
                f"{spec.name} moved to {new} in fslr_func 0.3; the old path goes in 0.4: "
                f"import from {new} (or the top level, import fslr_func as ff)",
                DeprecationWarning,
                stacklevel=2,
            )
        module = importlib.import_module(new or STABLE[spec.name])
        self._spec = module.__spec__  # the import system overwrites it; put back in exec_module
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``fslr_func/__init__`` calls it)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def moved_attribute(name: str) -> ModuleType:
    """``fslr_func.<name>`` read as an attribute, for an old module path: imported (with its
    warning) so that ``ff.recorder.Recorder`` works as it did.

    Raises:
        AttributeError: ``name`` is not an old module path.
    """
    full = f"fslr_func.{name}"
    if full not in MOVED:
        raise AttributeError(f"module 'fslr_func' has no attribute {name!r}")
    return importlib.import_module(full)
