"""Load a script of the repository (an example, a benchmark) as a module, for its tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> Any:
    """The module of ``ROOT / relative``, executed once (its ``__main__`` block not run)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem + "_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
