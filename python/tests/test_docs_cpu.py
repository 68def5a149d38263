"""Every ```python block of README.md and docs/*.md, run as written on the installed package, so
what a reader copies is what the tests run. A block that needs what the CPU suite does not have
says so in a comment line, ``# needs: gpu`` (a GPU and torch), ``# needs: sglang`` or
``# needs: mooncake``: it is skipped here, saying why (the test the prose names runs it where
that is installed)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS = re.compile(r"^#\s*needs:\s*(\w+)", re.MULTILINE)
KNOWN_NEEDS = {"gpu", "sglang", "mooncake"}


def blocks():
    """(file, line of the block, code) of every python block, in file order."""
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    found = []
    for path in files:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i + 1
                end = start
                while end < len(lines) and not lines[end].strip().startswith("```"):
                    end += 1
                found.append((path.relative_to(ROOT).as_posix(), start, "\n".join(lines[start:end]) + "\n"))
                i = end
            i += 1
    return found


BLOCKS = blocks()


def test_the_readme_has_a_python_block_that_runs_here():
    readme = [code for name, _, code in BLOCKS if name == "README.md"]
    assert readme, "README.md has no python block"
    assert not any(NEEDS.search(code) for code in readme), "the README's example must run on the CPU"


@pytest.mark.parametrize("name,line,code", BLOCKS, ids=[f"{n}:{l}" for n, l, _ in BLOCKS])
def test_python_block_runs(name, line, code):
    needs = set(NEEDS.findall(code))
    unknown = needs - KNOWN_NEEDS
    assert not unknown, f"{name}:{line}: unknown needs {unknown}; known: {sorted(KNOWN_NEEDS)}"
    if needs:
        pytest.skip(f"{name}:{line} needs {', '.join(sorted(needs))}: the test its text names runs it")
    exec(compile(code, f"{name}:{line}", "exec"), {"__name__": "__docs__"})
