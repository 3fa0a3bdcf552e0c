"""A dead engine ends its driver within seconds.

vLLM's client waits on its engine core without a deadline: a step blocks in `queue.get` for the
next output, a utility RPC (`collective_rpc`, vx's `vx_finish`) in `Future.result`. When the core
process dies (OOM killer, a CUDA error, a segfault, SIGTERM to the job's process group), vLLM's
monitor marks the engine dead but wakes neither wait (0.32 and 0.33 alike: only later calls raise
`EngineDeadError`), so the driver waited forever. EngineWatch closes that gap for every engine vx
starts (extraction, `vx regenerate`, `vx selftest`):

- It knows the engine's processes: the engine cores vLLM starts with multiprocessing (picked up
  while `LLM()` starts them, then vLLM's process manager's list) and, every SCAN_S, the vLLM
  workers below them (`VLLM::Worker*`, tensor parallel).
- A thread waits on the cores' sentinels (it wakes the moment one exits) and checks the workers
  every tick; the one line it writes names the process and how it ended (exit code or signal).
- Calls into the engine run inside `watch.call(what)` (or through `watch.guard(obj)`): a call first
  checks the engine is alive; when it dies during the call, the thread sends WAKE to the main
  thread, whose handler raises EngineDied there (lock waits are interrupted by signal handlers),
  so the blocked wait ends by raising. A call may also have a deadline (the finishing calls of an
  interrupted run): past it the same wake raises EngineDied saying it did not answer.
- Outside a call a death is only recorded and the next call raises: the driver's own work (a
  regenerate commit) is never cut halfway.
- Backstop: a process still alive GRACE_S after the death (stuck somewhere no wake reaches) prints
  the line and exits with the code vx.errors gives it.
- A stop (Ctrl-C, SIGTERM) while vLLM starts the engine, which vLLM swallows: see _leave_start.

Over 300 lines: one noun, the watch over one engine's processes; its thread, its wake, the start
and the backstop share its state.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import threading
import time
from pathlib import Path

from vx.engine.lifetime.reaper import _stat, descendants
from vx.errors import EngineDied, exit_interrupted, exit_now, startup_over, stop_requested

WAKE = signal.SIGUSR2   # unused by vLLM, torch and Python's runtime
TICK_S = 0.1
SCAN_S = 2.0            # how often the cores' worker processes are looked up
GRACE_S = 6.0           # after a death, the driver's own exit path gets this long
STOP_START_S = 3.0      # a stop while the engine starts: the start's own path gets this long, then the driver leaves
START_FAILED_S = 10.0   # a core that exited during the start: vLLM's own error gets this long to come up
WORKER_TITLE = b"VLLM::Worker"
KEPT = "committed samples are kept, rerun the same command to continue"  # the line's tail
# vLLM's engine core refuses every call once a signal began its shutdown (SIGTERM or SIGINT to the
# core alone: a container stop, an admin; 0.32 and 0.33 `EngineCore._reject_utility_in_shutdown`);
# the process exits a moment later, and the watch names how, given this long
SHUTTING_DOWN = "Server shutting down"
STOPPING_S = 10.0


def how_it_ended(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
    return f"exited with code {code}"


def _title(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _mp_children() -> set:
    """multiprocessing's own set of this process's live children (read from another thread:
    copied, retried if the main thread changes it meanwhile)."""
    for _ in range(10):
        try:
            return set(multiprocessing.process._children)
        except RuntimeError:
            time.sleep(0.001)
    return set()


class EngineWatch:
    """The driver's watch over one engine; begin() before `LLM()`, close() before stopping it."""

    def __init__(self, label: str, kept: str, grace_s: float = GRACE_S):
        self.label, self.kept, self.grace_s = label, kept, grace_s
        self.message: str | None = None  # set once, when the engine is lost
        self._before = _mp_children()
        self._cores: dict[int, object] = {}    # pid -> multiprocessing process (ours to wait on)
        self._workers: dict[int, int] = {}     # pid -> start time
        self._attached = False
        self._depth = 0
        self._call: tuple[str, float | None] | None = None  # (what, deadline) of the current call
        self._late: str | None = None          # a call past its deadline
        self._stopped_at: float | None = None  # when a stop was first seen during the engine's start
        self._ended: set[int] = set()  # cores that ended during the start
        self._start_failed: tuple[float, str] | None = None  # when and how, without a stop
        self._stop = threading.Event()  # close(): the driver stops the engine itself now
        self._main = threading.main_thread().ident if threading.current_thread() is threading.main_thread() else None
        self._old_handler = signal.signal(WAKE, self._on_wake) if self._main else None
        self._thread = threading.Thread(target=self._run, name="vx-engine-watch", daemon=True)
        self._thread.start()

    @classmethod
    def begin(cls, label: str = "the vLLM engine", kept: str = KEPT) -> EngineWatch:
        return cls(label, kept)

    # --- the driver's side ---

    def attach(self, llm) -> None:
        """The engine is up: its cores are vLLM's process manager's list (plus any seen starting)."""
        manager = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None),
                          "engine_manager", None)
        for p in list(getattr(manager, "processes", []) or []):
            if p.pid is not None:
                self._cores.setdefault(p.pid, p)
        self._attached = True

    @property
    def dead(self) -> bool:
        return self.message is not None

    def check(self) -> None:
        if self.message is not None:
            raise EngineDied(self.message)

    def confirm(self, within_s: float = 1.0) -> bool:
        """Whether the engine is dead, given the thread within_s to notice (vLLM's own checks can
        see a death a moment before the watch does)."""
        deadline = time.monotonic() + within_s
        while self.message is None and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.02)
        return self.message is not None

    @contextlib.contextmanager
    def call(self, what: str, deadline_s: float | None = None):
        """A call into the engine: raises EngineDied if it is dead or dies (or, with a deadline,
        does not answer in time) meanwhile."""
        outer = self._call
        self._call = (what, None if deadline_s is None else time.monotonic() + deadline_s)
        self._depth += 1
        try:
            self.check()
            yield
        except EngineDied:
            raise
        except Exception as e:  # vLLM's own view of the death (EngineDeadError, a failed startup)
            stopping = str(e) == SHUTTING_DOWN
            if self.confirm(STOPPING_S if stopping else 1.0):
                raise EngineDied(self.message) from e
            if type(e).__name__ == "EngineDeadError":
                raise EngineDied(f"{self.label} died ({e}); {self.kept}") from e
            if stopping:
                raise EngineDied(f"{self.label} is shutting down (something other than vx stopped it); "
                                 f"{self.kept}") from e
            raise
        finally:
            self._depth -= 1
            self._call = outer
        self.check()

    def guard(self, obj):
        """obj with every method called inside call(name)."""
        return _Guarded(obj, self)

    def close(self) -> None:
        """Stop watching (the driver stops the engine itself now). After a death, what is left of
        the engine's processes (its workers) is killed."""
        self._stop.set()
        if not self.dead and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self._main and threading.current_thread() is threading.main_thread():
            signal.signal(WAKE, self._old_handler or signal.SIG_DFL)
            self._main = None
        if self.dead:
            for pid, start in self._workers.items():
                if (st := _stat(pid)) is not None and st[2] == start:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    def _on_wake(self, signum, frame) -> None:
        if self._depth and (self.message or self._late):
            raise EngineDied(self.message or self._late)

    # --- the watching thread ---

    def _run(self) -> None:
        last_scan = 0.0
        while not self._stop.is_set():
            if not self._attached:
                for p in _mp_children() - self._before:
                    if p.pid is not None and p.pid not in self._ended:
                        self._cores.setdefault(p.pid, p)
            cores = list(self._cores.items())
            sentinels = {}
            for pid, p in cores:
                with contextlib.suppress(ValueError, AttributeError):
                    sentinels[p.sentinel] = (pid, p)
            ready = multiprocessing.connection.wait(list(sentinels), timeout=TICK_S) if sentinels else []
            if not sentinels:
                self._stop.wait(TICK_S)
            if self._stop.is_set():
                return
            now = time.monotonic()
            if not ready and now - last_scan >= SCAN_S:
                last_scan = now
                self._scan_workers()
            dead_worker = next((pid for pid, start in list(self._workers.items())
                                if (st := _stat(pid)) is None or st[1] in ("Z", "X") or st[2] != start), None)
            if dead_worker is not None and not ready and sentinels:
                # a worker dies with its core (it asks the kernel to): name the core if that is what died
                ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if ready:
                pid, p = sentinels[ready[0]]
                code = self._exitcode(p)
                if not self._attached and code is not None and code >= 0:
                    # the core ended its start on the stop (Ctrl-C to the group reaches it too), and the
                    # stop broke vLLM's own wait for it: vLLM then waits on a socket nothing will answer
                    # (campaign seed 65, trial 25: no exit in 60 s). The driver leaves (_leave_start).
                    # Without a stop, a start that failed: vLLM raises it with its cause (in the engine's
                    # log), unless its handshake was done: its next call (LLMEngine.__init__'s
                    # reset_mm_cache) then waits on the gone core for ever (SIGINT to the core alone as it
                    # started: campaign seed 66, trial 136). Past START_FAILED_S, the watch says so.
                    self._cores.pop(pid, None)
                    self._ended.add(pid)
                    if not stop_requested() and self._start_failed is None:
                        self._start_failed = (now, f"{self.label} (pid {pid}) died as it started: {how_it_ended(code)}")
                    continue
                return self._lost(f"{self.label} (pid {pid}) died: {how_it_ended(code)}")
            if dead_worker is not None and self._start_failed is None:  # (its core's end said first)
                return self._lost(f"{self.label}'s worker process (pid {dead_worker}) died")
            call = self._call
            starting = call and call[0] == "start" and self._depth
            if starting and stop_requested():
                self._leave_start(now)
            elif starting and self._start_failed and now - self._start_failed[0] > START_FAILED_S:
                return self._lost(self._start_failed[1])
            if call and call[1] is not None and now > call[1] and self._depth:
                self._late = f"{self.label} did not answer {call[0]} in time"
                self._wake()

    def _leave_start(self, now: float) -> None:
        """Ctrl-C or SIGTERM while vLLM starts the engine. vLLM (0.32, 0.33) catches the
        KeyboardInterrupt in its handshake (`zmq_socket_ctx`) and goes on to wait for the engine's
        ready message on its own socket, which a half-done handshake may never bring (up to
        VLLM_ENGINE_READY_TIMEOUT_S): the fault campaign's seed 54 (one-pass, a signal as the
        capture engine started: no exit in 60 s). The start's own path (start_watched) gets
        STOP_START_S; then the engine's processes are killed and the driver leaves with the
        interrupted line and code (nothing of this run is written yet: its engine never started)."""
        if self._stopped_at is None:
            self._stopped_at = now
            return
        if now - self._stopped_at < STOP_START_S:
            return
        for core in list(self._cores):
            for pid in [*descendants(core), core]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        from vx.engine.lifetime.logs import stderr_to_terminal

        stderr_to_terminal()
        exit_interrupted()

    def _scan_workers(self) -> None:
        """The cores' own children titled as vLLM workers. Not their descendants: a process a
        worker forks carries the worker's title until it execs (a tensor-parallel run's rerun
        once took such a short-lived child for a worker, then its exit for the worker's death)."""
        for core in list(self._cores):
            for pid, start in descendants(core).items():
                if pid not in self._workers and _title(pid).startswith(WORKER_TITLE) and \
                        (st := _stat(pid)) is not None and st[0] == core:
                    self._workers[pid] = start

    @staticmethod
    def _exitcode(p) -> int | None:
        """vLLM's own monitor may reap the process first; its Popen then holds the code."""
        for _ in range(20):
            try:
                code = p.exitcode
            except ValueError:  # closed by vLLM's shutdown
                return None
            if code is not None:
                return code
            time.sleep(0.025)
        return None

    def _lost(self, what: str) -> None:
        self.message = f"{what}; {self.kept}"
        self._wake()
        if not self._stop.wait(self.grace_s):  # backstop: the driver did not get to close()
            exit_now(EngineDied(self.message))

    def _wake(self) -> None:
        if self._main and self._depth:
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_kill(self._main, WAKE)


def start_watched(make, kept: str = KEPT):
    """(make()'s LLM, its EngineWatch): the watch begins before the engine's processes start.
    vLLM (0.32, 0.33) waits for its engines' handshake in `zmq_socket_ctx`, which returns on a
    KeyboardInterrupt: Ctrl-C or SIGTERM as the engine started came back as an engine started and
    the run went on (campaign seed 50, trial 119). Here the engine stops and the stop goes on up."""
    watch = EngineWatch.begin(kept=kept)
    try:
        with watch.call("start"):
            llm = make()
    except BaseException:
        watch.close()
        raise
    startup_over()  # the engine is up: this process's start-up is over (vx.errors.quiet_startup)
    if stop_requested():
        from vx.engine.vllm_engine import stop_engine

        with contextlib.suppress(Exception):
            stop_engine(llm.llm_engine, watch)
        raise KeyboardInterrupt
    watch.attach(llm)
    return llm, watch


class _Guarded:
    """A vLLM object (LLM, LLMEngine) whose method calls are watched calls."""

    def __init__(self, obj, watch: EngineWatch):
        self._obj, self._watch = obj, watch

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr
        watch = self._watch

        def watched(*args, **kwargs):
            with watch.call(name):
                return attr(*args, **kwargs)

        return watched
