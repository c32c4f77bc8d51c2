"""The documentation: the MkDocs site in ``docs/`` builds in strict mode (a broken link, a
missing anchor or a page left out of the navigation fails it), and every relative link in the
README, which is not part of the site, points to a file and a section that exist."""

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_the_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, not a build warning.
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (site / "index.html").is_file() and (site / "getting-started" / "index.html").is_file()


def slug(heading: str) -> str:
    """A heading's anchor as the site (Python-Markdown's toc) and GitHub make it, for the
    headings these pages use: markup dropped, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lstrip("#").strip().replace("`", "").replace("**", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code blocks
    return {slug(line) for line in text.splitlines() if line.startswith("#")}


def test_every_relative_link_in_the_readme_points_to_a_file_that_exists():
    readme = ROOT / "README.md"
    links = [link for link in LINK.findall(readme.read_text())
             if not re.match(r"[a-z][a-z0-9+.-]*:", link)]  # not http:, mailto:, ...
    assert len(links) > 10
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else readme
        assert target.exists(), f"README links to {link}: no such file"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"README links to {link}: no such section"
