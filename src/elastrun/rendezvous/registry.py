"""Rendezvous backends by name.

Built-in backends are a lazy name -> "module:factory" map: nothing is imported until a
backend is chosen. Third-party backends register in code (``register``) or through the
entry-point groups ``elastrun.rendezvous`` (the object is the creator) and
``torchrun.handlers`` (torch's convention: the object is called with no arguments and
returns the creator).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from elastrun.core.errors import ConfigError
from elastrun.rendezvous.api import RendezvousHandler, RendezvousParameters

RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]

BUILTIN_BACKENDS: dict[str, str] = {
    "c10d": "elastrun.rendezvous.c10d:create_c10d_handler",
    "static": "elastrun.rendezvous.c10d:create_static_handler",
    "etcd": "elastrun.rendezvous.etcd:create_etcd_handler",
    "etcd-v2": "elastrun.rendezvous.etcd:create_etcd_v2",
}
#: The built-in backends' parameter checks: what the creator would refuse, found without
#: connecting, serving or starting anything (reading a token or TLS file at most).
BUILTIN_CHECKS: dict[str, str] = {
    "c10d": "elastrun.rendezvous.c10d:parse_c10d_conf",
    "static": "elastrun.rendezvous.c10d:parse_static_conf",
    "etcd": "elastrun.rendezvous.etcd:parse_etcd_conf",
    "etcd-v2": "elastrun.rendezvous.etcd:create_etcd_v2",  # refuses, always
}
ENTRY_POINT_GROUP = "elastrun.rendezvous"
TORCH_ENTRY_POINT_GROUP = "torchrun.handlers"


def _load(target: str) -> RendezvousHandlerCreator:
    module, _, attr = target.partition(":")
    creator: RendezvousHandlerCreator = getattr(importlib.import_module(module), attr)
    return creator


class RendezvousHandlerRegistry:
    """Maps backend names to handler creators."""

    def __init__(self) -> None:
        self._creators: dict[str, RendezvousHandlerCreator] = {}
        self._lock = threading.Lock()

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Register ``creator`` under ``backend``.

        Raises:
            ConfigError: empty name, or another creator already holds the name.
        """
        if not backend:
            raise ConfigError("backend", backend, "a backend name must not be empty")
        with self._lock:
            current = self._creators.get(backend)
            if current is not None and current is not creator:
                raise ConfigError("backend", backend, "is already registered to another creator")
            self._creators[backend] = creator

    def names(self) -> list[str]:
        import importlib.metadata  # ~25 ms (email.* behind it): only off the launch path

        found = set(self._creators) | set(BUILTIN_BACKENDS)
        for group in (ENTRY_POINT_GROUP, TORCH_ENTRY_POINT_GROUP):
            found.update(ep.name for ep in importlib.metadata.entry_points(group=group))
        return sorted(found)

    def _resolve(self, backend: str) -> RendezvousHandlerCreator | None:
        with self._lock:
            if backend in self._creators:
                return self._creators[backend]
        if backend in BUILTIN_BACKENDS:
            return _load(BUILTIN_BACKENDS[backend])
        import importlib.metadata  # plugins only: a built-in backend never pays for it

        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=backend):
            creator: RendezvousHandlerCreator = ep.load()
            return creator
        for ep in importlib.metadata.entry_points(group=TORCH_ENTRY_POINT_GROUP, name=backend):
            made: RendezvousHandlerCreator = ep.load()()
            return made
        return None

    def check(self, params: RendezvousParameters) -> None:
        """Refuse bad parameters of a built-in backend before anything starts.

        The creator parses them again with the same function; a backend registered in
        code or through an entry point checks its own parameters when it is created.

        Raises:
            ConfigError: naming the bad option or ``--rdzv-conf`` key and its value.
        """
        with self._lock:
            if params.backend in self._creators:
                return
        if params.backend in BUILTIN_CHECKS:
            _load(BUILTIN_CHECKS[params.backend])(params)

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """Build the handler for ``params.backend``.

        Raises:
            ConfigError: unknown backend, or a handler reporting another backend name.
        """
        creator = self._resolve(params.backend)
        if creator is None:
            raise ConfigError(
                "--rdzv-backend",
                params.backend,
                f"unknown rendezvous backend (known: {', '.join(self.names())})",
            )
        handler = creator(params)
        if handler.get_backend() != params.backend:
            raise ConfigError(
                "--rdzv-backend",
                params.backend,
                f"the creator returned a handler for {handler.get_backend()!r}",
            )
        return handler


rendezvous_handler_registry = RendezvousHandlerRegistry()
