"""Native thread pools that start when their library loads, made safe for the template.

OpenBLAS (numpy's bundled copy, and torch's on some builds) starts its pool of
``N - 1`` threads in its load-time constructor, ``N`` being the first positive
``OPENBLAS_NUM_THREADS``, ``GOTO_NUM_THREADS`` or ``OMP_NUM_THREADS``, else the number
of usable CPUs. So ``import torch`` (which imports numpy) starts threads unless one of
those variables is 1, and a process with threads must not fork: a worker forked while
another thread held a lock would wait on it forever. That is why the worker template
used to give up on one worker per node (elastrun sets ``OMP_NUM_THREADS=1`` only for
more) and on every user who chose their own thread counts.

The template therefore imports with ``OPENBLAS_NUM_THREADS=1`` (:func:`quiet_for_import`,
undone in its own environment right after), and each worker, once it has its own
environment and CPU affinity, grows every loaded OpenBLAS pool to the size that library
would have chosen on its own in a fresh interpreter started with that environment and
affinity (:func:`resize_for_worker`). ``openblas_set_num_threads`` starts the missing
threads at once, as the load-time constructor would have, so the worker's threads are a
fresh process's. Libraries that start their pools lazily (OpenMP, MKL, torch's own pools)
read the worker's environment when the worker first uses them, and need nothing, with
one exception: the OpenMP runtime (libgomp, and Intel's or LLVM's) reads
``OMP_NUM_THREADS`` when it loads and, when that is unset, counts the CPUs the process
may run on *then*. A worker bound to fewer CPUs than the template (``--numa-binding``)
would inherit the template's count, and torch would use as many threads; so that default
is set again from the worker's own affinity (:func:`resize_for_worker`).

Why not threadpoolctl: it finds the libraries and sets a pool's size, but it cannot
tell the size a library would have chosen by itself, which is the point here; and the
library lookup it would replace is a scan of ``/proc/self/maps``. Nothing here may add
to every worker's start-up beyond a few system calls.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterator, Mapping

#: What the template sets while it imports: OpenBLAS reads it first and then starts no
#: thread. (GOTO_NUM_THREADS and OMP_NUM_THREADS come after it in OpenBLAS's order.)
QUIET = {"OPENBLAS_NUM_THREADS": "1"}

# OpenBLAS's order: its own variables first (the first positive one wins), then OpenMP's.
_OWN_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
_OMP_VARIABLE = "OMP_NUM_THREADS"
# Builds name the setter with a prefix (numpy's bundled copy: scipy_) and, for 64-bit
# integer interfaces, a suffix.
_PREFIXES = ("", "scipy_")
_SUFFIXES = ("", "64_")
_OPENBLAS_FILE = re.compile(r"openblas", re.IGNORECASE)
_OPENMP_FILE = re.compile(r"^lib(gomp|iomp5|omp)\b")
# OMP_NUM_THREADS as OpenMP runtimes accept it: a list of positive counts, one a level.
_OMP_LIST = re.compile(r"^\s*([1-9]\d*)\s*(,\s*[1-9]\d*\s*)*$")


def quiet_for_import(environ: dict[str, str] | os._Environ[str]) -> dict[str, str | None]:
    """Set :data:`QUIET` in ``environ`` (the template's, before its imports); returns
    the previous values for :func:`restore`."""
    previous = {name: environ.get(name) for name in QUIET}
    environ.update(QUIET)
    return previous


def restore(environ: dict[str, str] | os._Environ[str], previous: Mapping[str, str | None]) -> None:
    """Undo :func:`quiet_for_import`."""
    for name, value in previous.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def _atoi(text: str | None) -> int:
    """C's ``atoi``, as OpenBLAS reads its variables: leading blanks, a sign, digits;
    anything else ends the number (``"4,2"`` is 4, ``"x"`` is 0)."""
    if text is None:
        return 0
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0


def openblas_default_threads(env: Mapping[str, str], cpus: int, most: int | None = None) -> int:
    """The pool size OpenBLAS picks when it loads in a process with ``env`` and
    ``cpus`` usable CPUs; ``most``: the build's ``MAX_THREADS``, if known."""
    counts = (_atoi(env.get(name)) for name in (*_OWN_VARIABLES, _OMP_VARIABLE))
    wanted = next((n for n in counts if n > 0), cpus)
    return max(1, min(wanted, cpus, cpus if most is None else most))


def openmp_default_threads(env: Mapping[str, str], cpus: int) -> int | None:
    """The default team size an OpenMP runtime loaded with ``env`` and ``cpus`` usable
    CPUs starts with, when it depends on the CPUs (None: ``OMP_NUM_THREADS`` says it)."""
    return None if _OMP_LIST.match(env.get(_OMP_VARIABLE, "")) else max(1, cpus)


def _loaded(pattern: re.Pattern[str]) -> Iterator[str]:
    """The paths of the shared libraries mapped into this process whose file name
    matches ``pattern``."""
    seen = set()
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5]
        if path in seen or not path.startswith("/"):
            continue
        if pattern.search(os.path.basename(path)) and ".so" in path:
            seen.add(path)
            yield path


class _OpenBlas:
    """One loaded OpenBLAS library's thread-count functions."""

    def __init__(self, lib: ctypes.CDLL, prefix: str, suffix: str) -> None:
        self._get = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}")
        self._get.restype, self._get.argtypes = ctypes.c_int, []
        self._set = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}")
        self._set.restype, self._set.argtypes = None, [ctypes.c_int]
        self._config = getattr(lib, f"{prefix}openblas_get_config{suffix}", None)
        if self._config is not None:
            self._config.restype, self._config.argtypes = ctypes.c_char_p, []

    @staticmethod
    def of(path: str) -> _OpenBlas | None:
        """The library at ``path`` (already loaded), if it is an OpenBLAS."""
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            return None
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                try:
                    return _OpenBlas(lib, prefix, suffix)
                except AttributeError:
                    continue
        return None

    def threads(self) -> int:
        return int(self._get())

    def set_threads(self, n: int) -> None:
        self._set(n)

    def max_threads(self) -> int | None:
        """The build's ``MAX_THREADS`` (its configuration string says it)."""
        if self._config is None:
            return None
        config = self._config() or b""
        match = re.search(rb"MAX_THREADS=(\d+)", config)
        return int(match.group(1)) if match else None

    def __repr__(self) -> str:
        return f"_OpenBlas(threads={self.threads()})"


def _set_openmp_default(path: str, size: int) -> bool:
    """Set the default team size of the OpenMP runtime at ``path``; False if it is none."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
    except (OSError, AttributeError):
        return False
    get.restype, get.argtypes = ctypes.c_int, []
    put.restype, put.argtypes = None, [ctypes.c_int]
    if get() != size:
        put(size)
    return True


def _loaded_openblas() -> Iterator[str]:
    """The paths of the OpenBLAS libraries mapped into this process."""
    return _loaded(_OPENBLAS_FILE)


def _libraries() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The paths of the OpenMP and the OpenBLAS libraries mapped into this process."""
    return tuple(_loaded(_OPENMP_FILE)), tuple(_loaded_openblas())


# The libraries found by ``remember_libraries`` in the template: (OpenMP, OpenBLAS).
_REMEMBERED: tuple[tuple[str, ...], tuple[str, ...]] | None = None


def remember_libraries() -> None:
    """Find the OpenMP and OpenBLAS libraries now (in the template, after its imports),
    so that each forked worker does not scan ``/proc/self/maps`` again on its start."""
    global _REMEMBERED
    _REMEMBERED = _libraries()


def resize_for_worker(env: Mapping[str, str]) -> dict[str, int]:
    """Give each loaded OpenBLAS pool, and each OpenMP runtime's default team, the size
    a fresh interpreter with ``env`` and this process's CPU affinity would have; returns
    the sizes set, by library path."""
    openmp, openblas = _REMEMBERED or _libraries()
    cpus = len(os.sched_getaffinity(0))
    done = {}
    team = openmp_default_threads(env, cpus)
    if team is not None:
        for path in openmp:
            if _set_openmp_default(path, team):
                done[path] = team
    for path in openblas:
        blas = _OpenBlas.of(path)
        if blas is None:
            continue
        size = openblas_default_threads(env, cpus, blas.max_threads())
        if blas.threads() != size:
            blas.set_threads(size)
        done[path] = size
    return done
