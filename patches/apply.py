"""Apply every patch in this folder to the installed packages (run once by the setup step, .ci/setup).

Only what vx cannot change at run time lives here, each file saying why: today torchvision's
import on the CPU test machine. vx's changes to vLLM ship inside the package and apply in vx's own
engines only (vx/engine/patches/); nothing here edits vLLM.

Each patch module names TARGET (a path inside site-packages) or TARGETS (one per package version,
the first that holds OLD or NEW text is patched), OLD and NEW text. A patch whose NEW text is
already there is skipped; targets that are missing are skipped (package absent); targets that
exist and match neither are an error, so a silent no-op never hides a version change.
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
    targets = getattr(mod, "TARGETS", None) or [mod.TARGET]  # several: one per package version
    found = [d / t for d in site_dirs() for t in targets if (d / t).exists()]
    for target in found:
        text = target.read_text()
        if mod.NEW in text:
            return f"{patch_file.stem}: already applied to {target}"
        if mod.OLD in text:
            target.write_text(text.replace(mod.OLD, mod.NEW, 1))
            return f"{patch_file.stem}: applied to {target}"
    if found:
        raise SystemExit(f"{patch_file.stem}: {', '.join(map(str, found))} does not contain the expected text; "
                         "the package version changed, review the patch")
    return f"{patch_file.stem}: {' or '.join(targets)} not installed, skipped"


if __name__ == "__main__":
    names = set(sys.argv[1:])  # only these patches; all by default
    files = [f for f in sorted(HERE.glob("*.py")) if f.name != "apply.py" and (not names or f.stem in names)]
    if names - {f.stem for f in files}:
        raise SystemExit(f"no such patch: {', '.join(sorted(names - {f.stem for f in files}))}")
    for f in files:
        print(apply(f), file=sys.stderr)
