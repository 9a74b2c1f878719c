"""The documentation points only at things the repository has (no Ray, no engine; seconds).

- Every relative markdown link (`[text](path)`, `[text](path#anchor)`, images too) in
  README.md, docs/, cluster/, bench/results/ and models/ resolves to a file or folder, and
  an anchor into a markdown page names one of its headings.
- Every docs page that code cites (`docs/<page>.md` in *.py, *.yaml, *.sh, Makefile, ...)
  exists, and code cites docs pages by their path, not by a bare file name.
- No file mentions the development machine's shared folder, which users do not have.
- README.md stays a front door: at most 250 lines.
- docs/configuration.md's field reference is what scripts/gen_config_docs.py writes now, and
  cluster/grafana/adaspec-dashboard.json what scripts/gen_dashboard.py writes.

Each check collects `file:line: problem` lines, so a failure names every offender. The
`*_finds_*` tests feed each checker a broken sample, so every check is known to be able
to fail.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

# Built from pieces so that this file does not contain what it looks for.
FORBIDDEN = (".." + "/shared", "shared" + "/docs")

MARKDOWN_GLOBS = ("README.md", "docs/*.md", "cluster/**/*.md", "bench/results/**/*.md", "models/**/*.md")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".md"}
CODE_NAMES = {"Makefile", "Dockerfile"}
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "build", "dist"}

INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
DOCS_REF = re.compile(r"(?<![\w./-])docs/[\w./-]+\.md")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


# ----------------------------------------------------------------------------- helpers

def repo_files() -> list[Path]:
    """Files of the repository: tracked and untracked-but-not-ignored (git), else a walk."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             cwd=REPO, capture_output=True, check=True, timeout=30).stdout
        paths = [REPO / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in REPO.rglob("*") if not SKIP_DIRS & set(p.relative_to(REPO).parts)]
    return sorted(p for p in paths if p.is_file() and not SKIP_DIRS & set(p.relative_to(REPO).parts))


def read_text(path: Path) -> str | None:
    """The file as text, or None for a binary file."""
    with open(path, "rb") as f:
        if b"\0" in f.read(8192):
            return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def prose(markdown: str) -> str:
    """The text with fenced code blocks and inline code blanked, offsets and lines kept."""
    out, fence = [], None
    for line in markdown.split("\n"):
        marker = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)[0] * 3
            out.append("")
            continue
        if fence is not None:
            if line.lstrip().startswith(fence):
                fence = None
            out.append(" " * len(line))
            continue
        out.append(re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group()), line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(markdown).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(HTML_ANCHOR.findall(markdown))
    return out


def link_targets(markdown: str) -> list[tuple[int, str]]:
    """(line, target) of every inline and reference-style link outside code."""
    text = prose(markdown)
    found = [(line_of(text, m.start()), m.group(1)) for m in INLINE_LINK.finditer(text)]
    found += [(line_of(text, m.start()), m.group(1)) for m in REFERENCE_LINK.finditer(text)]
    return sorted(found)


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def broken_links(page: Path, markdown: str) -> list[str]:
    """`file:line: ...` for each relative link of `page` that does not resolve."""
    problems = []
    for line, target in link_targets(markdown):
        if is_external(target) or target.startswith("#"):
            continue  # http(s)://, mailto:, and anchors within the page
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve()
        where = f"{rel(page)}:{line}"
        if not dest.exists():
            problems.append(f"{where}: link to {target!r}: {rel(dest)} does not exist")
        elif anchor and dest.suffix == ".md" and dest.is_file():
            if anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: link to {target!r}: {rel(dest)} has no heading #{anchor}")
    return problems


def missing_docs_refs(path: Path, text: str) -> list[str]:
    """`file:line: ...` for each `docs/<page>.md` cited in `text` that the repository lacks,
    and for each docs page cited by its bare name (it resolves from nowhere)."""
    problems = []
    for m in DOCS_REF.finditer(text):
        if not (REPO / m.group()).is_file():
            problems.append(f"{rel(path)}:{line_of(text, m.start())}: cites {m.group()}, which does not exist")
    if path.suffix != ".md":
        pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
        for name in pages:
            # A quoted name is a path built in code (`REPO / "docs" / name`), not a citation.
            for m in re.finditer(rf"(?<![\w./'\"-]){re.escape(name)}\b", text):
                problems.append(f"{rel(path)}:{line_of(text, m.start())}: cites {name} without its path; "
                                f"write docs/{name}")
    return problems


def forbidden_mentions(path: Path, text: str) -> list[str]:
    problems = []
    for needle in FORBIDDEN:
        for m in re.finditer(re.escape(needle), text):
            problems.append(f"{rel(path)}:{line_of(text, m.start())}: mentions {needle!r}, a folder users do "
                            f"not have; point at the copy under docs/")
    return problems


def markdown_pages() -> list[Path]:
    pages = {p for pattern in MARKDOWN_GLOBS for p in REPO.glob(pattern)}
    return sorted(p for p in pages if p.is_file() and not SKIP_DIRS & set(p.relative_to(REPO).parts))


def is_code(path: Path) -> bool:
    return path.suffix in CODE_SUFFIXES or path.name in CODE_NAMES


def load_generator(name: str = "gen_config_docs"):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s):\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- the checks

def test_markdown_links_resolve():
    pages = markdown_pages()
    assert REPO / "README.md" in pages and len(pages) > 5
    problems = [p for page in pages for p in broken_links(page, page.read_text(encoding="utf-8"))]
    assert not problems, report(problems)


def test_cited_docs_files_exist():
    problems = []
    for path in repo_files():
        if is_code(path) and path != Path(__file__).resolve():
            text = read_text(path)
            if text is not None:
                problems += missing_docs_refs(path, text)
    assert not problems, report(problems)


def test_no_reference_to_the_shared_folder():
    problems = []
    for path in repo_files():
        text = read_text(path)
        if text is not None:
            problems += forbidden_mentions(path, text)
    assert not problems, report(problems)


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md:{README_MAX_LINES + 1}: README.md has {len(lines)} lines, at most {README_MAX_LINES}; "
        f"move detail into docs/")


def test_configuration_reference_is_generated():
    gen = load_generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    current = gen.generated_part(page)
    wanted = gen.render()
    if current != wanted:
        have, want = current.splitlines(), wanted.splitlines()
        start = page[:page.index(gen.BEGIN)].count("\n") + 3  # the page line the part starts on
        first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
        raise AssertionError(
            f"docs/configuration.md:{start + first}: the field reference is out of date with "
            f"serve_app/config.py; run `python scripts/gen_config_docs.py`\n"
            f"  page: {have[first] if first < len(have) else '<end>'}\n"
            f"  code: {want[first] if first < len(want) else '<end>'}")


def test_the_grafana_dashboard_is_generated():
    gen = load_generator("gen_dashboard")
    assert gen.DASHBOARD.read_text() == gen.render(), "run python scripts/gen_dashboard.py"


def test_every_config_field_is_described():
    gen = load_generator()
    from serve_app.config import AppConfig

    # Nested blocks, optional ones (`autoscaling`) included.
    models = [AppConfig] + [m for f in AppConfig.model_fields.values() if (m := gen.nested_model(f.annotation))]
    missing = [f"{m.__name__}.{name}" for m in models for name, f in m.model_fields.items() if not f.description]
    assert not missing, f"fields without a description (docs/configuration.md shows them empty): {missing}"
    rows = [line for line in gen.render().splitlines() if line.startswith("| `")]
    assert len(rows) == sum(len(m.model_fields) for m in models), "a field is missing from the reference"


# ----------------------------------------------------------------------------- the checks can fail

def test_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n\ntext\n")
    page = tmp_path / "page.md"
    text = ("[ok](there.md) [ok](there.md#a-heading) [web](https://example.com) [self](#top)\n"
            "```\n[in code](nowhere.md)\n```\n"
            "`[inline](nowhere.md)` [bad](missing.md)\n"
            "![bad image](img/none.png) and [bad anchor](there.md#no-such-heading)\n")
    problems = broken_links(page, text)
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"{page}:5: link to 'missing.md'")
    assert problems[1].startswith(f"{page}:6: link to 'img/none.png'")
    assert "has no heading #no-such-heading" in problems[2]


def test_slugs_follow_github():
    text = "# Benchmarks: does adaptation pay?\n## Native tree engine, served\n## Notes\n## Notes\n"
    assert anchors(text) == {"benchmarks-does-adaptation-pay", "native-tree-engine-served", "notes", "notes-1"}
    assert slug("Baselines measured here (2026-11-30; noisy machine, context only)") == \
        "baselines-measured-here-2026-11-30-noisy-machine-context-only"


def test_docs_ref_check_finds_a_missing_page():
    code = REPO / "pkg" / "mod.py"
    text = '"""Terms (docs/papers.md section 1).\n\nSee docs/no-such-page.md and papers.md."""\n'
    problems = missing_docs_refs(code, text)
    assert problems == [
        "pkg/mod.py:3: cites docs/no-such-page.md, which does not exist",
        "pkg/mod.py:3: cites papers.md without its path; write docs/papers.md",
    ], problems


def test_forbidden_check_finds_a_mention():
    text = "fine\nsee " + FORBIDDEN[0] + "/kuberay\nand " + FORBIDDEN[1] + "/x.md\n"
    problems = forbidden_mentions(REPO / "notes.txt", text)
    assert [p.split(": ")[0] for p in problems] == ["notes.txt:2", "notes.txt:3"], problems


def test_generated_part_check_finds_a_stale_page():
    gen = load_generator()
    stale = f"intro\n{gen.BEGIN}\n\n| `model` | str | old |\n\n{gen.END}\noutro\n"
    assert gen.generated_part(stale) != gen.render()
    fresh = gen.write(stale)
    assert gen.generated_part(fresh) == gen.render()
    assert fresh.startswith("intro\n") and fresh.endswith(f"{gen.END}\noutro\n")
