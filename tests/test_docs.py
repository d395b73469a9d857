"""Every page of the README and the manual (`docs/**.md`) says what is true of the repo.

- links and `#anchors` resolve (anchors as GitHub makes them from headings);
- every flag shown after `uptrain COMMAND` in a ```bash block is one of that command's flags
  (read from the CLI's own parser, in-process);
- every command has its page, and its `--help` runs;
- the cheap commands shown run: the blocks that only convert or inspect the shipped reference
  model run as shown, and print the output block that follows them;
- no file of the repo cites a docs path (or a Markdown file) that does not exist;
- every module the layout page names exists.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from uptrain.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, …
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*|-[A-Za-z](?![\w-]))")
# Markdown file names a file may cite that are not files of this repo, each with its reason.
FOREIGN_MARKDOWN = {
    "USE_POLICY.md": "a source checkpoint's licence file, which a conversion copies beside its weights",
    "KINDS.md": "the device tool's own notes on its machines, outside this repository",
}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- reading a page ---------------------------------------------------------------------------


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a page: (info string, body), in order."""
    found, lang, body = [], None, []
    for line in text.splitlines():
        fence = FENCE.match(line)
        if lang is None and fence:
            lang, body = fence.group(1), []
        elif lang is not None and line.strip() == "```":
            found.append((lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return found


def prose(text: str) -> str:
    """The page without its code blocks and inline code, where links and headings live."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link markup reduced to its text, lower case, every
    character but letters, digits, marks, `_`, `-` and spaces dropped, spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    return anchors_in(path.read_text())


def anchors_in(text: str) -> set[str]:
    """Every anchor of a page, a repeated heading's with GitHub's -1, -2, … suffix."""
    seen: dict[str, int] = {}
    found = set()
    inside = False
    for line in text.splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not inside:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(page: Path, text: str) -> list[str]:
    problems = []
    for target in LINK.findall(prose(text)):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors_in(text):
                problems.append(f"{rel(page)}: {target}: no such anchor on the page")
            continue
        linked = (page.parent / path).resolve()
        if not linked.exists() or not linked.is_relative_to(ROOT):
            problems.append(f"{rel(page)}: {target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            problems.append(f"{rel(page)}: {target}: no such anchor in {rel(linked)}")
    return problems


# ---- the commands a page shows ------------------------------------------------------------------


def commands(block: str) -> list[str]:
    """The command lines of a bash block: comments dropped, `\\` continuations and the indented
    lines of a synopsis joined to the line they continue, split at `&&`, `||` and `;`."""
    logical: list[str] = []
    continues = False
    for raw in block.splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).rstrip()
        if not line.strip():
            continues = False
            continue
        if logical and (continues or raw[:1].isspace()):
            logical[-1] += " " + line.strip().removesuffix("\\")
        else:
            logical.append(line.strip().removesuffix("\\"))
        continues = line.endswith("\\")
    return [part.strip() for cmd in logical for part in re.split(r"&&|\|\||;", cmd) if part.strip()]


def uptrain_calls(block: str) -> list[tuple[str, str]]:
    """(command, what follows it) for every `uptrain COMMAND …` of a bash block, also as
    `.venv/bin/uptrain` or `-m uptrain` (the launcher's own flags before it are not its)."""
    calls = []
    for line in commands(block):
        match = re.search(rf"(?:^|[\s/])uptrain\s+({'|'.join(COMMANDS)})(?![\w-])(.*)", line)
        if match:
            calls.append((match.group(1), match.group(2)))
    return calls


@cache
def flags_of(command: str) -> frozenset[str]:
    """Every option string of `uptrain COMMAND`, from the parser `--help` prints."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return frozenset(sub._option_string_actions)


def unknown_flags(page: Path, text: str) -> list[str]:
    problems = []
    for lang, block in blocks(text):
        if lang != "bash":
            continue
        for command, rest in uptrain_calls(block):
            for flag in FLAG.findall(rest):
                if flag not in flags_of(command):
                    problems.append(f"{rel(page)}: `uptrain {command} {flag}`: no such flag in its --help")
    return problems


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_and_anchors_resolve(page):
    assert broken_links(page, page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_flag_shown_exists(page):
    assert unknown_flags(page, page.read_text()) == []


def test_the_checks_find_what_they_name(tmp_path):
    """A made-up flag, a missing page and a missing anchor are all found (the checks can fail)."""
    page = ROOT / "docs" / "planted.md"
    text = (
        "# A heading\n\n[fine](#a-heading) [here](#nope) [gone](commands/nope.md)"
        " [no anchor](commands/convert.md#nope)\n\n"
        "```bash\nuptrain convert SRC OUT -g 2 \\\n    --no-such-flag\n"
        "uptrain train --config x.yaml [--seq-len 256]\n"
        "accelerate launch --num_processes 2 -m uptrain train --made_up 1\n"
        "uptrain inspect SRC\n              [--nope]\n```\n"
    )
    assert unknown_flags(page, text) == [
        "docs/planted.md: `uptrain convert --no-such-flag`: no such flag in its --help",
        "docs/planted.md: `uptrain train --made_up`: no such flag in its --help",
        "docs/planted.md: `uptrain inspect --nope`: no such flag in its --help",
    ]
    assert broken_links(page, text) == [
        "docs/planted.md: #nope: no such anchor on the page",
        "docs/planted.md: commands/nope.md: no such file",
        "docs/planted.md: commands/convert.md#nope: no such anchor in docs/commands/convert.md",
    ]
    assert slug("In vLLM: `uptrain speed --engine vllm`") == "in-vllm-uptrain-speed---engine-vllm"
    assert slug("The paper's own setting: the reference T5") == "the-papers-own-setting-the-reference-t5"
    assert slug("Budgets and α") == "budgets-and-α"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_page_and_its_help_runs(command, capsys):
    assert (ROOT / "docs" / "commands" / f"{command}.md").is_file()
    with pytest.raises(SystemExit) as end:
        main([command, "--help"])
    assert end.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: uptrain {command} ")


def shown_runs() -> list[tuple[Path, str, str | None]]:
    """The bash blocks that only convert or inspect the shipped reference model, each with the
    output block that follows it (None where the page shows none)."""
    found = []
    for page in PAGES:
        shown = blocks(page.read_text())
        for i, (lang, block) in enumerate(shown):
            lines = commands(block) if lang == "bash" else []
            cheap = lines and all(
                re.fullmatch(r"uptrain (convert|inspect) uptrain/assets/reference( [\w./-]+)*", line) for line in lines
            )
            if cheap:
                after = shown[i + 1] if i + 1 < len(shown) and shown[i + 1][0] == "" else None
                found.append((page, block, after[1] if after else None))
    return found


def test_the_shown_conversions_and_inspections_run_as_shown(tmp_path, monkeypatch, capsys):
    """Each command as the CLI's `main` runs it from a shell, in a scratch folder where `uptrain/`
    is the clone's (so nothing is written into the repository); paths in the output are shown
    relative to that folder. In-process: the process-wide settings a conversion makes for itself
    (torch's threads, an environment default) are put back after it."""
    import torch

    runs = shown_runs()
    assert any("uptrain inspect" in block for _, block, _ in runs)  # the README's tour shows one
    (tmp_path / "uptrain").symlink_to(ROOT / "uptrain")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # restored after the test
    threads = torch.get_num_threads()
    try:
        for page, block, output in runs:
            for line in commands(block):
                assert main(shlex.split(line)[1:]) == 0, f"{rel(page)}: {line}\n{capsys.readouterr().err}"
            printed = capsys.readouterr().out.replace(f"{tmp_path}/", "").replace(f"{ROOT}/", "").rstrip("\n")
            if output is not None:
                assert printed == output.rstrip("\n"), f"{rel(page)}: {block}"
            for made in tmp_path.iterdir():
                if made.name != "uptrain":
                    shutil.rmtree(made)
    finally:
        torch.set_num_threads(threads)


def repo_files() -> list[Path]:
    """The repository's text files: tracked, or new and not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    files = []
    for name in listed:
        path = ROOT / name
        if path.is_file() and path.suffix in {".md", ".py", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json", ""}:
            files.append(path)
    return files


def missing_citations(name: str, text: str, markdown_names: set[str]) -> list[str]:
    problems = []
    for cited in re.findall(r"(?<![\w/.-])(?:\.\./)*(docs/[\w./-]*[\w/])", text):
        if not (ROOT / cited).exists():
            problems.append(f"{name}: {cited}")
    for cited in re.findall(r"(?<![\w./-])([\w-]+\.md)\b", text):
        if cited not in markdown_names and cited not in FOREIGN_MARKDOWN:
            problems.append(f"{name}: {cited}")
    return problems


def test_no_file_cites_a_docs_page_that_does_not_exist():
    files = repo_files()
    markdown_names = {path.name for path in files if path.suffix == ".md"}
    problems = []
    for path in files:
        if path == Path(__file__).resolve():  # its own planted examples below
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        problems += missing_citations(rel(path), text, markdown_names)
    assert problems == []
    planted = "see docs/NOTES.md §2, docs/commands/convert.md and NOTES.md"
    assert missing_citations("x", planted, markdown_names) == ["x: docs/NOTES.md", "x: NOTES.md"]


def test_every_module_the_layout_names_exists():
    layout = (ROOT / "docs" / "layout.md").read_text()
    tree = next(block for lang, block in blocks(layout) if lang == "")
    named = set(re.findall(r"(?<![\w/.])(\w+\.py)\b", tree))
    modules = {path.name for path in (ROOT / "uptrain").rglob("*.py")}
    assert named and named <= modules, sorted(named - modules)
