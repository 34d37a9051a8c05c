"""Types of the compiled engine (``wirecore.c``)."""

from collections.abc import Callable, Sequence

class Core:
    def __init__(
        self,
        listeners: Sequence[int],
        max_connections: int,
        max_frame: int,
        max_key: int,
        complain: Callable[[str], object],
        max_handshakes: int,
        fd_limit: int,
        fd_reserve: int,
        evict_after_ms: int,
        recheck_ms: int,
        recount_ms: int,
        notice: Callable[[str, str], object],
    ) -> None: ...
    def serve(self) -> None: ...
    def stop(self) -> None: ...
    @property
    def num_keys(self) -> int: ...
    @property
    def num_connections(self) -> int: ...
