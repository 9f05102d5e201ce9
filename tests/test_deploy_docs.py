"""The generated documentation matches the code: docs/configuration.md is the CLI's argparse
reference, and the README's generated sections are the current compact configuration reference
and metrics list (docs/generate.py)."""

from __future__ import annotations

import runpy

from deploy_compose import REPO

GENERATOR = REPO / "docs" / "generate.py"


def _expected() -> dict:
    return runpy.run_path(str(GENERATOR))["expected_files"]()


def test_configuration_reference_matches_the_cli():
    expected = _expected()
    path = REPO / "docs" / "configuration.md"
    assert path.read_text() == expected[path], "run .venv/bin/python docs/generate.py"


def test_readme_generated_sections_are_current():
    expected = _expected()
    path = REPO / "README.md"
    assert path.read_text() == expected[path], "run .venv/bin/python docs/generate.py"


def test_configuration_reference_lists_every_flag():
    from deepserve.server.cli import build_parser

    text = (REPO / "docs" / "configuration.md").read_text()
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in subparsers.choices.items():
        assert f"## `deepserve {name}`" in text
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in text, f"{name} {flag}"


def test_readme_is_short_and_links_the_details():
    """The README is for a user: measurements live in benchmarks/RESULTS.md, and the complete
    references in docs/, which it links."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 450
    for linked in ("benchmarks/RESULTS.md", "docs/configuration.md", "docs/metrics.md"):
        assert linked in text, linked


def test_readme_keeps_the_two_setup_commands():
    text = (REPO / "README.md").read_text()
    assert "make serve   # builds .venv/" in text
    assert "make test    # builds .venv/" in text
