"""The README a newcomer reads: short, in the present tense, two set-up commands, and every link it gives exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A date, a session's ordinal or an issue number: history, which is git's.
HISTORY = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|\b(first|second|third|[a-z]+th) session\b|\b[Ii]ssues?[- #]?[0-9]+")


def _paragraphs(text: str) -> list[str]:
    """Blocks between blank lines, each list item one, code blocks and tables left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip() and not b.lstrip().startswith("|")]
    return [item for b in blocks for item in re.split(r"\n(?=- )", b)]


def test_readme_is_short_and_its_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1000
    longest = max(_paragraphs(text), key=lambda p: len(p.split()))
    assert len(longest.split()) <= 120, longest
    setup = text.split("## Set-up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in setup.strip().splitlines()] == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), target


def test_docs_links_exist():
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            assert (doc.parent / target).exists(), (doc.name, target)


def test_code_docs_and_readme_tell_no_history():
    sources = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "hierremat").rglob("*.py")]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sources
             for n, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, found
