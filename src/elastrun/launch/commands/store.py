"""``elastrun store``: run the tcp store on its own until SIGTERM or SIGINT.

Parses the arguments and serves :class:`~elastrun.store.tcp.server.TcpStoreServer` in
the foreground (``python -m elastrun store`` is the same command).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from elastrun.core.errors import ConfigError, StoreError
from elastrun.core.shutdown import ShutdownRequest
from elastrun.core.values import parse_int, parse_port, parse_seconds
from elastrun.launch.commands import CommandParser
from elastrun.launch.signals import install_signal_handlers
from elastrun.store.tcp.connection import format_addr
from elastrun.store.tcp.limits import raise_fd_limit
from elastrun.store.tcp.protocol import DEFAULT_MAX_FRAME, HANDSHAKE_MAX_FRAME
from elastrun.store.tcp.server import (
    DEFAULT_DISCONNECT_GRACE,
    MAX_FRAME_LIMIT,
    TcpStoreServer,
    read_token_file,
)

__all__ = ["store_main"]

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="elastrun store",
        description="Run the elastrun tcp store on its own, e.g. on a machine outside the job.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every IPv4 interface)",
    )
    parser.add_argument(
        "--port",
        default="29400",
        help="port to listen on, 0 to 65535; 0 picks a free one (default: 29400)",
    )
    parser.add_argument(
        "--token-file", help="file holding the shared token clients must prove they know"
    )
    parser.add_argument(
        "--max-frame",
        default=str(DEFAULT_MAX_FRAME),
        help=f"largest message in bytes, {HANDSHAKE_MAX_FRAME} to {MAX_FRAME_LIMIT} "
        f"(default: {DEFAULT_MAX_FRAME})",
    )
    parser.add_argument(
        "--disconnect-grace",
        default=str(DEFAULT_DISCONNECT_GRACE),
        help="seconds a dropped client has to reconnect before its leases "
        f"end, at most a year (default: {DEFAULT_DISCONNECT_GRACE})",
    )
    return parser


def store_main(argv: list[str]) -> int:
    """``elastrun store``: serve a tcp store until SIGTERM or SIGINT; returns the exit code.

    Exit codes: 0 after a signal, 2 for bad arguments or an unusable token file, 1 when
    the address cannot be bound.
    """
    prog = "elastrun store"
    try:
        args = _parser().parse_args(argv)  # -h/--help prints and exits here
        port = parse_port(args.port, "--port")
        max_frame = parse_int(
            args.max_frame, "--max-frame", low=HANDSHAKE_MAX_FRAME, high=MAX_FRAME_LIMIT
        )
        grace = parse_seconds(args.disconnect_grace, "--disconnect-grace")
        token = read_token_file(args.token_file) if args.token_file is not None else None
        server = TcpStoreServer(
            args.host, port, token=token, max_frame=max_frame, disconnect_grace=grace
        )
    except ConfigError as exc:
        # argparse's own messages carry no value: leave out ConfigError's "(got None)".
        text = exc.reason if exc.value is None else str(exc)
        print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
        return 2
    except StoreError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format=f"{prog}: %(levelname)s %(message)s"
        )
    raise_fd_limit()

    # A signal stops the server from the launcher's relay thread (``launch.signals``),
    # not in a handler that would interrupt the loop it stops.
    shutdown = ShutdownRequest()
    shutdown.scope.on_cancel(server.stop)
    restore = install_signal_handlers((signal.SIGTERM, signal.SIGINT), shutdown)

    def on_ready(port: int) -> None:
        if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "serving without a token: anyone who can reach port %d can read and "
                "write the store (use --token-file)",
                port,
            )
        print(f"{prog}: serving on {format_addr(args.host, port)}", flush=True)

    try:
        server.serve_forever(on_ready)
    except StoreError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        restore()
    return 0
