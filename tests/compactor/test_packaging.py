"""What the distribution ships: every package its type marker, the status page its files."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compactor", "events", "producer", "worker")


def _package_data() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data: dict[str, list[str]] = config["tool"]["setuptools"]["package-data"]
    return data


def test_every_package_ships_its_py_typed_marker() -> None:
    """``producer.publisher.Publisher`` is the documented client: without producer's marker an
    agent's ``mypy --strict`` took it for Any ("missing library stubs or py.typed marker")."""
    data = _package_data()
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in data.get(package, []), package


def test_every_non_python_file_in_a_package_is_shipped() -> None:
    data = _package_data()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            relative = path.relative_to(ROOT / package).as_posix()
            assert any(fnmatch.fnmatch(relative, pattern) for pattern in data.get(package, [])), f"{package}/{relative}"


def test_every_third_party_module_the_packages_import_is_a_declared_dependency() -> None:
    """``compactor health --api`` (the image's and compose's healthchecks) imported httpx, declared
    only in the test extra: it came through litellm, until a litellm without it."""
    import ast
    import re
    import sys
    from importlib.metadata import packages_distributions

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {re.split(r"[\[<>=;~! ]", spec, maxsplit=1)[0].lower().replace("_", "-")
                for spec in config["project"]["dependencies"]}
    distributions = packages_distributions()
    missing = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES or top in sys.stdlib_module_names or top == "__future__":
                        continue
                    owners = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
                    if not owners & declared:
                        missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, sorted(missing)
