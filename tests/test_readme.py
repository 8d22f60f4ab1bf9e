"""The README's Python snippets run as written, each in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def snippets() -> list[str]:
    """Every ```python block of the README, in order."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)


def test_the_readme_has_its_snippets() -> None:
    """The engine, router and encryption snippets are there (a guard against a silent no-op)."""
    found = snippets()
    assert len(found) == 3
    assert "create_publisher" in found[0] and "Subscriber" in found[1] and "Curve" in found[2]


@pytest.mark.parametrize(
    ("number", "last_line"),
    [(0, r"^0 PublisherStats\("), (1, r"^\{\('worker-a', 0\): 2\}$"), (2, r"^True$")],
)
def test_each_snippet_runs_as_written(number: int, last_line: str) -> None:
    """Snippet ``number`` defines everything it uses, runs to the end and prints what its
    comment says."""
    done = subprocess.run(
        [sys.executable, "-c", snippets()[number]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert re.search(last_line, done.stdout.strip().splitlines()[-1]), done.stdout
