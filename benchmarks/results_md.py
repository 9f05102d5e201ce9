"""Writing one benchmark's section of benchmarks/RESULTS.md, between its HTML-comment markers, and
leaving every other section as it is. The scripts that measure live beside this file."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(begin: str, end: str, section: str) -> None:
    """Replace the text from `begin` to `end` with `section` (which carries both markers), or
    append `section` when the markers are not there yet."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)
