"""MkDocs hook: the build fails when a public name is undocumented or missing from the API
reference.

Every module of ``fslr_func`` (private ones, ``_name``, aside) must be rendered by a ``:::``
directive in ``docs/reference/``, and every name its ``__all__`` exports must resolve to an
object with a docstring. Read statically with griffe, as mkdocstrings reads it: nothing is
imported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import griffe
from mkdocs.exceptions import PluginError

_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)", re.MULTILINE)


def _modules(module: griffe.Module) -> Iterator[griffe.Module]:
    yield module
    for sub in module.modules.values():
        if not sub.is_alias and not sub.name.startswith("_"):
            yield from _modules(sub)


def problems(root: Path) -> list[str]:
    """What the API reference lacks, one line per module or name."""
    package = griffe.load(
        "fslr_func",
        search_paths=[str(root)],
        docstring_parser="google",
        resolve_aliases=True,
        resolve_external=False,
    )
    rendered = {
        target
        for page in (root / "docs" / "reference").glob("*.md")
        for target in _DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    }
    found = []
    for module in _modules(package):
        package_init = module.filepath is not None and Path(str(module.filepath)).name == (
            "__init__.py"
        )
        if module.path not in rendered and not package_init:
            found.append(f"module {module.path} is not rendered in docs/reference/")
        for name in module.exports or ():
            name = str(name)
            if name == "__version__":
                continue
            obj = module.get_member(name)
            target = obj.final_target if obj.is_alias else obj
            if not (target.docstring and target.docstring.value.strip()):
                found.append(f"{module.path}.{name} (exported in __all__) has no docstring")
    return found


def on_pre_build(config: Any) -> None:
    """Fail the build (any mode) listing every undocumented public name."""
    found = problems(Path(config["config_file_path"]).parent)
    if found:
        raise PluginError("undocumented public names:\n  " + "\n  ".join(found))
