"""The docs are true about the files: every repository path they cite exists, every local link
resolves, and README.md stays short (issue 26, "Docs that are true and short").

A citation is a word that looks like a repository file: segments joined by `/`, ending in one
of CITED_SUFFIXES (`mtpkit/engine/kv_pools.py`, `engine/kv_pools.py`, `tests/test_layout.py`,
`benchmarks/results/cpu-*.log`: a `*` glob must match at least one file). It is looked for in the
comments and strings of the package's, tests', benchmarks', examples' and training code, and in
the Markdown pages and notebooks. It resolves against the citing file's directory or any
directory above it up to the repository root, or against mtpkit/ (`engine/kv_pools.py` from
anywhere). Bare names without a `/` are too ambiguous to check (`loader.py` of which
package?), except Markdown pages (`README.md`): those are few and must exist beside the citing
file, above it or in docs/. Names of files outside the repository are written as modules
(`transformers.generation.utils`), which no rule mistakes for a repository path.
"""

import glob
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
CITED_SUFFIXES = ("py", "md", "sh", "json", "ipynb", "log", "png")

# Not preceded by a path character (so a URL's tail or a longer path's middle never starts a match).
_PATH = re.compile(r"(?<![\w./*{}\\-])((?:[\w.*-]+/)+[\w.*-]*\.(?:" + "|".join(CITED_SUFFIXES) + r"))(?![\w/])")
_BARE_MD = re.compile(r"(?<![\w./*{}\\-])([\w-]+\.md)(?![\w/])")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def code_files(root: Path) -> list[Path]:
    """The Python files whose comments and strings are read: not this one, whose checks of the
    checkers plant bad paths on purpose."""
    files = sorted((root / "mtpkit").rglob("*.py"))
    for sub in ("tests", "benchmarks", "examples", "training"):
        files += sorted((root / sub).rglob("*.py"))
    return [f for f in files if f.resolve() != Path(__file__).resolve()]


def page_files(root: Path) -> list[Path]:
    """Markdown pages and notebooks: read whole (a notebook as its JSON text)."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    pages += sorted((root / "mtpkit").rglob("*.md")) + sorted((root / "examples").glob("*.ipynb"))
    return [p for p in pages if p.exists()]


def commented_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string of a Python file, one entry per line."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out += [(tok.start[0] + k, line) for k, line in enumerate(tok.string.splitlines())]
    return out


def _exists(root: Path, citing: Path, cited: str, bare_md: bool) -> bool:
    here = citing.parent
    bases = [here, *[d for d in here.parents if d == root or root in d.parents]]
    bases += [root / "docs"] if bare_md else [root / "mtpkit"]
    for base in bases:
        target = base / cited
        if glob.glob(str(target)) if "*" in cited else target.exists():
            return True
    return False


def bad_citations(root: Path) -> list[str]:
    """`file:line: path` for every cited repository path that does not exist."""
    bad = []
    sources = [(p, commented_text(p)) for p in code_files(root)]
    sources += [(p, list(enumerate(p.read_text().splitlines(), 1))) for p in page_files(root)]
    for path, lines in sources:
        rel = path.relative_to(root)
        for line, text in lines:
            for m in _PATH.finditer(text):
                if not _exists(root, path, m.group(1), bare_md=False):
                    bad.append(f"{rel}:{line}: {m.group(1)}")
            for m in _BARE_MD.finditer(text):
                if not _exists(root, path, m.group(1), bare_md=True):
                    bad.append(f"{rel}:{line}: {m.group(1)}")
    return bad


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (of rendered text: no backticks or stars)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(github_anchor(line.lstrip("#")))
    return found


def bad_links(root: Path) -> list[str]:
    """`file:line: target` for every local Markdown link (README.md, docs/*.md) whose file, or
    whose #anchor in a Markdown page, does not exist. Resolved as Markdown does: against the
    page's own directory."""
    bad = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not page.exists():
            continue
        for line, text in enumerate(page.read_text().splitlines(), 1):
            for m in _LINK.finditer(text):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target):      # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file) if file else page
                ok = dest.exists()
                if ok and anchor and dest.suffix == ".md":
                    ok = anchor in anchors(dest)
                if not ok:
                    bad.append(f"{page.relative_to(root)}:{line}: {target}")
    return bad


# ---- the repository -----------------------------------------------------------------------


def test_every_cited_path_exists():
    bad = bad_citations(ROOT)
    assert not bad, "paths cited but not in the repository:\n" + "\n".join(bad)


def test_every_local_markdown_link_resolves():
    bad = bad_links(ROOT)
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (move detail to docs/)"


def test_readme_keeps_the_test_command():
    """.ci/run runs the README's test command: the quick start's command is .ci/run's last line."""
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert ci.startswith("python -m pytest -q"), ci
    quick = [line.split("#")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("python -m pytest")]
    assert quick == [ci], f"README's quick start runs {quick}, .ci/run runs {ci!r}"


# ---- the checkers, on planted faults ------------------------------------------------------


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "mtpkit" / "engine").mkdir(parents=True)
    (tmp_path / "mtpkit" / "engine" / "kv_pools.py").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## Kernels and Ops\n")
    (tmp_path / "tests").mkdir()
    return tmp_path


def test_checker_reports_every_planted_bad_citation(tmp_path):
    root = _tree(tmp_path)
    missing, design, layers = "mtpkit/" "attn/" "backend.py", "DESIGN" ".md", "models/" "layers.py"
    (root / "mtpkit" / "engine" / "runner.py").write_text(
        '"""Pools: engine/kv_pools.py, kv_pools.py (bare), mtpkit/engine/kv_pools.py."""\n'
        "x = 1\n"
        f"# moved from {missing}, see {design}\n"
        "# and ../" "engine/kv_pools.py, " + layers + "\n")
    (root / "README.md").write_text("See docs/design.md and `benchmarks/results/" "cpu-*.log`.\n")
    (root / "tests" / "test_a.py").write_text("# engine/kv_pools.py from the tests: via mtpkit/\n")
    assert bad_citations(root) == [
        f"mtpkit/engine/runner.py:3: {missing}",
        f"mtpkit/engine/runner.py:3: {design}",
        f"mtpkit/engine/runner.py:4: {layers}",
        "README.md:1: benchmarks/results/cpu-*.log",
    ]
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "benchmarks" / "results" / "cpu-1.log").write_text("")
    assert "README.md:1: benchmarks/results/cpu-*.log" not in bad_citations(root)


def test_checker_reports_every_planted_bad_link(tmp_path):
    root = _tree(tmp_path)
    (root / "README.md").write_text(
        "[design](docs/design.md) [kernels](docs/design.md#kernels-and-ops) [web](https://x.org/a.md)\n"
        "[gone](docs/" "gone.md) [no section](docs/design.md#nowhere)\n"
        "![picture](docs/" "notebook.png)\n")
    (root / "docs" / "api.md").write_text("[back](../README.md) [self](#api) [design](design.md)\n\n# API\n")
    assert bad_links(root) == [
        "README.md:2: docs/gone.md",
        "README.md:2: docs/design.md#nowhere",
        "README.md:3: docs/notebook.png",
    ]
