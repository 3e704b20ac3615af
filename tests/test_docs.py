"""The documentation site: mkdocs.yml's nav and the links between pages (always), and a strict build (where mkdocs,
mkdocs-material and mkdocstrings are installed: `pip install -e '.[docs]'`, or `make docs`)."""

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav lists, read without a YAML parser (the file's `nav:` block: `- Title: page.md`
    or `- page.md` lines, nested or not)."""
    lines = (ROOT / "mkdocs.yml").read_text().splitlines()
    start = lines.index("nav:") + 1
    pages = []
    for line in lines[start:]:
        if line and not line[0].isspace():  # the next top-level key ends the block
            break
        m = re.fullmatch(r"\s*-\s*(?:[^:]+:\s*)?(\S+\.md)\s*", line)
        if m:
            pages.append(m.group(1))
    return pages


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets and parentheses are code, not links."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The ids Python-Markdown's toc extension gives the page's headings (its default slugify, with `_1`, `_2`
    for repeats)."""
    seen: set[str] = set()
    for line in re.sub(r"^(```|~~~).*?^\1", "", page.read_text(), flags=re.S | re.M).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "").replace("*", "")
        text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        slug = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())
        unique, n = slug, 0
        while unique in seen:
            n += 1
            unique = f"{slug}_{n}"
        seen.add(unique)
    return seen


def test_nav_pages_exist_and_links_resolve():
    pages = nav_pages()
    assert pages, "mkdocs.yml lists no pages in its nav"
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"pages in mkdocs.yml's nav that docs/ lacks: {missing}"
    unlisted = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in pages)
    assert not unlisted, f"pages in docs/ that mkdocs.yml's nav leaves out: {unlisted}"

    broken = []
    for page in sorted(DOCS.rglob("*.md")):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of the site
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(DOCS)} -> {target}"
            if not dest.is_file():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "broken links in docs/:\n" + "\n".join(broken)


def test_site_builds_strictly(tmp_path):
    for module, package in (("mkdocs", "mkdocs"), ("material", "mkdocs-material"), ("mkdocstrings", "mkdocstrings"),
                            ("mkdocstrings_handlers.python", "mkdocstrings-python")):
        pytest.importorskip(module, reason=f"{package} is not installed (pip install -e '.[docs]', or make docs)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml",
                             "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "index.html").read_text().count('id="coop_arena.Budget"') == 1
