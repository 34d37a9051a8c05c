"""Starting workers by forking them from a pre-imported template ("zygote") process.

A fresh Python worker that imports torch spends seconds importing it, on the first start
and on every restart. ``TemplateStarter`` pays that once per agent: it starts one
template interpreter (:mod:`elastrun.worker.zygote`) that imports the modules the
workers need and then waits; every worker is forked from it in milliseconds and then runs
exactly as ``python -m elastrun.worker.bootstrap`` would have run it.

The workers stay the agent's children (the agent is a child subreaper while a worker is
handed over, see the zygote's docstring), so everything the agent does with a worker --
its pidfd, ``waitid`` without reaping, ``killpg``, ``waitpid`` for the real exit status,
the parent-death signal, the orphan guard -- works as with ``SubprocessStarter``.

Only Python script workers go through the template: an argv of the form
``(python, [OPTS], "-m", "elastrun.worker.bootstrap", ...)`` whose ``python`` is the
starter's interpreter. Anything else (other executables, function workers) goes to the
fallback starter, and so does every worker when the template is unusable -- a preloaded
module started a thread or initialised CUDA, the template could not start, or a fork
failed -- with one warning line saying why. A template that died is started again on the
next start.

Templates are keyed by the interpreter options and the environment minus the per-worker
variables: modules imported in the template read the environment at import time, so a
template serves only workers whose shared environment is the one it was started with.
The template's environment has one variable more, first: ``TITLE_ROOM``, room in its
memory for the command lines its workers show (see the zygote's ``_retitle``), sized for
the workers it is started for.
"""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from elastrun.core.errors import ElastrunError, ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.supervise.processes.spawn import (
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
    WorkerProcess,
    _Handle,
    _waitpid_nohang,
    set_parent_death_signal,
)
from elastrun.worker.zygote import (
    PROTOCOL_VERSION,
    TITLE_ROOM,
    ZYGOTE_MODULE,
    recv_message,
    send_message,
)

log = logging.getLogger(__name__)

BOOTSTRAP_MODULE = "elastrun.worker.bootstrap"

#: Modules preloaded automatically when a worker script imports them at top level.
#: Both are known to import without starting threads or touching a GPU.
AUTO_PRELOAD_ROOTS = ("torch", "numpy")
#: What torch imports only on first use of a name, worth preloading when a script that
#: imports torch uses it: DistributedDataParallel's first construction imports
#: torch._dynamo (and sympy), seconds per new worker on every restart.
LAZY_TORCH_IMPORTS = {"DistributedDataParallel": "torch._dynamo"}

#: Variables that differ between the workers of one node or between restarts (and every
#: ``TORCHELASTIC_*`` one). They are not part of the template's own environment (a worker
#: gets its complete environment when it is forked), so one template serves every worker
#: and every restart. Any other difference starts a new template.
PER_WORKER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        # Per-rank files under the attempt's log directory.
        "ELASTRUN_STACKS_FILE",
        # Each worker's progress record (the file is the agent's, the same for all).
        "ELASTRUN_PROGRESS_SLOT",
        # Read by CUDA when it initialises, which the template never does; it differs
        # per worker with --virtual-local-rank.
        "CUDA_VISIBLE_DEVICES",
    }
)


def is_per_worker_variable(name: str, extra: Collection[str] = ()) -> bool:
    """Whether ``name`` may differ between the workers served by one template."""
    return name in PER_WORKER_VARIABLES or name in extra or name.startswith("TORCHELASTIC_")


# Interpreter options that take a separate value (``-W error``, ``-X dev``).
_OPTS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})
# Preloading torch takes seconds; on a loaded 2-core machine many more.
_READY_TIMEOUT = 300.0
# A fork of a large template takes milliseconds; this only ends a wedged template.
_SPAWN_TIMEOUT = 30.0
_STOP_TIMEOUT = 5.0
# Scripts larger than this are not scanned for imports (a generated file, not a script).
_MAX_SCAN_BYTES = 4 * 1024 * 1024
# Room for workers' command lines beyond the one the template is started for (see
# TITLE_ROOM); a longer one is shown cut.
_TITLE_MARGIN = 256

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class _TemplateUnavailable(ElastrunError):
    """The template cannot be used (unsafe preload, failed to start); the reason."""


class _TemplateBroken(ElastrunError):
    """The template died or stopped answering in the middle of a request."""


class _SpawnRefused(ElastrunError):
    """The template could not start this one worker (fork failed, bad cwd, ...)."""


@dataclass(frozen=True)
class BootstrapCommand:
    """A worker argv that the template can run: interpreter options and bootstrap args."""

    options: tuple[str, ...]
    args: tuple[str, ...]  # what follows ``-m elastrun.worker.bootstrap``


def parse_bootstrap_command(argv: Sequence[str], python: str) -> BootstrapCommand | None:
    """Split ``(python, [OPTS], "-m", BOOTSTRAP, ARGS...)``; None for any other argv.

    ``argv[0]`` must be ``python`` (the same file, after resolving links).
    """
    if len(argv) < 4 or not _same_file(argv[0], python):
        return None
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        if argv[i] in ("-c", "-"):
            return None
        i += 2 if argv[i] in _OPTS_WITH_VALUE else 1
    if tuple(argv[i : i + 2]) != ("-m", BOOTSTRAP_MODULE):
        return None
    args = tuple(argv[i + 2 :])
    if not args:
        return None
    return BootstrapCommand(tuple(argv[1:i]), args)


def _same_file(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except OSError:
        return False


def default_preload(argv: Sequence[str], cwd: str | None = None) -> list[str]:
    """The modules worth preloading for a worker: those of ``AUTO_PRELOAD_ROOTS`` that
    the worker's script imports outside functions and classes, in the script's order.

    ``argv`` is the worker's argv (``python ... -m elastrun.worker.bootstrap SCRIPT``
    or ``... -m MODULE``); a module is looked up as ``MODULE.py`` or
    ``MODULE/__main__.py`` under ``cwd``. Anything that cannot be read or parsed gives
    an empty list: preloading is an optimisation, never a reason to fail.
    """
    cmd = parse_bootstrap_command(argv, argv[0]) if argv else None
    if cmd is None:
        return []
    base = os.getcwd() if cwd is None else cwd
    if cmd.args[0] == "-m":
        if len(cmd.args) < 2:
            return []
        rel = cmd.args[1].replace(".", os.sep)
        candidates = [rel + ".py", os.path.join(rel, "__main__.py")]
    else:
        candidates = [cmd.args[0]]
    for candidate in candidates:
        path = os.path.join(base, candidate)
        if os.path.isfile(path):
            return _scan_imports(path)
    return []


def _name_of(node: ast.AST) -> str | None:
    """The name a node uses: ``x``, ``a.x`` and ``import a.x as y`` all use ``x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.alias):
        return node.name.rpartition(".")[2]
    return None


def _scan_imports(path: str) -> list[str]:
    try:
        if os.path.getsize(path) > _MAX_SCAN_BYTES:
            return []
        with open(path, "rb") as fh:
            tree = ast.parse(fh.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []

    def visit(body: Sequence[ast.stmt]) -> None:
        for node in body:
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                # if/try/with blocks at module level run at import time too.
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        visit([n for n in inner if isinstance(n, ast.stmt)])
                        for handler in inner:
                            if isinstance(handler, ast.ExceptHandler):
                                visit(handler.body)
            for name in names:
                if name.split(".")[0] in AUTO_PRELOAD_ROOTS and name not in found:
                    found.append(name)

    visit(tree.body)
    if any(name.split(".")[0] == "torch" for name in found):
        used = {_name_of(n) for n in ast.walk(tree)}
        found += [
            mod for name, mod in LAZY_TORCH_IMPORTS.items() if name in used and mod not in found
        ]
    return found


@contextmanager
def _adopting_orphans() -> Iterator[None]:
    """Make this process a child subreaper for the duration of a worker hand-over.

    Only for the hand-over: a permanent subreaper would also inherit every orphaned
    grandchild of every worker (data loader processes, compilers) and keep them as
    zombies, since nothing else in the agent would reap them.
    """
    libc = _libc()
    previous = ctypes.c_int(0)
    if libc is None or libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0):
        yield
        return
    if not previous.value:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        if not previous.value:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


_LIBC: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:  # pragma: no cover - every Linux libc has prctl
            _LIBC.append(None)
    return _LIBC[0]


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _umask() -> int:
    # /proc says it without the set-and-restore dance of os.umask, which would race
    # with other threads creating files.
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _ignored_signals() -> list[int]:
    """Signals this process ignores, which ``exec`` passes on to a fresh worker."""
    out = []
    for sig in signal.valid_signals():
        # Popen resets these to the default before exec; python then ignores them.
        if sig in (signal.SIGPIPE, signal.SIGXFSZ):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.append(int(sig))
        except ValueError:
            pass
    return out


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class _TemplateKey:
    options: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    @staticmethod
    def of(cmd: BootstrapCommand, env: Mapping[str, str], extra: Collection[str]) -> _TemplateKey:
        shared = sorted((k, v) for k, v in env.items() if not is_per_worker_variable(k, extra))
        return _TemplateKey(cmd.options, tuple(shared))


def _describe_change(old: _TemplateKey, new: _TemplateKey) -> str:
    if old.options != new.options:
        return f"interpreter options {list(old.options)} -> {list(new.options)}"
    before, after = dict(old.env), dict(new.env)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return f"variables {shown}"


class _Template:
    """One running template process and the agent's end of its control channel."""

    def __init__(
        self,
        key: _TemplateKey,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        stderr: IO[bytes],
    ) -> None:
        self.key = key
        self.proc = proc
        self._sock = sock
        self._stderr = stderr
        self.preloaded: list[str] = []
        self.ready_seconds = 0.0
        self._started = time.monotonic()
        self._ready = False

    @classmethod
    def launch(
        cls,
        python: str,
        key: _TemplateKey,
        preload: Sequence[str],
        optional: Sequence[str],
        worker_argv: Sequence[str] = (),
    ) -> _Template:
        """Start a template; it imports its modules while the caller goes on.

        ``worker_argv`` is the command line of the workers it is started for: their
        title needs room in the template's environment (see the zygote's ``_retitle``).

        Raises:
            _TemplateUnavailable: the interpreter could not be started.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stderr = tempfile.TemporaryFile(prefix="elastrun-template-")  # noqa: SIM115 - owned by the template object
        # Nothing more on the command line: a worker's title must be longer than it.
        argv = [python, *key.options, "-m", ZYGOTE_MODULE, str(theirs.fileno())]
        title = len(os.fsencode(" ".join(worker_argv)))
        # First in the environment: the memory right after the arguments.
        env = {TITLE_ROOM: " " * (title + _TITLE_MARGIN), **dict(key.env)}
        agent = os.getpid()
        try:
            with _adopting_orphans():
                # Started while the agent is a subreaper, so the kernel marks the
                # template's descendants as having one (older kernels do not mark
                # existing descendants when the flag is set later).
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,  # the terminal's Ctrl-C is for the agent
                    # Only prctl and getppid run between fork and exec.
                    preexec_fn=lambda: set_parent_death_signal(signal.SIGKILL, agent),  # noqa: PLW1509
                )
        except OSError as exc:
            ours.close()
            stderr.close()
            raise _TemplateUnavailable(f"cannot start {python!r}: {exc}") from exc
        finally:
            theirs.close()
        template = cls(key, proc, ours, stderr)
        setup = {"version": PROTOCOL_VERSION, "preload": list(preload), "optional": list(optional)}
        try:
            # A few bytes into an empty socket buffer: never blocks.
            send_message(ours, setup)
        except OSError:
            pass  # it died already; await_ready reports how
        return template

    @property
    def ready(self) -> bool:
        """Whether the hello was received (the modules are imported)."""
        return self._ready

    def await_ready(self, timeout: float, shutdown: ShutdownRequest | None = None) -> None:
        """Wait for the template's hello (once); a signal in ``shutdown`` ends the wait.

        Raises:
            _TemplateUnavailable: it died, did not answer in time, or reports that
                forking is unsafe.
            ShutdownRequested: a signal arrived while the template was starting.
        """
        if self._ready:
            return
        if shutdown is not None:
            self._wait_readable(timeout, shutdown)
        self._sock.settimeout(timeout)
        try:
            got = recv_message(self._sock)
        except (OSError, ConnectionError) as exc:
            raise _TemplateUnavailable(
                f"no answer from the template: {exc}{self._stderr_note()}"
            ) from exc
        if got is None:
            raise _TemplateUnavailable(
                f"the template ended during startup ({self._wait_description()})"
                f"{self._stderr_note()}"
            )
        hello, _ = got
        if hello.get("version") != PROTOCOL_VERSION:
            raise _TemplateUnavailable(f"template speaks protocol {hello.get('version')!r}")
        if "unsafe" in hello:
            raise _TemplateUnavailable(str(hello["unsafe"]))
        preloaded = hello.get("preloaded", [])
        self.preloaded = [str(m) for m in preloaded] if isinstance(preloaded, list) else []
        self.ready_seconds = time.monotonic() - self._started
        self._ready = True

    def _wait_readable(self, timeout: float, shutdown: ShutdownRequest) -> None:
        """Block until the template writes (or the timeout), unless a signal comes first:
        starting the template imports torch, seconds that a Ctrl-C must not wait for."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ, "template")
            sel.register(shutdown.waker.fileno(), selectors.EVENT_READ, "wake")
            while True:
                if shutdown.signum is not None:
                    raise ShutdownRequested(shutdown.signum)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return  # the read below times out and says so
                events = sel.select(remaining)
                if any(key.data == "template" for key, _ in events):
                    return
                # Other wake-ups (rendezvous news) are for the agent loop, which looks
                # at what changed on its next pass; only a signal matters here.
                shutdown.waker.drain()

    def _wait_description(self) -> str:
        try:
            self.proc.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        return self.exit_description()

    def stderr_tail(self, limit: int = 2000) -> str:
        """The end of what the template wrote to its stderr (import warnings, crashes)."""
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - limit))
            return self._stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""

    def _stderr_note(self) -> str:
        tail = self.stderr_tail()
        return f"; its stderr ends with: {tail.splitlines()[-1]}" if tail else ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_description(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def spawn(self, request: dict[str, object], fds: Sequence[int], timeout: float) -> int:
        """Ask for a worker; returns its pid (a child of this process by now).

        Raises:
            _TemplateBroken: the channel failed; the template should be discarded.
            _TemplateUnavailable: forking from the template has become unsafe.
            _SpawnRefused: the template could not start this worker.
        """
        self._sock.settimeout(timeout)
        try:
            with _adopting_orphans():
                send_message(self._sock, request, fds)
                got = recv_message(self._sock)
        except (OSError, ConnectionError) as exc:
            raise _TemplateBroken(str(exc) or type(exc).__name__) from exc
        if got is None:
            raise _TemplateBroken("the template closed the channel")
        reply, _ = got
        if "unsafe" in reply:
            raise _TemplateUnavailable(str(reply["unsafe"]))
        pid = reply.get("pid")
        if not isinstance(pid, int):
            raise _SpawnRefused(str(reply.get("error", f"unexpected reply {reply!r}")))
        return pid

    def close(self) -> None:
        """Stop the template (end of its channel; SIGKILL if it lingers) and reap it."""
        self._sock.close()
        if not self._ready:
            # Still importing its modules, it would notice the closed channel only when
            # done (seconds of torch's import): it has no workers and nothing to save.
            self.proc.kill()
        try:
            self.proc.wait(_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()

    def __repr__(self) -> str:
        state = self.exit_description() if self._ready else "starting"
        return f"_Template(pid={self.pid}, preloaded={self.preloaded}, {state})"


class TemplateStarter:
    """A ``ProcessStarter`` that forks Python workers from a pre-imported template.

    Args:
        python: the interpreter of the template; only workers started with this
            interpreter go through it.
        preload: modules the template imports (``--preload``), in order.
        fallback: the starter for everything the template does not start (default: a
            ``SubprocessStarter`` for ``python``).
        auto_preload: also preload what :func:`default_preload` finds in the script.
        per_worker_variables: more variables (beyond ``PER_WORKER_VARIABLES``) that
            differ between workers or restarts and must not start a new template.
        ready_timeout: how long the template may take to start and preload.
        spawn_timeout: how long one fork may take before the template counts as wedged.
        shutdown: the launcher's signal requests: a signal ends the wait for the
            template's start-up at once (``ShutdownRequested``).

    The template is started by the first ``start`` that needs it (constructing the
    starter does nothing) and stopped by ``close``.
    """

    def __init__(
        self,
        python: str = sys.executable,
        preload: Sequence[str] = (),
        fallback: ProcessStarter | None = None,
        *,
        auto_preload: bool = True,
        per_worker_variables: Iterable[str] = (),
        ready_timeout: float = _READY_TIMEOUT,
        spawn_timeout: float = _SPAWN_TIMEOUT,
        shutdown: ShutdownRequest | None = None,
    ) -> None:
        self._shutdown = shutdown
        self._python = python
        self._preload = list(dict.fromkeys(preload))
        self._fallback: ProcessStarter = (
            fallback if fallback is not None else SubprocessStarter(python)
        )
        self._auto = auto_preload
        self._per_worker = frozenset(per_worker_variables)
        self._ready_timeout = ready_timeout
        self._spawn_timeout = spawn_timeout
        self._template: _Template | None = None
        self._unusable: dict[_TemplateKey, str] = {}
        self._closed = False
        #: How many workers were forked from a template / handed to the fallback.
        self.forked = 0
        self.fell_back = 0
        #: How many templates were started (the first, and one per recreation).
        self.templates_started = 0

    @property
    def template_pid(self) -> int | None:
        """The running template's pid, if one is running."""
        tpl = self._template
        return tpl.pid if tpl is not None and tpl.alive() else None

    @property
    def unusable_reason(self) -> str | None:
        """Why the last template could not be used, if it could not."""
        return next(reversed(self._unusable.values()), None)

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        """Start one worker: forked from the template when it can be, else the fallback.

        Raises:
            ProcessStartError: from the fallback starter, as it would raise it.
        """
        cmd = None
        if spec.argv is not None and not self._closed:
            cmd = parse_bootstrap_command(spec.argv, self._python)
        if cmd is None:
            return self._use_fallback(spec)
        assert spec.argv is not None
        cwd = spec.cwd if spec.cwd is not None else os.getcwd()
        tpl = self._ready_template(_TemplateKey.of(cmd, spec.env, self._per_worker), spec.argv, cwd)
        if tpl is None:
            return self._use_fallback(spec)
        try:
            pid = self._spawn(tpl, spec, cmd, cwd)
        except _TemplateBroken as exc:
            log.warning(
                "worker template (pid %d) failed while starting local rank %d (%s; %s); "
                "starting it as a fresh process",
                tpl.pid,
                spec.local_rank,
                exc,
                tpl.exit_description(),
            )
            self._discard()
            return self._use_fallback(spec)
        except _TemplateUnavailable as exc:
            self._disable(tpl.key, str(exc))
            self._discard()
            return self._use_fallback(spec)
        except _SpawnRefused as exc:
            log.warning(
                "worker template could not start local rank %d (%s); "
                "starting it as a fresh process",
                spec.local_rank,
                exc,
            )
            return self._use_fallback(spec)
        self.forked += 1
        return _Handle(spec.local_rank, pid, os.pidfd_open(pid), _waitpid_nohang(pid))

    def _use_fallback(self, spec: ProcessSpec) -> WorkerProcess:
        self.fell_back += 1
        return self._fallback.start(spec)

    def prepare(self, spec: ProcessSpec) -> None:
        """Start the template ``spec``'s worker would use, without waiting for it.

        Optional: calling it early (before the rendezvous) overlaps the template's
        imports with the wait for other nodes. Never raises for template problems;
        the next ``start`` reports them.
        """
        if spec.argv is None or self._closed:
            return
        cmd = parse_bootstrap_command(spec.argv, self._python)
        if cmd is not None:
            cwd = spec.cwd if spec.cwd is not None else os.getcwd()
            self._template_for(_TemplateKey.of(cmd, spec.env, self._per_worker), spec.argv, cwd)

    def _ready_template(self, key: _TemplateKey, argv: Sequence[str], cwd: str) -> _Template | None:
        tpl = self._template_for(key, argv, cwd)
        if tpl is None or tpl.ready:
            return tpl
        try:
            tpl.await_ready(self._ready_timeout, self._shutdown)
        except _TemplateUnavailable as exc:
            self._disable(key, str(exc))
            self._discard()
            return None
        log.info(
            "worker template pid %d ready in %.2fs (preloaded: %s)",
            tpl.pid,
            tpl.ready_seconds,
            ", ".join(tpl.preloaded) or "nothing",
        )
        return tpl

    def _disable(self, key: _TemplateKey, reason: str) -> None:
        self._unusable[key] = reason
        log.warning("worker template disabled (%s); starting workers as fresh processes", reason)

    def _template_for(self, key: _TemplateKey, argv: Sequence[str], cwd: str) -> _Template | None:
        """The live template for ``key``, launched (not awaited) when there is none."""
        if key in self._unusable:
            return None
        tpl = self._template
        if tpl is not None and tpl.key != key:
            log.info(
                "the workers' shared environment changed (%s); replacing the worker template",
                _describe_change(tpl.key, key),
            )
            self._discard()
            tpl = None
        if tpl is not None and tpl.ready and not tpl.alive():
            log.warning(
                "worker template (pid %d) died (%s); starting a new one",
                tpl.pid,
                tpl.exit_description(),
            )
            self._discard()
            tpl = None
        if tpl is not None:
            return tpl
        optional = default_preload(argv, cwd) if self._auto else []
        try:
            tpl = _Template.launch(self._python, key, self._preload, optional, argv)
        except _TemplateUnavailable as exc:
            self._disable(key, str(exc))
            return None
        self._template = tpl
        self.templates_started += 1
        return tpl

    def _spawn(self, tpl: _Template, spec: ProcessSpec, cmd: BootstrapCommand, cwd: str) -> int:
        assert spec.argv is not None
        wanted = (
            0,
            spec.stdout_fd if spec.stdout_fd is not None else 1,
            spec.stderr_fd if spec.stderr_fd is not None else 2,
        )
        # The agent's own stdin/stdout/stderr stand in for "inherit", as with Popen;
        # a closed one stays closed in the worker.
        present = [_is_open(fd) for fd in wanted]
        request: dict[str, object] = {
            "version": PROTOCOL_VERSION,
            "argv": list(spec.argv),
            "bootstrap_args": list(cmd.args),
            "env": dict(spec.env),
            "cwd": cwd,
            "umask": _umask(),
            "agent_pid": os.getpid(),
            "death_signal": int(spec.death_signal),
            "ignored_signals": _ignored_signals(),
            "blocked_signals": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "stdio": present,
            # Its NUMA binding, else what a fresh process would inherit from the agent now.
            "cpus": sorted(spec.cpus or os.sched_getaffinity(0)),
        }
        fds = [fd for fd, ok in zip(wanted, present, strict=True) if ok]
        pid = tpl.spawn(request, fds, self._spawn_timeout)
        if _parent_of(pid) != os.getpid():
            # Not handed to us (no subreaper support?): it exits by itself on seeing
            # that, and cannot be supervised.
            raise _SpawnRefused(f"worker pid {pid} was not adopted by the agent")
        return pid

    def _discard(self) -> None:
        tpl, self._template = self._template, None
        if tpl is not None:
            tpl.close()

    def close(self) -> None:
        """Stop the template. Idempotent; workers already started are not affected."""
        self._closed = True
        self._discard()

    def __enter__(self) -> TemplateStarter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tpl = self._template
        state = "closed" if self._closed else (repr(tpl) if tpl is not None else "no template")
        return (
            f"TemplateStarter(python={self._python!r}, preload={self._preload}, {state}, "
            f"forked={self.forked}, fell_back={self.fell_back})"
        )
