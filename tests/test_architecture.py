"""The package's architecture, as pyproject.toml's import-linter contracts state it: imports point
one way (cli -> jobs -> launch -> engine, train -> monitor -> data -> store -> shared utilities), no
cycles, a trainer's imports need no vLLM; every module imports on its own; files stay short."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300


def modules() -> list[str]:
    names = []
    for p in sorted((ROOT / "vx").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_every_part_of_the_package_has_a_place_in_the_layers():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    parts = {".".join(m.split(".")[:2]) for m in modules() if m.count(".") >= 1} - {"vx.__main__"}
    assert parts - placed == set(), "every package and top-level module of vx belongs to one layer"


def test_each_module_imports_on_its_own():
    # one interpreter; before each import every vx module is forgotten, so an import that only works
    # after another module happened to load first (a hidden cycle) fails here
    code = (
        "import importlib, sys\n"
        f"names = {modules()!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    for m in [m for m in sys.modules if m == 'vx' or m.startswith('vx.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_no_module_is_over_300_lines_without_its_reason_at_the_top():
    long = []
    for p in sorted((ROOT / "vx").rglob("*.py")):
        text = p.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_LINES and "Over 300 lines:" not in doc:
            long.append(f"{p.relative_to(ROOT)}: {len(text.splitlines())} lines")
    assert long == []


def test_every_import_of_a_vx_name_resolves_also_inside_functions():
    # imports inside functions run only when their branch does; a moved name must not wait for that
    import importlib
    import importlib.util

    missing = []
    for p in sorted((ROOT / "vx").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vx":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name) and importlib.util.find_spec(
                            f"{node.module}.{alias.name}") is None:
                        missing.append(f"{p.relative_to(ROOT)}:{node.lineno}: {node.module} has no {alias.name}")
    assert missing == []


def test_every_failpoint_in_the_code_is_named_in_the_registry_and_back():
    """The fault campaign draws from vx.faults.POINTS: a point the code passes but POINTS lacks
    would never be fired, a name POINTS keeps after its call is gone would be fired to no effect."""
    import re

    from vx import faults

    called = set()
    for path in (ROOT / "vx").rglob("*.py"):
        called |= set(re.findall(r'faults\.point\("([a-z0-9-]+)"\)', path.read_text()))
    assert called == set(faults.POINTS), (called ^ set(faults.POINTS))
