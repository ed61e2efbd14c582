"""Reading a student's notebook whatever their editor did to it, and matching its cells to the solution's.

Editors save nbformat 4.4 (no cell ids), regenerate ids, and students delete a stub and write their
answer in a new cell, or leave metadata a string, an id a list, tags a number. Cells are matched
in order (an alignment that never crosses), by id when the ids agree, else by content: a check cell
by its exact code, an exercise cell by the functions it defines or its ``# Exercise`` marker, any
other cell by similar text. What cannot be matched is said, never guessed silently.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from ..exercises import BEGIN, CHECK_TAG, make_exercise

_DEF = re.compile(r"^(?:async\s+)?def\s+(\w+)|^class\s+(\w+)", re.MULTILINE)
_MARK = re.compile(r"^\s*#\s*(Exercise\s+[\w.\-]+)", re.IGNORECASE | re.MULTILINE)


@dataclass
class Cell:
    """One cell, with every field coerced to what the grader expects (never raises)."""
    position: int                     # 1-based, in the notebook it came from
    cell_type: str
    source: str
    id: str | None = None
    tags: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict)

    @property
    def is_check(self) -> bool:
        return self.cell_type == "code" and CHECK_TAG in self.tags

    @property
    def is_exercise(self) -> bool:
        return BEGIN in self.source

    @property
    def defs(self) -> set[str]:
        return {a or b for a, b in _DEF.findall(self.source)}

    @property
    def marker(self) -> str:
        m = _MARK.search(self.source)
        return m.group(1).lower() if m else ""

    def preview(self) -> str:
        lines = [ln.strip() for ln in self.source.splitlines()]
        line = next((ln for ln in lines if ln and not ln.startswith("@")), "")
        return (line[:48] + "...") if len(line) > 48 else line


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(v if isinstance(v, str) else str(v) for v in value)
    return "" if value is None else str(value)


def coerce(raw, position: int) -> Cell:
    raw = raw if isinstance(raw, dict) else {}
    meta = raw.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    tags = meta.get("tags")
    tags = [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []
    cid = raw.get("id")
    ctype = raw.get("cell_type")
    return Cell(position, ctype if ctype in ("code", "markdown", "raw") else "raw", _text(raw.get("source")),
                cid if isinstance(cid, str) and cid else None, tags, raw)


def read_cells(path: Path) -> list[Cell]:
    """The cells of a student's notebook, or raise ValueError saying why it cannot be graded."""
    if path.suffix != ".ipynb":
        raise ValueError(f"{path.name} is not a notebook (expected a .ipynb file)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} is not valid notebook JSON ({e.__class__.__name__}): "
                         "was it saved completely?") from e
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path.name} has no list of cells")
    if nb.get("nbformat") not in (4, None):
        raise ValueError(f"{path.name} is nbformat {nb.get('nbformat')}; save it as a version 4 notebook")
    return [coerce(c, k + 1) for k, c in enumerate(nb["cells"])]


def normalized(s: str) -> str:
    return "\n".join(ln.rstrip() for ln in s.strip().splitlines())


def score(sol: Cell, ex_source: str, st: Cell) -> float:
    """How surely student cell ``st`` is solution cell ``sol`` (0: not at all)."""
    if sol.cell_type != st.cell_type:
        return 0.0
    if sol.id and st.id == sol.id:
        return 100.0
    s = normalized(st.source)
    if sol.is_check:
        return 90.0 if s == normalized(sol.source) else 0.0
    if s and s in (normalized(ex_source), normalized(sol.source)):
        return 90.0
    if sol.cell_type == "code":  # a cell that defines the same functions, or has the same marker
        shared = sol.defs & st.defs
        if shared or (sol.marker and sol.marker == st.marker):
            return 50.0 + len(shared)
        if sol.is_exercise:
            return 0.0
    m = difflib.SequenceMatcher(None, normalized(ex_source), s, autojunk=False)
    if m.real_quick_ratio() < 0.6 or m.quick_ratio() < 0.6:
        return 0.0
    r = m.ratio()
    return 20.0 * r if r >= 0.6 else 0.0


def align(solution: list[Cell], ex_sources: list[str], student: list[Cell]) -> dict[int, int]:
    """{solution index: student index}: the order-preserving matching of greatest total score."""
    n, m = len(solution), len(student)
    scores = [[score(solution[i], ex_sources[i], student[j]) for j in range(m)] for i in range(n)]
    best = [[0.0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            take = scores[i][j] + best[i + 1][j + 1] if scores[i][j] > 0 else -1.0
            best[i][j] = max(take, best[i + 1][j], best[i][j + 1])
    pairs, i, j = {}, 0, 0
    while i < n and j < m:
        if scores[i][j] > 0 and best[i][j] == scores[i][j] + best[i + 1][j + 1]:
            pairs[i] = j
            i, j = i + 1, j + 1
        elif best[i][j] == best[i + 1][j]:
            i += 1
        else:
            j += 1
    return pairs


def names_used(source: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


def import_source(cells: list[Cell]) -> str:
    """The top-level imports of the solution's given cells (what its check cells rely on)."""
    out = []
    for c in cells:
        if c.cell_type != "code" or c.is_check or c.is_exercise:
            continue
        try:
            tree = ast.parse(c.source)
        except SyntaxError:
            continue
        out += [ast.unparse(s) for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    return "\n".join(out)


def exercise_cells_for(solution: list[Cell], k: int) -> list[int]:
    """Indices of the exercise cells that solution check cell ``k`` judges (for 'look at cell N')."""
    check = solution[k]
    exercises = [i for i, c in enumerate(solution[:k]) if c.cell_type == "code" and c.is_exercise]
    used = names_used(check.source)
    found = [i for i, c in enumerate(solution[:k]) if c.cell_type == "code" and not c.is_check and c.defs & used]
    if not found:
        words = {w for w in re.findall(r"[a-z_]{4,}", check.source.splitlines()[0].lower())}
        found = [i for i in exercises
                 if words & ({w for d in solution[i].defs for w in d.lower().split("_") if len(w) > 3}
                             | set(re.findall(r"[a-z_]{4,}", solution[i].marker)))]
    if not found:
        prev = max([i for i, c in enumerate(solution[:k]) if c.is_check], default=-1)
        found = [i for i in exercises if i > prev]
    return found


def identify(student: list[Cell], solutions: Path) -> Path | None:
    """The solution a notebook of any file name answers: the one whose check cells it holds most of."""
    best, best_score = None, 0.0
    for path in sorted(solutions.glob("*.ipynb")):
        sol = [coerce(c, k + 1) for k, c in enumerate(nbformat.read(path, as_version=4).cells)]
        ex = [c["source"] for c in make_exercise(nbformat.read(path, as_version=4), path.name).cells]
        pairs = align(sol, ex, student)
        checks = sum(sol[i].is_check for i in pairs)
        score = sum(1 for _ in pairs) + 10 * checks
        if checks and score > best_score:
            best, best_score = path, score
    return best
