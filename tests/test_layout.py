"""The package's import layout, checked on the source (AST, so strings, comments and
docstrings do not count; imports inside functions do):

- ``core`` imports no plugin module: the built-in strategies register through the same
  hooks as a third party's, and core reaches them only through the registry;
- no module imports another module's private name (``from tokenloom.x import _name``) or a
  private module (``import tokenloom.x._mod``): what two modules share is public.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package `tokenloom`
PACKAGE_DIRS = ("core", "plugins", "backends", "kernels", "protocols", "cli", "bench", "planner")
ROOT_MODULES = ("__init__.py", "testing.py")

#: Violations in a folder this change could not edit, as "path: module import name". Each
#: must still be there (the test fails once it is gone, so its entry goes too).
KNOWN_PRIVATE_IMPORTS: set[str] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ["tokenloom", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files(root: Path = ROOT) -> list[Path]:
    files = [root / name for name in ROOT_MODULES if (root / name).exists()]
    for folder in PACKAGE_DIRS:
        files.extend(sorted((root / folder).rglob("*.py")))
    return files


def imports(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str, str | None]]:
    """Every import in ``source`` (module ``module``) as (line, absolute module, name): ``name``
    is the imported name for ``from m import name``, else None. Relative imports are resolved."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, base, alias.name


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _hit(path: Path, root: Path, line: int | None, mod: str, name: str | None) -> str:
    where = f"{path.relative_to(root)}" + (f":{line}" if line is not None else "")
    return f"{where}: {mod}" + (f" import {name}" if name else "")


def plugin_imports(path: Path, source: str | None = None, root: Path = ROOT) -> list[str]:
    """Imports of ``tokenloom.plugins`` (or anything in it) in one file."""
    source = path.read_text() if source is None else source
    found = []
    for line, mod, name in imports(source, module_name(path, root), path.name == "__init__.py"):
        targets = [mod] + ([f"{mod}.{name}"] if name and name != "*" else [])
        if any(t == "tokenloom.plugins" or t.startswith("tokenloom.plugins.") for t in targets):
            found.append(_hit(path, root, line, mod, name))
    return found


def private_imports(path: Path, source: str | None = None, root: Path = ROOT, lines: bool = True) -> list[str]:
    """Imports of another module's private name, or of a private module, in one file."""
    source = path.read_text() if source is None else source
    me = module_name(path, root)
    found = []
    for line, mod, name in imports(source, me, path.name == "__init__.py"):
        if mod != "tokenloom" and not mod.startswith("tokenloom."):
            continue  # another package's business
        private_module = any(_private(p) for p in mod.split("."))
        private_name = name is not None and _private(name)
        if (private_module or private_name) and mod != me:
            found.append(_hit(path, root, line if lines else None, mod, name))
    return found


def core_plugin_imports(root: Path = ROOT) -> list[str]:
    return [hit for path in sorted((root / "core").rglob("*.py")) for hit in plugin_imports(path, root=root)]


def all_private_imports(root: Path = ROOT, lines: bool = True) -> list[str]:
    return [hit for path in package_files(root) for hit in private_imports(path, root=root, lines=lines)]


def test_the_scan_sees_every_package_folder():
    files = package_files()
    assert len(files) > 50 and {f.name for f in files} >= set(ROOT_MODULES)
    for folder in PACKAGE_DIRS:
        assert any(f.is_relative_to(ROOT / folder) for f in files), folder
    assert not any(f.is_relative_to(ROOT / "tests") or f.is_relative_to(ROOT / "scripts") for f in files)


def test_core_imports_no_plugin_module():
    found = core_plugin_imports()
    assert not found, "core imports plugin modules (go through the registry instead):\n" + "\n".join(found)


def test_no_private_name_is_imported_across_modules():
    found = all_private_imports()
    new = [hit for hit, key in zip(found, all_private_imports(lines=False), strict=True)
           if key not in KNOWN_PRIVATE_IMPORTS]
    assert not new, "private names imported from another module (make them public):\n" + "\n".join(new)
    gone = KNOWN_PRIVATE_IMPORTS - set(all_private_imports(lines=False))
    assert not gone, "fixed: remove from KNOWN_PRIVATE_IMPORTS:\n" + "\n".join(sorted(gone))


# ---- the checks catch what they are for ---------------------------------------------------
def test_an_injected_violation_fails_the_whole_tree_scan(tmp_path):
    """A copy of the layout with one lazy plugin import in core and one private import in a
    plugin: both scans name them (and nothing in a string)."""
    for folder in PACKAGE_DIRS:
        (tmp_path / folder).mkdir()
    (tmp_path / "core" / "models").mkdir()
    (tmp_path / "core" / "models" / "x.py").write_text(
        '"""from tokenloom.plugins import y"""\n\ndef f():\n    from ...plugins.cache import paged\n    return paged\n')
    (tmp_path / "plugins" / "y.py").write_text("from tokenloom.core.engine import _Pending\n")
    assert core_plugin_imports(tmp_path) == ["core/models/x.py:4: tokenloom.plugins.cache import paged"]
    assert all_private_imports(tmp_path) == ["plugins/y.py:1: tokenloom.core.engine import _Pending"]


@pytest.mark.parametrize("source", [
    "from tokenloom.plugins.cache.paged import PagedOptions\n",
    "import tokenloom.plugins.cache.paged\n",
    "from tokenloom import plugins\n",
    "from ..plugins.cache import paged\n",
    "def load():\n    from tokenloom.plugins.cache.paged import cdiv\n    return cdiv\n",
])
def test_plugin_import_check_catches(source):
    assert plugin_imports(ROOT / "core" / "build.py", source)


@pytest.mark.parametrize("source", [
    '"""from tokenloom.plugins.cache.paged import cdiv"""\n',
    "NAMES = ['tokenloom.plugins.cache.paged']  # import tokenloom.plugins\n",
    "from tokenloom.core import plugins\n",
    "from .plugins import PluginManager\n",
])
def test_plugin_import_check_passes(source):
    assert not plugin_imports(ROOT / "core" / "build.py", source)


@pytest.mark.parametrize("source", [
    "from tokenloom.kernels.triton import _common\n",
    "from tokenloom.kernels.triton._common import INTERPRET\n",
    "import tokenloom.kernels.triton._common\n",
    "from tokenloom.core.engine import _Pending\n",
    "from ..kernels.triton._common import INTERPRET\n",
    "def f():\n    from tokenloom.core.sampler import _top_k_top_p\n",
])
def test_private_import_check_catches(source):
    assert private_imports(ROOT / "backends" / "triton_backend.py", source)


@pytest.mark.parametrize("source", [
    "from tokenloom.core.engine import AsyncEngine\n",
    "from __future__ import annotations\n",
    "from torch import _C\n",
    "from tokenloom.core.metrics import __doc__\n",
    '"""from tokenloom.core.engine import _Pending"""\n',
])
def test_private_import_check_passes(source):
    assert not private_imports(ROOT / "backends" / "triton_backend.py", source)
