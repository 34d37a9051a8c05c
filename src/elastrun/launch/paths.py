"""Paths the launcher will write to, checked before anything starts.

A log directory or an event log that cannot be written is found here, not as a
traceback when the first worker starts: the path must be writable, or creatable under
its nearest existing ancestor. The write probe is an anonymous temporary file.
"""

from __future__ import annotations

import os
import tempfile

from elastrun.core.errors import ConfigError

__all__ = ["check_fifo_path", "check_log_dir", "check_writable_file"]


def _nearest_existing(full: str) -> str:
    existing = full
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def _probe_dir(directory: str, source: str, shown: str, where: str) -> None:
    """``directory`` accepts a new file: by ``os.access`` *and* by a real write.

    Both, because root passes ``os.access`` everywhere, yet cannot write in a
    read-only mount or in ``/proc``; and ``os.access`` alone gives the clearer message.
    """
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(source, shown, f"{where}: permission denied")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise ConfigError(source, shown, f"{where}: {exc.strerror or exc}") from exc


def check_log_dir(path: str, source: str = "--log-dir") -> None:
    """Refuse a log directory that cannot hold the run's logs.

    It must be a directory this process can write in, or one that can be made: its
    nearest existing ancestor is a writable directory.

    Raises:
        ConfigError: naming ``source`` and ``path``.
    """
    full = os.path.abspath(path)
    existing = _nearest_existing(full)
    if not os.path.isdir(existing):
        if existing == full:
            raise ConfigError(source, path, "exists and is not a directory")
        raise ConfigError(source, path, f"cannot be made: {existing} is not a directory")
    where = "is not writable" if existing == full else f"cannot be made in {existing}"
    _probe_dir(existing, source, path, where)


def check_writable_file(path: str, source: str, shown: str | None = None) -> None:
    """Refuse a file that cannot be appended to, or made (with its directories).

    Raises:
        ConfigError: naming ``source`` and ``shown`` (default: ``path``).
    """
    value = path if shown is None else shown
    full = os.path.abspath(path)
    existing = _nearest_existing(full)
    if existing == full:
        if os.path.isdir(full):
            raise ConfigError(source, value, f"{path} is a directory, not a file")
        if not os.access(full, os.W_OK):
            raise ConfigError(source, value, f"{path} is not writable")
        return
    if not os.path.isdir(existing):
        raise ConfigError(source, value, f"cannot be made: {existing} is not a directory")
    _probe_dir(existing, source, value, f"cannot be made in {existing}")


def check_fifo_path(path: str, source: str) -> None:
    """Refuse a FIFO path that cannot be made: ``mkfifo`` makes no parent directory, and
    an existing file there is replaced (as torch does), a directory cannot be.

    Raises:
        ConfigError: naming ``source`` and ``path``.
    """
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise ConfigError(source, path, f"{path} is a directory")
    if not os.path.isdir(parent):
        raise ConfigError(source, path, f"cannot be made: {parent} is not a directory")
    _probe_dir(parent, source, path, f"cannot be made in {parent}")
