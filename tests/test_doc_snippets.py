"""The docs' code runs as written: every fenced block of README.md and docs/*.md whose previous line is
`<!-- runnable -->` (docs/testing.md), offline on a CPU; the README's first example is one of them; the README's
commands are the ones CI runs; and every relative link of the docs points at a file and heading that exist."""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import REPO, offline_environment

MARK = "<!-- runnable -->"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash")
PYTHON_TIMEOUT = 300  # every Python block of every page, in one process
BASH_TIMEOUT = 120  # each shell block


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the code's first line, counted from 1
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def fenced_blocks(page: Path) -> list[tuple[Block, bool]]:
    """Every fenced code block of `page`, and whether it is marked runnable (the line before its fence is MARK)."""
    lines = page.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        if lines[index].startswith("```"):
            end = next((j for j in range(index + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            code = "\n".join(lines[index + 1 : end]) + "\n"
            block = Block(page, index + 2, lines[index][3:].strip(), code)
            blocks.append((block, index > 0 and lines[index - 1].strip() == MARK))
            index = end
        index += 1
    return blocks


def runnable(language: str) -> list[Block]:
    return [block for page in PAGES for block, marked in fenced_blocks(page) if marked and block.language == language]


def test_every_mark_precedes_a_python_or_bash_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for index, line in enumerate(lines):
            if line.strip() == MARK:
                following = lines[index + 1] if index + 1 < len(lines) else ""
                assert following.startswith("```"), (
                    f"{page.relative_to(REPO)}:{index + 1}: {MARK} is not followed by a fence"
                )
    marked = [block for page in PAGES for block, is_marked in fenced_blocks(page) if is_marked]
    assert marked, "no runnable block at all"
    wrong = [f"{block.where}: {block.language!r}" for block in marked if block.language not in LANGUAGES]
    assert not wrong, f"runnable blocks must be one of {LANGUAGES}: {wrong}"


def test_the_readme_first_python_example_is_marked_runnable():
    first = next(block for block, _ in fenced_blocks(REPO / "README.md") if block.language == "python")
    assert first in runnable("python"), f"{first.where}: the README's first example must be marked {MARK}"
    assert "DAPOTrainer" in first.code and ".train()" in first.code


def test_the_readme_commands_are_the_ones_ci_runs():
    """The install line and the test command, exactly as `.ci/run` runs them."""
    readme = {block.code.strip() for block, _ in fenced_blocks(REPO / "README.md") if block.language == "bash"}
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    install = next(line for line in ci if line.startswith("pip install"))
    assert install in readme, f"the README lacks CI's install line: {install}"
    assert "pytest -q" in ci and "pytest -q" in readme


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.M):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


@pytest.mark.parametrize("page", [*PAGES, REPO / "tests" / "README.md"], ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings_that_exist(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        destination = (page.parent / file) if file else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


# ----------------------------------------------------------------------------------------------- running them
def workspace(tmp_path: Path, page: Path) -> Path:
    """A fresh folder per page, the current directory of its blocks: the repository's top-level files and folders
    are linked into it, so `tests/data/...` and `./test_dapo.sh` resolve, and whatever a block writes stays there."""
    folder = tmp_path / page.stem
    if not folder.exists():
        folder.mkdir()
        for entry in REPO.iterdir():
            if not entry.name.startswith("."):
                (folder / entry.name).symlink_to(entry)
    return folder


def snippet_environment() -> dict:
    """Offline and on the CPU, with this interpreter's `python` first on the path."""
    env = offline_environment({"CUDA_VISIBLE_DEVICES": ""})
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


# Runs each block in its own globals, in its page's folder, in order; names the block that failed.
RUNNER = """
import json, os, sys, traceback
for block in json.load(open(sys.argv[1])):
    os.chdir(block["cwd"])
    print(f"--- {block['where']}", flush=True)
    try:
        exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: {block['where']}", flush=True)
        sys.exit(1)
"""


@pytest.mark.e2e
def test_runnable_python_blocks_run(tmp_path):
    """Every marked Python block (each trains at most a couple of steps of the built-in model), in page order, in one
    process: the imports are paid once."""
    blocks = runnable("python")
    assert blocks
    plan = [{"where": b.where, "cwd": str(workspace(tmp_path, b.page)), "code": b.code} for b in blocks]
    (tmp_path / "blocks.json").write_text(json.dumps(plan))
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path / "blocks.json")],
        env=snippet_environment(),
        capture_output=True,
        text=True,
        timeout=PYTHON_TIMEOUT,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


@pytest.mark.e2e
@pytest.mark.parametrize("block", runnable("bash"), ids=lambda b: b.where)
def test_runnable_shell_blocks_run(tmp_path, block):
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.code],
        cwd=workspace(tmp_path, block.page),
        env=snippet_environment(),
        capture_output=True,
        text=True,
        timeout=BASH_TIMEOUT,
    )
    assert result.returncode == 0, f"{block.where}:\n{block.code}\n{(result.stdout + result.stderr)[-4000:]}"
