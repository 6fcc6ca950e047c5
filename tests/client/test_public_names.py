"""What a user installing rlfeed and a type checker reading it see: every lazily exported
name of `rlfeed.client` is also imported under `TYPE_CHECKING` (mypy and pyright do not run
`__getattr__`, so without it `from rlfeed.client import BatchLoader` is `Any`), the
package ships `py.typed` markers, and the declared licence's text is there."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import rlfeed
import rlfeed.client

if sys.version_info >= (3, 11):
    import tomllib
else:  # a dependency there (pyproject.toml)
    import tomli as tomllib

ROOT = Path(rlfeed.__file__).resolve().parent  # the repository root is the package


def type_checking_imports() -> dict[str, str]:
    """name -> module of every `from module import name as name` under `if TYPE_CHECKING:`."""
    tree = ast.parse((ROOT / "client" / "__init__.py").read_text())
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    ]
    assert len(blocks) == 1, "expected one `if TYPE_CHECKING:` block"
    names = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        for alias in node.names:
            # `X as X` marks an explicit re-export for type checkers (PEP 484).
            assert alias.asname == alias.name, f"import {alias.name} as {alias.name}"
            names[alias.name] = node.module
    return names


def test_every_exported_name_is_imported_for_type_checkers_from_where_it_resolves():
    exports = rlfeed.client._EXPORTS
    typed = type_checking_imports()
    assert sorted(typed) == sorted(exports)
    for name, module in exports.items():
        path = module if "." in module else f"rlfeed.client.{module}"
        assert typed[name] == path, name
        assert getattr(rlfeed.client, name) is getattr(importlib.import_module(path), name)
    assert sorted(rlfeed.client.__all__) == sorted(exports)


def test_the_package_ships_py_typed_markers():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    for package, directory in (("rlfeed", ROOT), ("rlfeed.client", ROOT / "client")):
        assert (directory / "py.typed").is_file(), package
        assert "py.typed" in package_data[package], package


def test_the_declared_licence_text_is_shipped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
