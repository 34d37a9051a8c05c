"""The results model every benchmark fills in, and its Markdown and JSON forms.

A benchmark returns a :class:`Section`: tables of samples (one column per launcher or
implementation, the reference -- torch's -- first), headline ratios with their targets,
the exact commands it ran, failures, notes and, for a missed target, where the time goes.
``run_all.py`` puts the sections together into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import REPO, Summary

RESULTS_DIR = REPO / "benchmarks" / "results"
PROFILES = ("smoke", "quick", "full")

# Whether a target is met, given the medians of a row by column name (None: cannot tell).
Check = Callable[[Mapping[str, float]], bool | None]


@dataclass
class Row:
    """One measured quantity: its samples per column, how to print it, its target."""

    key: str
    label: str
    fmt: str = ".3f"
    target: str = ""
    check: Check | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, column: str, value: float) -> None:
        self.samples.setdefault(column, []).append(value)

    def summary(self, column: str) -> Summary:
        return Summary(tuple(self.samples.get(column, ())))

    def medians(self) -> dict[str, float]:
        return {c: Summary(tuple(s)).median for c, s in self.samples.items() if s}

    def verdict(self) -> bool | None:
        return None if self.check is None else self.check(self.medians())


@dataclass
class Table:
    """Rows sharing columns; ratios are every other column over the reference column."""

    title: str
    columns: list[str]
    reference: str | None = None
    rows: dict[str, Row] = field(default_factory=dict)

    def row(
        self,
        key: str,
        label: str,
        *,
        fmt: str = ".3f",
        target: str = "",
        check: Check | None = None,
    ) -> Row:
        if key not in self.rows:
            self.rows[key] = Row(key, label, fmt=fmt, target=target, check=check)
        return self.rows[key]

    def render(self) -> str:
        ref = self.reference
        # The reference (torch's) first, so that each ratio sits right of its numerator.
        columns = [c for c in self.columns if c == ref] + [c for c in self.columns if c != ref]
        head = ["metric"]
        for c in columns:
            head.append(f"{c} median (min-max)")
            if ref is not None and c != ref:
                head.append(f"{c} / {ref}")
        have_targets = any(r.target for r in self.rows.values())
        if have_targets:
            head += ["target", "met"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows.values():
            cells = [r.label]
            ref_s = r.summary(ref) if ref is not None else None
            for c in columns:
                s = r.summary(c)
                cells.append(s.render(r.fmt))
                if ref is not None and c != ref:
                    ratio = "-"
                    if s.samples and ref_s is not None and ref_s.samples and ref_s.median:
                        ratio = f"{s.median / ref_s.median:.2f}"
                    cells.append(ratio)
            if have_targets:
                v = r.verdict()
                cells += [r.target, "-" if v is None else ("yes" if v else "**no**")]
            lines.append("| " + " | ".join(cells) + " |")
        return f"**{self.title}**\n\n" + "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, object]:
        return {
            "title": self.title,
            "columns": self.columns,
            "reference": self.reference,
            "rows": {k: {"label": r.label, "samples": r.samples} for k, r in self.rows.items()},
        }


@dataclass
class Headline:
    """One line of the summary at the top of RESULTS.md."""

    what: str
    value: str
    target: str = ""
    met: bool | None = None


@dataclass
class Section:
    """Everything one benchmark measured and has to say about it."""

    name: str
    title: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # Markdown blocks after the tables
    commands: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    headlines: list[Headline] = field(default_factory=list)
    where_time_goes: list[str] = field(default_factory=list)
    raw: dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0
    profile: str = ""

    def table(self, title: str, columns: Sequence[str], reference: str | None) -> Table:
        t = Table(title, list(columns), reference)
        self.tables.append(t)
        return t

    def fail(self, what: str, why: str) -> None:
        lines = [ln for ln in why.splitlines() if ln.strip()]
        summary = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1].strip()}"
        print(f"[bench] {self.name}: {what}: FAILED: {summary}", flush=True)
        self.failures.append(f"{what}: {why}")

    def render(self, level: int = 2) -> str:
        h = "#" * level
        out = [f"{h} {self.title}", ""]
        if self.intro:
            out += [self.intro, ""]
        for t in self.tables:
            out += [t.render(), ""]
        out += self.extra
        if self.where_time_goes:
            out += [f"{h}# Where the time goes", ""]
            out += [f"- {w}" for w in self.where_time_goes] + [""]
        if self.notes:
            out += [f"{h}# Notes", ""] + [f"- {n}" for n in self.notes] + [""]
        if self.commands:
            out += [f"{h}# Commands", ""]
            out += [f"- {k}: `{v}`" for k, v in self.commands.items()] + [""]
        if self.failures:
            out += [f"{h}# Failures", ""]
            for f in self.failures:
                first, _, rest = f.partition("\n")
                out.append(f"- {first}")
                if rest.strip():
                    out += ["", "  ```", *("  " + ln for ln in rest.splitlines()), "  ```", ""]
            out.append("")
        out.append(f"_{self.profile} profile, {self.seconds:.0f} s._")
        out.append("")
        return "\n".join(out)

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "title": self.title,
            "profile": self.profile,
            "seconds": round(self.seconds, 1),
            "tables": [t.to_json() for t in self.tables],
            "headlines": [h.__dict__ for h in self.headlines],
            "commands": self.commands,
            "failures": self.failures,
            "notes": self.notes,
            "where_time_goes": self.where_time_goes,
            "raw": self.raw,
        }


def ratio_check(column: str, reference: str, at_most: float) -> Check:
    """Met when median(column) <= at_most * median(reference)."""

    def check(m: Mapping[str, float]) -> bool | None:
        if column not in m or reference not in m:
            return None
        return m[column] <= at_most * m[reference]

    return check


def absolute_check(column: str, below: float) -> Check:
    def check(m: Mapping[str, float]) -> bool | None:
        return None if column not in m else m[column] < below

    return check


def ratio_text(row: Row, column: str, reference: str) -> str:
    m = row.medians()
    if column not in m or reference not in m or not m[reference]:
        return "not measured"
    return f"{m[column] / m[reference]:.2f} ({m[column]:{row.fmt}} vs {m[reference]:{row.fmt}})"


# --------------------------------------------------------------------------- module CLI


def common_parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n", maxsplit=1)[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="fewer points and repetitions")
    g.add_argument("--smoke", action="store_true", help="the tiniest configuration (a test)")
    p.add_argument(
        "--output-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where <name>.md and <name>.json go (default benchmarks/results)",
    )
    return p


def profile_of(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def module_main(run: Callable[[str], Section], doc: str, argv: list[str] | None) -> int:
    """A benchmark module's command line: run the profile asked for, print the section
    and write it into the output directory."""
    args = common_parser(doc).parse_args(argv)
    section = run(profile_of(args))
    print(section.render())
    write_section(section, args.output_dir)
    return 0


@dataclass(frozen=True)
class Benchmark:
    """A benchmark module whose ``body(section, options)`` runs with its profile's
    options: ``run(profile)`` (for ``run_all``) and ``main(argv)`` (its command line)."""

    name: str
    title: str
    body: Callable[[Section, Any], None]
    options: Mapping[str, Any]
    doc: str

    def run(self, profile: str) -> Section:
        opts = self.options[profile]
        return run_section(self.name, self.title, lambda s: self.body(s, opts), profile)

    def main(self, argv: list[str] | None = None) -> int:
        return module_main(self.run, self.doc, argv)


def run_section(name: str, title: str, body: Callable[[Section], None], profile: str) -> Section:
    """Run `body` into a fresh section; an unexpected error becomes a reported failure."""
    section = Section(name, title, profile=profile)
    t0 = time.monotonic()
    try:
        body(section)
    except Exception as exc:
        section.fail("the benchmark itself", "".join(traceback.format_exception(exc)))
    section.seconds = time.monotonic() - t0
    return section


def write_section(section: Section, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{section.name}.md").write_text(section.render(level=1))
    (out_dir / f"{section.name}.json").write_text(json.dumps(section.to_json(), indent=1) + "\n")
    print(f"[bench] wrote {out_dir / section.name}.md and .json", flush=True)


def alternate(
    section: Section,
    what: str,
    columns: Sequence[str],
    reps: int,
    measure: Callable[[str, int], Mapping[str, float]],
    record: Callable[[str, Mapping[str, float]], None],
) -> None:
    """Measure every column `reps` times, alternating them (A B A B ...).

    Alternation makes drift in the machine's load hit every column alike. Every failed
    run is reported; a column that fails twice is skipped for the rest of this
    measurement (the others go on), as its remaining runs would most likely fail alike.
    """
    from _common import ScenarioFailure

    failures: dict[str, int] = {}
    for rep in range(reps):
        for col in columns:
            if failures.get(col, 0) >= 2:
                continue
            try:
                measured = measure(col, rep)
            except ScenarioFailure as exc:
                section.fail(f"{what}, {col}, rep {rep + 1}", str(exc))
                failures[col] = failures.get(col, 0) + 1
                continue
            record(col, measured)
            shown = ", ".join(f"{k}={v:.3f}" for k, v in measured.items())
            print(f"[bench] {what} {col} rep {rep + 1}: {shown}", flush=True)


def impls_main(
    doc: str, run: Callable[[str, list[str]], Section], impls: Sequence[str], argv: list[str] | None
) -> int:
    """The command line of a section measured per implementation (``--impls``)."""
    p = common_parser(doc)
    p.add_argument("--impls", default=",".join(impls), help="comma list")
    args = p.parse_args(argv)
    section = run(profile_of(args), [x for x in args.impls.split(",") if x])
    print(section.render())
    write_section(section, args.output_dir)
    return 0
