"""Which engine serves the workers' store: the compiled one where the install built it.

Light on purpose (the launcher checks ``ELASTRUN_STORE_ENGINE`` at start-up, long before
any server is made): the standard library and ``core.errors`` only.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from elastrun.core.errors import ConfigError
from elastrun.wire.env import STORE_ENGINE_ENV

ENGINES = ("auto", "compiled", "python")
_CORE_MODULE = "elastrun.store.torchwire.wirecore"


def compiled_engine_available() -> bool:
    """Whether the install built the compiled engine for this interpreter."""
    try:
        return importlib.util.find_spec(_CORE_MODULE) is not None
    except (ImportError, ValueError):
        return False


def choose_engine(engine: str = "auto", environ: Mapping[str, str] | None = None) -> str:
    """``"compiled"`` or ``"python"``: the one ``engine`` names, or for ``"auto"`` the
    one ``ELASTRUN_STORE_ENGINE`` names in ``environ`` (the process's by default), else
    the compiled one where it was built. The variable set empty counts as unset, as an
    empty ``PET_*`` variable does.

    Raises ``ConfigError`` for an unknown name, or for ``"compiled"`` where it was not
    built.
    """
    source = "engine"
    named = (os.environ if environ is None else environ).get(STORE_ENGINE_ENV) or "auto"
    if engine == "auto" and named != "auto":
        engine, source = named, STORE_ENGINE_ENV
    if engine not in ENGINES:
        raise ConfigError(source, engine, f"must be one of {', '.join(ENGINES)}")
    if engine == "compiled" and not compiled_engine_available():
        raise ConfigError(
            source,
            engine,
            "the compiled engine was not built by this install (it needs Linux and a C "
            "compiler when elastrun is installed); use python",
        )
    if engine == "auto":
        return "compiled" if compiled_engine_available() else "python"
    return engine
