"""The README's recipes, run as written: the first ``python`` code block after a heading."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_section(heading: str) -> str:
    """README.md's text from ``heading`` (e.g. ``"## Deployment artifacts"``) to its end."""
    readme = README.read_text()
    return readme[readme.index(heading):]


def run_readme_block(heading: str, folder: Path, monkeypatch) -> dict:
    """Run the first ``python`` block after ``heading`` in ``folder`` (the working directory, through
    ``monkeypatch.chdir``); returns the names it defined."""
    section = readme_section(heading)
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    monkeypatch.chdir(folder)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own recipe
    return scope
