"""The manual: README.md stays short, every link in it and in docs/ resolves, every CLI option it
shows exists, its library example runs, and no file speaks of anything but the project."""

import contextlib
import io
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_BYTES = 15_000

# Talk about how the project was made rather than about the project: numbered work periods, tracker
# numbers and targets, experiments thrown away, machines borrowed for a while, and run folders named
# after work periods. The words are put together from pieces so that this file, scanned like every
# other, does not match its own patterns; the bare word for a period is fine (a Gradio one, pytest's
# fixture scope).
SES, ISS, TA, LT, DEV = "sess" + "ion", "iss" + "ue", "throw" + "away", "le" + "nt", "dev" + "ice"
TALK = re.compile(
    rf"\b{SES}s? ?-?\d+"
    rf"|\b(this|that|each|next|previous|earlier|later) {SES}'s (changes|machine|fresh machine|runs?|figures?|kernels|statistics|tables?|bench)\b"
    rf"|\b{ISS}s? #?\d+\b|\b{ISS}'s\b|\b{ISS} (targets?|notes?|tracker)\b"
    rf"|\b{TA}\b|\b{LT}\b|\b{DEV} tool\b|\.library/{DEV}"
    r"|runs/(search|probe|bench|b)1\d",
    re.IGNORECASE)
# A file named after a work period: cpu-avx2-bf16-s13-all60.md, notes-<period>4.txt, ...
PERIOD_NAME = re.compile(rf"(^|[-_./])s\d{{1,2}}([-_.]|$)|{SES}", re.IGNORECASE)
BINARY_SUFFIXES = (".safetensors", ".png", ".jpg", ".gz", ".pt", ".bin", ".so", ".whl")


def project_files() -> list[str]:
    """Tracked files (git ls-files); without git, every file outside hidden folders, venvs and runs/."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.SubprocessError):
        skip = {"runs", "node_modules", "__pycache__"}
        found = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in skip and not x.endswith("venv")]
            found += [str((Path(d) / f).relative_to(ROOT)) for f in files]
        return found


def text_of(rel: str) -> str | None:
    if rel.endswith(BINARY_SUFFIXES):
        return None
    data = (ROOT / rel).read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def markdown_files() -> list[Path]:
    return [README, ROOT / "assets" / "heads" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_targets(md: Path) -> list[str]:
    """The relative link and image targets of a markdown file, code blocks and spans left out."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s):, mailto:, an anchor in the same page
        out.append(target.split("#", 1)[0])
    return out


def test_readme_is_a_short_manual():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; keep it under {README_MAX_BYTES} and move depth to docs/"
    text = README.read_text(encoding="utf-8")
    for command in ("bash run.sh app", "bash run.sh test"):
        assert command in text


def test_every_relative_link_and_image_resolves():
    missing = []
    checked = 0
    for md in markdown_files():
        for target in relative_targets(md):
            checked += 1
            if not (md.parent / target).exists():
                missing.append(f"{md.relative_to(ROOT)} -> {target}")
    assert checked > 20  # the README and docs link to each other and to the reports
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("![shot](missing.png) [ok](x.md) [web](https://example.com) `[code](nope.md)` [a](#top)\n")
    targets = relative_targets(md)
    assert targets == ["missing.png", "x.md"]
    assert not (tmp_path / targets[0]).exists() and (tmp_path / targets[1]).exists()


def test_no_file_speaks_of_how_the_project_was_made():
    hits, named = [], []
    files = project_files()
    assert len(files) > 50
    for rel in files:
        if PERIOD_NAME.search(Path(rel).name):
            named.append(rel)
        text = text_of(rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = TALK.search(line)
            if m:
                hits.append(f"{rel}:{n}: ...{line[max(0, m.start() - 40):m.end() + 40]}...")
    assert not named, "files named after a work period:\n" + "\n".join(named)
    assert not hits, "lines about how the project was made rather than about the project:\n" + "\n".join(hits[:40])


@pytest.mark.parametrize("line, talks", [
    ("measured in {s} 13 on the AVX2 CPU", True),
    ("({s}s 1-10)", True),
    ("the {i}'s target is 1.15x", True),
    ("see {i} 24", True),
    ("a {t} probe, not committed", True),
    ("No GPU was {l} to this task", True),
    ("entmtp search --stats runs/search{n}-hydra-bf16", True),
    ("@pytest.fixture(scope=\"{s}\")", False),
    ("the lab's trees are offered in this {s}'s chat", False),
    ("Stop this {s}'s running reply at its next step", False),
    ("the 4000 prompts cached on that {s}'s machine", True),
    ("each layer is probed at load; this one {i}s half the instructions", False),
    ("trees/smollm2-135m-hydra-b16-tau.json", False),
])
def test_the_talk_pattern_is_precise(line, talks):
    assert bool(TALK.search(line.format(s=SES, i=ISS, t=TA, l=LT, n=15))) is talks


@pytest.mark.parametrize("name, period_named", [
    ("cpu-avx2-bf16-s13-all60.md", True), (f"notes-{SES}4.txt", True), ("s18.json", True),
    ("cpu-avx2-bf16-all60-2026-12-02.md", False), ("smollm2-135m-hydra-b16-tau.json", False),
    ("test_search.py", False),
])
def test_the_period_name_pattern_is_precise(name, period_named):
    assert bool(PERIOD_NAME.search(name)) is period_named


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(file, subcommand words, options) of every `entmtp ...` line in the manual's code blocks."""
    out = []
    for md in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for block in re.findall(r"```bash\n(.*?)```", md.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0]
                m = re.search(r"(?:^|\s)(?:-m )?entmtp\s+([a-z]+)(?:\s+(build|push))?(.*)", line)
                if m:
                    words = [m.group(1)] + ([m.group(2)] if m.group(2) else [])
                    out.append((md.name, " ".join(words), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(3))))
    return out


def test_every_option_the_manual_shows_exists():
    from entmtp.cli import main

    helps: dict[str, str] = {}
    missing = []
    shown = shown_commands()
    assert len(shown) > 15
    for source, words, options in shown:
        if words not in helps:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main([*words.split(), "--help"])
                except SystemExit:
                    pass
            helps[words] = buf.getvalue()
        if not helps[words]:
            missing.append(f"{source}: `entmtp {words}` has no --help")
            continue
        missing += [f"{source}: entmtp {words} {o}" for o in options if not re.search(re.escape(o) + r"\b", helps[words])]
    assert not missing, "options shown in the manual that the CLI does not have:\n" + "\n".join(sorted(set(missing)))


def test_the_readme_library_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    printed = out.getvalue()
    assert "'tau'" in printed and "'new_tokens': 48" in printed
