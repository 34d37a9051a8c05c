"""The one number checker (``elastrun.core.values``) and the parsers built on it."""

from __future__ import annotations

import math

import pytest

from elastrun.core.errors import ConfigError
from elastrun.core.values import (
    MAX_SECONDS,
    check_host,
    check_number,
    parse_host_port,
    parse_int,
    parse_port,
    parse_seconds,
)


@pytest.mark.parametrize("raw", ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e400"])
def test_nan_and_infinities_are_refused_by_default(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_number(raw, "--x")
    assert (info.value.field, info.value.value) == ("--x", raw)
    assert "finite" in str(info.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_from_python_callers_are_refused_too(value: float) -> None:
    with pytest.raises(ConfigError, match="--x"):
        check_number(value, "--x", low=0)


def test_inf_means_forever_only_where_allowed_and_nan_never() -> None:
    assert check_number("inf", "--x", low=0, high=10, forever=True) == math.inf
    with pytest.raises(ConfigError, match="inf for no limit"):
        check_number("-inf", "--x", forever=True)
    with pytest.raises(ConfigError):
        check_number("nan", "--x", forever=True)


@pytest.mark.parametrize(
    ("raw", "kwargs"),
    [
        ("-1", {"low": 0}),
        ("0", {"low": 0, "low_open": True}),
        ("11", {"high": 10}),
        ("abc", {}),
        ("", {}),
        ("1.5", {"integer": True}),
        ("1e3", {"integer": True}),
    ],
)
def test_out_of_range_or_unparsable_values_name_field_and_value(
    raw: str, kwargs: dict[str, object]
) -> None:
    with pytest.raises(ConfigError) as info:
        check_number(raw, "--x", **kwargs)  # type: ignore[arg-type]  # kwargs: object
    assert info.value.field == "--x" and info.value.value == raw
    assert "\n" not in str(info.value)


def test_bounds_are_inclusive_unless_low_open() -> None:
    assert check_number("0", "--x", low=0) == 0
    assert check_number("10", "--x", high=10) == 10
    assert check_number(" 2.5 ", "--x", low=0, low_open=True) == 2.5


def test_integers_stay_exact_and_huge_ones_are_range_checked() -> None:
    assert parse_int("42", "--n", low=1) == 42
    assert isinstance(parse_int("42", "--n"), int)
    with pytest.raises(ConfigError, match="from 1 to 1024"):
        parse_int("9" * 400, "--n", low=1, high=1024)
    with pytest.raises(ConfigError):
        parse_int(True, "--n")  # a bool is not a count


def test_the_message_says_the_range() -> None:
    with pytest.raises(ConfigError) as info:
        parse_int("0", "--n", low=1, high=1024)
    assert str(info.value) == "--n: must be an integer from 1 to 1024 (got '0')"
    with pytest.raises(ConfigError) as info:
        parse_seconds("nan", "--t", low_open=True)
    assert str(info.value) == (
        "--t: must be a finite number of seconds > 0 and <= 31536000 (a year) (got 'nan')"
    )


def test_seconds_are_capped_at_a_year() -> None:
    assert parse_seconds(str(MAX_SECONDS), "--t") == MAX_SECONDS
    with pytest.raises(ConfigError):
        parse_seconds(str(MAX_SECONDS + 1), "--t")


@pytest.mark.parametrize(("raw", "ok"), [("0", True), ("65535", True), ("65536", False)])
def test_ports(raw: str, ok: bool) -> None:
    if ok:
        assert parse_port(raw, "--port") == int(raw)
    else:
        with pytest.raises(ConfigError, match="--port"):
            parse_port(raw, "--port")
    with pytest.raises(ConfigError):
        parse_port("0", "--port", allow_zero=False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h", ("h", 29400)),
        ("h:5", ("h", 5)),
        ("[::1]:7", ("::1", 7)),
        ("[::1]", ("::1", 29400)),
        ("::1", ("::1", 29400)),
        ("fe80::1:2", ("fe80::1:2", 29400)),
        ("[fe80::1%eth0]:9", ("fe80::1%eth0", 9)),
        ("node-7.cluster.local.:9", ("node-7.cluster.local.", 9)),
        ("gpu_node_3:9", ("gpu_node_3", 9)),
        ("10.0.0.1:9", ("10.0.0.1", 9)),
    ],
)
def test_host_port_forms(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text, "--ep", 29400) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("host:", "port after ':' is missing"),
        ("[::1", "no closing ']'"),
        ("[::1]:", "port after ':' is missing"),
        ("[::1]x", "expected [IPv6]:PORT"),
        (":29400", "host is missing"),
        ("host:99999", "port must be an integer from 0 to 65535"),
        ("host:abc", "port must be an integer"),
        ("host:-1", "port must be an integer"),
        ("my host:29400", "not a host name"),
        ("h\tx:1", "not a host name"),
        ("-h:1", "not a host name"),
        ("a..b:1", "not a host name"),
        ("[::1 ]:1", "not an IPv6 address"),
    ],
)
def test_bad_host_port_names_the_field_and_the_whole_text(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_host_port(text, "--ep", 29400)
    assert info.value.field == "--ep" and info.value.value == text
    assert why in info.value.reason


@pytest.mark.parametrize("host", ["localhost", "n7", "a.b-c.d", "127.0.0.1", "::1", "x_y"])
def test_a_host_name_or_address_is_accepted_as_written(host: str) -> None:
    assert check_host(host, "--local-addr") == host


@pytest.mark.parametrize("host", ["node 7", "", "n@de", "a/b", "x" * 64, "h:1", "é"])
def test_a_host_that_cannot_name_a_machine_is_refused_before_any_lookup(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_host(host, "--local-addr")
    assert (info.value.field, info.value.value) == ("--local-addr", host)
