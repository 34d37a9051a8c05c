"""What a check's process prints is read into a bounded tail: lines end at \\n or \\r, a
long line keeps its end behind a cut mark, and 50 MB with no newline cost no more memory
than a few lines; a failure message quotes at most ``QUOTE`` characters of it."""

from __future__ import annotations

import tracemalloc

from elastrun.nodecheck.agent.check import QUOTE, quote
from elastrun.supervise.processes.helper import CUT, LINE_MAX, PENDING, TAIL, OutputTail


def _lines(*chunks: bytes) -> list[str]:
    out = OutputTail()
    for chunk in chunks:
        out.feed(chunk)
    out.end()
    return list(out.lines)


def test_a_line_ends_at_a_newline_or_a_carriage_return_and_blank_ones_are_skipped() -> None:
    assert _lines(b"10%\r20%\r\n\r\n30%\rdone\n  \n") == ["10%", "20%", "30%", "done"]


def test_a_line_split_across_reads_is_joined_and_the_unfinished_last_one_counts() -> None:
    assert _lines(b"hel", b"lo\r", b"\nwor", b"ld") == ["hello", "world"]


def test_a_long_line_keeps_its_end_after_the_cut_mark() -> None:
    long = b"a" * 10 + b"x" * (3 * LINE_MAX) + b"END"
    # In one read, and across many reads with no newline.
    for chunks in ([long], [long[i : i + 1000] for i in range(0, len(long), 1000)]):
        lines = _lines(*chunks, b"\nshort\n")
        assert lines == [CUT + long[-LINE_MAX:].decode(), "short"]


def test_fifty_megabytes_without_a_newline_keep_one_bounded_line() -> None:
    chunk = b"#" * 65536
    out = OutputTail()
    tracemalloc.start()
    try:
        for _ in range(50 * 2**20 // len(chunk)):
            out.feed(chunk)
        out.feed(b"the end")
        out.end()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # What is held is a line, whatever the size of the output (a read is 64 KiB).
    assert peak < 4 * len(chunk) + 8 * LINE_MAX, peak
    assert list(out.lines) == [CUT + ("#" * LINE_MAX + "the end")[-LINE_MAX:]]
    assert not out.pending


def test_many_lines_keep_only_the_last_ones_and_a_bounded_number_of_results() -> None:
    out = OutputTail()
    for i in range(10_000):
        out.feed(b'{"n": %d}\nplain %d\r' % (i, i))
    out.end()
    assert len(out.lines) == TAIL and out.lines[-1] == "plain 9999"
    assert len(out.pending) == PENDING and out.pending[-1] == '{"n": 9999}'


def test_a_cut_line_is_never_taken_for_a_result() -> None:
    out = OutputTail()
    out.feed(b'{"ok": true, "pad": "' + b"p" * (2 * LINE_MAX) + b'"}\n{"ok": false}\n')
    assert list(out.pending) == ['{"ok": false}']


def test_a_message_quotes_at_most_quote_characters_ending_with_the_text() -> None:
    assert quote("short") == "short"
    text = "start " + "x" * 10_000 + " the last words"
    shown = quote(text)
    assert len(shown) == QUOTE and shown.startswith(CUT) and shown.endswith(" the last words")
    # A line already cut by the reader is marked once.
    assert quote(CUT + "y" * 1000).count(CUT) == 1
