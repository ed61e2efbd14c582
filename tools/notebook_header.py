"""Write (or refresh) the first two code cells of every notebook of the course.

    python tools/notebook_header.py            # notebooks/ and solutions/ (then: make exercises)
    python tools/notebook_header.py --check    # exit 1 if any notebook's header is missing or stale
    python tools/notebook_header.py --repo https://github.com/OWNER/REPO  a.ipynb b.ipynb
    python tools/notebook_header.py --badges   # print the README's "Open in Colab" table, change nothing

Cell 1 (id ``colab-setup``): on Google Colab only, installs ``course_utils`` from the repository and
keeps Colab's torch and triton (its source comes from :func:`course_utils.colab.setup_cell_source`).
Cell 2 (id ``banner``): ``import course_utils as cu`` and ``print(cu.banner())``; an existing banner
cell is kept as it is and moved second, a missing one is added.

Idempotent: a notebook whose header is already right is not rewritten. exercises/ is generated from
solutions/, so run ``make exercises`` afterwards. The repository URL comes from --repo, else the
COURSE_REPO_URL environment variable, else ``[project.urls] Repository`` in pyproject.toml, else
``course_utils.colab.DEFAULT_REPO_URL``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat

try:
    import tomllib
except ImportError:  # Python 3.10: the URL then comes from --repo or COURSE_REPO_URL
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent


def _load_colab():
    """course_utils/colab.py alone: importing the package would import torch and pick a mode."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_course_colab", ROOT / "course_utils" / "colab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


colab = _load_colab()

BANNER_ID = "banner"
BANNER_SOURCE = "import course_utils as cu\n\nprint(cu.banner())"
DEFAULT_DIRS = ("notebooks", "solutions")


def repo_url(cli: str | None = None, root: Path = ROOT) -> str:
    """The repository the Colab cell installs from (see the module docstring for the order)."""
    if cli:
        return cli
    if os.environ.get("COURSE_REPO_URL"):
        return os.environ["COURSE_REPO_URL"]
    pyproject = root / "pyproject.toml"
    if tomllib is not None and pyproject.exists():
        urls = tomllib.loads(pyproject.read_text()).get("project", {}).get("urls", {})
        for key in ("Repository", "repository", "Source", "Homepage"):
            if urls.get(key):
                return urls[key]
    return colab.DEFAULT_REPO_URL


def _code_cell(cell_id: str, source: str):
    cell = nbformat.v4.new_code_cell(source)
    cell["id"] = cell_id
    cell["metadata"] = {}
    return cell


def apply_header(nb, url: str) -> bool:
    """Put the Colab cell first and the banner cell second, in place. True when ``nb`` changed."""
    cells = nb.cells
    setup = [c for c in cells if c.get("id") == colab.CELL_ID]
    banner = [c for c in cells if c.get("id") == BANNER_ID]
    for cell_id, found in ((colab.CELL_ID, setup), (BANNER_ID, banner)):
        if len(found) > 1:
            raise ValueError(f"{len(found)} cells have the id {cell_id!r}; cell ids must be unique")
    before = nbformat.writes(nb)
    rest = [c for c in cells if c.get("id") not in (colab.CELL_ID, BANNER_ID)]
    cell = setup[0] if setup else _code_cell(colab.CELL_ID, "")
    cell["cell_type"] = "code"
    cell["source"] = colab.setup_cell_source(url)
    cell["outputs"] = []
    cell["execution_count"] = None
    cell.setdefault("metadata", {})
    banner_cell = banner[0] if banner else _code_cell(BANNER_ID, BANNER_SOURCE)
    nb.cells = [cell, banner_cell, *rest]
    if nb.nbformat == 4 and nb.nbformat_minor < 5:
        nb.nbformat_minor = 5  # cell ids exist from 4.5 on
    return nbformat.writes(nb) != before


def notebooks_in(paths: list[str], root: Path = ROOT) -> list[Path]:
    if not paths:
        paths = [str(root / d) for d in DEFAULT_DIRS]
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.glob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.suffix == ".ipynb" and p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"not a notebook or a folder: {p}")
    return found


def _title(path: Path) -> str:
    """The notebook's first Markdown heading, else its file name."""
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return path.stem


def badge_table(paths: list[Path], url: str, branch: str = "main", root: Path = ROOT) -> str:
    """A Markdown table: one row per notebook, with its title and an "Open in Colab" badge."""
    rows = ["| notebook | | |", "| --- | --- | --- |"]
    for p in paths:
        rel = p.resolve().relative_to(root).as_posix()
        rows.append(f"| `{rel}` | {_title(p)} | {colab.badge_markdown(url, rel, branch)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/ solutions/)")
    ap.add_argument("--repo", help="repository URL the Colab cell clones")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a header is stale")
    ap.add_argument("--badges", action="store_true", help="print a Markdown table of Open-in-Colab links")
    ap.add_argument("--branch", default="main", help="branch the Colab links open (default main)")
    args = ap.parse_args(argv)
    url = repo_url(args.repo)
    if args.badges:
        print(badge_table(notebooks_in(args.paths or [str(ROOT / "notebooks")]), url, args.branch))
        return 0
    stale = []
    for path in notebooks_in(args.paths):
        nb = nbformat.read(path, as_version=4)
        if apply_header(nb, url):
            stale.append(path)
            if not args.check:
                nbformat.write(nb, path)
    verb = "stale" if args.check else "updated"
    for path in stale:
        print(f"{verb}: {path}")
    if args.check:
        if stale:
            print("run: python tools/notebook_header.py && make exercises")
        return 1 if stale else 0
    if any(p.parent.name == "solutions" for p in stale):
        print("solutions changed: run `make exercises` (or `make solutions`) to regenerate exercises/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
