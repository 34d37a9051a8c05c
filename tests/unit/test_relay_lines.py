"""The output relay's line framing: pure functions of bytes, no pipes or threads."""

from __future__ import annotations

import select

from elastrun.supervise.processes.relay.stream import MAX_LINE, last_line, render, split_lines


def test_split_lines_keeps_the_unfinished_tail_for_the_next_chunk() -> None:
    lines, rest = split_lines(b"he", b"llo\nwor")
    assert lines == [b"hello\n"]
    assert rest == b"wor"


def test_split_lines_holds_a_lone_carriage_return_until_the_next_chunk() -> None:
    lines, rest = split_lines(b"", b"50%\r60%\r")
    assert lines == [b"50%\r"]
    assert rest == b"60%\r"
    lines, rest = split_lines(rest, b"\nend\n")
    assert lines == [b"60%\r\n", b"end\n"]
    assert rest == b""


def test_split_lines_cuts_an_endless_line_into_max_line_pieces() -> None:
    lines, rest = split_lines(b"", b"x" * (2 * MAX_LINE + 5))
    assert lines == [b"x" * MAX_LINE + b"\n"] * 2
    assert rest == b"x" * 5


def test_last_line_gets_a_newline_only_when_it_has_no_terminator() -> None:
    assert last_line(b"tail") == b"tail\n"
    assert last_line(b"bar\r") == b"bar\r"


def test_render_prefixes_whole_lines_in_writes_of_at_most_pipe_buf() -> None:
    line = b"y" * 1000 + b"\n"
    batches, matched = render(b"[0]: ", [line] * 10, ())
    assert b"".join(batches) == (b"[0]: " + line) * 10
    assert all(len(batch) <= select.PIPE_BUF for batch in batches)
    assert all(batch.endswith(b"\n") for batch in batches)
    assert matched == b""


def test_render_copies_the_lines_that_contain_a_needle() -> None:
    batches, matched = render(b"[1]: ", [b"loss 3\n", b"ok\n", b"LOSS\n"], (b"loss",))
    assert batches == [b"[1]: loss 3\n[1]: ok\n[1]: LOSS\n"]
    assert matched == b"[1]: loss 3\n"
