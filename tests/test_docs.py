"""The README and BENCHMARKS stay short and start where a new user starts; the docs link what exists, name real
commands, speak of the project only, and the README's CPU example is what the command prints."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
SETUP_COMMANDS = [
    './scripts/setup.sh && .venv/bin/gpt-fast generate --chat --temperature 0 --prompt "What is the capital of France?"'
    " --num_samples 1",
    "./scripts/setup.sh --dev && .venv/bin/python -m pytest -q",
]
QUICK_START = 'gpt-fast generate --chat --temperature 0 --prompt "What is the capital of France?" --num_samples 1'
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def fenced_blocks(path: Path) -> list[list[str]]:
    """The fenced code blocks of a Markdown file, each as its lines (fences left out)."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in lines(path):
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def documentation_files() -> list[Path]:
    """README, BENCHMARKS and everything under docs/ that is text."""
    files = [README, BENCHMARKS]
    files += [p for p in sorted((ROOT / "docs").rglob("*")) if p.is_file() and p.suffix in {".md", ".txt", ".json"}]
    return files


def test_readme_is_short_and_starts_with_the_two_setup_commands():
    assert len(lines(README)) <= 300
    assert fenced_blocks(README)[0] == SETUP_COMMANDS
    first_block_start = lines(README).index("```bash")
    assert all(not line.strip() or line.startswith("#") for line in lines(README)[:first_block_start])


ROUND_STEM = "sess" + "ion"
ROUND_WORD = rf"\b{ROUND_STEM}s?\b"


def test_benchmarks_is_short():
    assert len(lines(BENCHMARKS)) <= 250


@pytest.mark.parametrize("path", documentation_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documentation_speaks_of_the_project_only(path: Path):
    """No word for a round of work (built from its parts, so that this file does not say it either)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    assert not re.search(ROUND_WORD, text, re.IGNORECASE), "a word for a round of work"
    assert ".gpu/" not in text, "a path to scripts outside the repository"


def test_raw_benchmark_files_are_named_by_date():
    undated = re.compile(r"(^|_)(s\d+[a-z]?|" + ROUND_STEM + r"\d*)(_|\.)", re.IGNORECASE)
    assert [p.name for p in (ROOT / "docs" / "bench").iterdir() if undated.search(p.name)] == []


def test_every_local_link_in_the_docs_exists():
    missing = []
    for path in [README, BENCHMARKS, *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "bench" / "HISTORY.md"]:
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert missing == []


def test_readme_links_every_guide():
    linked = {target for target in LINK.findall(README.read_text(encoding="utf-8")) if target.startswith("docs/")}
    guides = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert guides <= linked


def test_the_command_table_names_real_commands():
    from gpt_fast.cli.main import cli

    text = README.read_text(encoding="utf-8")
    table = text[text.index("## Commands") :].split("\n## ")[0]
    named = re.findall(r"^\| `gpt-fast ([a-z-]+)", table, re.MULTILINE)
    assert named, "no command table"
    assert sorted(set(named) - set(cli.commands)) == []
    assert sorted(set(cli.commands) - set(named)) == []


def skeleton(text_lines: list[str]) -> list[str]:
    """The lines with every number replaced, so that machine-dependent figures compare equal."""
    return [re.sub(r"\d+(\.\d+)?", "N", line.rstrip()) for line in text_lines if line.strip()]


@pytest.mark.slow
def test_the_readme_cpu_example_is_what_the_command_prints():
    example = next(block for block in fenced_blocks(README) if block and block[0] == f"$ {QUICK_START}")
    argv = QUICK_START.split(" ", 1)[1]
    command = [sys.executable, "-m", "gpt_fast", *shlex.split(argv), "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900, check=True)
    assert skeleton(done.stdout.splitlines()) == skeleton(example[1:])
