"""The import layers (`[tool.importlinter]` in pyproject.toml) hold, and an import against them
is caught."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_layers_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_import_against_the_layers_breaks_them(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "gateway", tmp_path / "gateway")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    ewma = tmp_path / "gateway" / "core" / "ewma.py"
    # The pure core reaching up into the shell.
    ewma.write_text(ewma.read_text() + "\nimport gateway.app  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "- gateway.core.ewma -> gateway.app" in result.stdout, result.stdout


def test_every_module_has_a_layer() -> None:
    """A module left out of the contract would be free to import anything."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        config = tomllib.load(file)
    (contract,) = config["tool"]["importlinter"]["contracts"]
    listed = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    package = ROOT / "gateway"
    present = {
        f"gateway.{path.stem}"
        for path in package.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }
    assert present == listed
