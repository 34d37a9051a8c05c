"""Numbers, ports and ``host:port`` endpoints read from outside: one checker for all.

Every number elastrun reads -- from the command line, a ``PET_*`` or other environment
variable, ``--rdzv-conf``, a subcommand's options or a Python API argument -- goes
through :func:`check_number` (usually by way of :func:`parse_int`, :func:`parse_seconds`
or :func:`parse_port`), so a bad one is refused the same way everywhere: a
:class:`ConfigError` naming the field and the value exactly as given.

The rules:

* the text must be a number (an integer where one is expected);
* it must be finite: ``nan`` and ``inf`` are refused, unless the caller says that the
  value may mean "forever" (``forever=True``, then ``inf`` is accepted, never ``nan``).
  Why so strict: ``nan`` compares false with everything, so ``nan < 0`` lets it pass a
  naive range check and it then turns into "no wait at all" in one place and "wait
  forever" in another; ``inf`` overflows the deadlines of ``threading`` waits;
* it must lie in its range. Durations are capped at :data:`MAX_SECONDS` (a year): a
  longer wait is a typo, and an astronomically long one overflows the same waits.
"""

from __future__ import annotations

import math
import re

from elastrun.core.errors import ConfigError

__all__ = [
    "MAX_PORT",
    "MAX_SECONDS",
    "check_host",
    "check_number",
    "finite_float",
    "parse_host_port",
    "parse_int",
    "parse_port",
    "parse_seconds",
]

#: The longest duration accepted anywhere (365 days), in seconds.
MAX_SECONDS = 365 * 24 * 3600
MAX_PORT = 65535


def _format(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def _range_text(
    low: float | None,
    high: float | None,
    *,
    low_open: bool,
    integer: bool,
    forever: bool,
    what: str,
) -> str:
    noun = what if forever else f"finite {what}"  # "forever" admits inf: not finite
    kind = "an integer" if integer else f"a {noun}"
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {_format(low)}")
    if high is not None:
        parts.append(f"<= {_format(high)}" + (" (a year)" if high == MAX_SECONDS else ""))
    if low is not None and high is not None and integer and not low_open:
        text = f"must be {kind} from {_format(low)} to {_format(high)}"
    else:
        text = f"must be {kind}" + (f" {' and '.join(parts)}" if parts else "")
    return text + (", or inf for no limit" if forever else "")


def check_number(
    value: str | float,
    field: str,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    forever: bool = False,
    what: str = "number",
    raw: object = None,
) -> float:
    """The one checker: ``value`` (text or a number) parsed, finite and in range.

    Args:
        value: the text as read, or a number (from a Python API caller).
        field: what to blame: the option or variable as the user spelled it.
        integer: only whole numbers (text must be written as an integer).
        low, high: inclusive bounds (``low`` is exclusive with ``low_open``).
        forever: ``inf`` is accepted and means "no limit" (``high`` then does not
            apply to it).
        what: the noun used in the message, e.g. ``"number of seconds"``.
        raw: the value to show in the message when it is not ``value`` itself.

    Returns:
        The number (a float, or an int when ``integer``).

    Raises:
        ConfigError: naming ``field`` and the value as given.
    """
    shown = value if raw is None else raw
    rule = _range_text(low, high, low_open=low_open, integer=integer, forever=forever, what=what)
    number: float
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text) if integer else float(text)
        except ValueError:
            raise ConfigError(field, shown, rule) from None
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, shown, rule)
    elif integer and isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(field, shown, rule)
        number = int(value)
    else:
        number = value
    if isinstance(number, float):
        if math.isnan(number) or (math.isinf(number) and not (forever and number > 0)):
            raise ConfigError(field, shown, rule)
        if math.isinf(number):
            return number
    if low is not None and (number <= low if low_open else number < low):
        raise ConfigError(field, shown, rule)
    if high is not None and number > high:
        raise ConfigError(field, shown, rule)
    return number


def parse_int(
    value: str | int, field: str, *, low: int | None = None, high: int | None = None
) -> int:
    """An integer in ``[low, high]``: :func:`check_number` with ``integer=True``."""
    return int(check_number(value, field, integer=True, low=low, high=high))


def parse_seconds(
    value: str | float,
    field: str,
    *,
    low: float = 0.0,
    low_open: bool = False,
    high: float = MAX_SECONDS,
    forever: bool = False,
) -> float:
    """A duration in seconds: finite, ``>= low`` (``> low`` with ``low_open``), at most
    ``high`` (a year by default); ``inf`` only with ``forever``."""
    return float(
        check_number(
            value,
            field,
            low=low,
            low_open=low_open,
            high=high,
            forever=forever,
            what="number of seconds",
        )
    )


def parse_port(value: str | int, field: str, *, allow_zero: bool = True) -> int:
    """A TCP port: 0..65535, or 1..65535 where 0 ("any free port") makes no sense."""
    return parse_int(value, field, low=0 if allow_zero else 1, high=MAX_PORT)


#: One label of a host name. Underscores are not valid in DNS names but are common in
#: container and cluster host names, and resolvers accept them.
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?")


def check_host(host: str, field: str, shown: object = None) -> str:
    """``host`` when it can name a machine: a host name, an IPv4 or an IPv6 address.

    Only the spelling is checked, nothing is resolved: a space or a stray character
    used to surface only once the first connection timed out, tens of seconds in.

    Raises:
        ConfigError: naming ``field`` and ``shown`` (default: ``host``).
    """
    value = host if shown is None else shown
    if ":" in host:
        if not _IPV6.fullmatch(host):
            raise ConfigError(field, value, f"{host!r} is not an IPv6 address")
        return host
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ConfigError(
            field,
            value,
            f"{host!r} is not a host name or address (letters, digits, '-', '_' and "
            "dots between labels)",
        )
    return host


def parse_host_port(
    text: str, field: str, default_port: int | None, *, allow_zero: bool = True
) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]:port``, ``[v6]`` or a bare IPv6 address.

    Returns ``(host, port)``; the port is ``default_port`` when none is written. A host
    is required; a ``:`` must be followed by a port; ``[`` must be closed.

    Raises:
        ConfigError: naming ``field`` and the whole text.
    """
    item = text.strip()
    port_text: str | None
    if item.startswith("["):
        host, closed, rest = item[1:].partition("]")
        if not closed:
            raise ConfigError(field, text, "the IPv6 address has no closing ']'")
        if rest and not rest.startswith(":"):
            raise ConfigError(field, text, "expected [IPv6]:PORT")
        port_text = rest[1:] if rest else None
    elif item.count(":") > 1:  # a bare IPv6 address, no port
        host, port_text = item, None
    else:
        host, colon, after = item.partition(":")
        port_text = after if colon else None
    if not host.strip():
        raise ConfigError(field, text, "the host is missing (expected HOST:PORT)")
    check_host(host, field, text)
    if port_text is None:
        return host, default_port
    if not port_text.strip():
        raise ConfigError(field, text, "the port after ':' is missing (expected HOST:PORT)")
    try:
        port = parse_port(port_text, field, allow_zero=allow_zero)
    except ConfigError as exc:
        raise ConfigError(field, text, f"the port {exc.reason}") from None
    return host, port


def size_text(n: int) -> str:
    """A size in bytes as people read it: ``1.50 GiB``, ``12.0 MiB``, ``3.0 KiB``."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


def finite_float(value: object) -> float | None:
    """``value`` read from JSON as a finite float, or None: not a number (a bool is
    not one), NaN, an infinity, or an integer past a float's range (which Python's
    ``json`` reads and ``float()`` refuses with ``OverflowError``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
