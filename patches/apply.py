"""Apply every patch in this folder to the installed packages (run once by the setup step).

Each patch module names TARGET (a path inside site-packages), OLD and NEW text. A patch whose
NEW text is already there is skipped; a TARGET that is missing is skipped (package absent);
a TARGET whose text matches neither is an error, so a silent no-op never hides a version change.
"""

import importlib.util
import site
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def site_dirs():
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d) for d in dirs]


def apply(patch_file: Path) -> str:
    spec = importlib.util.spec_from_file_location(patch_file.stem, patch_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for d in site_dirs():
        target = d / mod.TARGET
        if not target.exists():
            continue
        text = target.read_text()
        if mod.NEW in text:
            return f"{patch_file.stem}: already applied to {target}"
        if mod.OLD not in text:
            raise SystemExit(f"{patch_file.stem}: {target} does not contain the expected text; "
                             "the package version changed, review the patch")
        target.write_text(text.replace(mod.OLD, mod.NEW, 1))
        return f"{patch_file.stem}: applied to {target}"
    return f"{patch_file.stem}: {mod.TARGET} not installed, skipped"


if __name__ == "__main__":
    for f in sorted(HERE.glob("*.py")):
        if f.name != "apply.py":
            print(apply(f), file=sys.stderr)
