"""Tampering with the checks is detected, in two layers (the grader's threat model is in README.md).

1. :func:`scan` reads a student's code cells before anything runs and reports, with the cell and
   the line, every statement that changes what a check relies on: assigning to (or ``setattr`` /
   ``delattr`` on) anything imported from ``course_utils``, edits of ``sys.modules``, ``builtins``,
   ``print``, torch or triton, ``importlib.reload``, ``__code__`` swaps, IPython hooks that rewrite or
   swallow cells, and writes into the course's files.
2. :func:`course_utils.grade.guard.arm`, run by a cell the grader puts before the student's first
   cell, records every function,
   class and constant of the loaded ``course_utils`` modules (with their code objects), ``builtins``,
   torch's public functions and IPython's input hooks. Each check cell then calls the recorded
   :class:`Guard` before and after it runs: the check's names are re-bound to the recorded objects
   and anything that changed since fails the cell with :class:`IntegrityError`, naming what changed.

A determined cheat with full control of the Python process (ctypes, C extensions, obfuscated code
run by ``exec``) is outside what this can guarantee; the grader says so.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

COURSE = "course_utils"
CODE_ATTRS = {"__code__", "__globals__", "__defaults__", "__kwdefaults__", "__closure__", "__dict__", "__class__"}
MUTATORS = {"pop", "update", "setdefault", "clear", "popitem", "__setitem__", "__delitem__", "__setattr__",
            "__delattr__"}
FILE_WRITES = {"write_text", "write_bytes", "unlink", "rename", "replace", "rmdir", "touch", "symlink_to",
               "remove", "copy", "copy2", "copyfile", "copytree", "move", "rmtree", "system", "run", "Popen",
               "call", "check_call", "check_output"}
IPYTHON_HOOKS = {"input_transformers_cleanup", "input_transformers_post", "ast_transformers", "set_custom_exc",
                 "custom_exceptions", "events", "showtraceback", "register_magic_function", "run_cell",
                 "user_ns", "displayhook", "display_pub"}
LIBRARIES = {"torch", "triton", "numpy"}
KINDS = {"course": "the course (course_utils)", "sys": "the interpreter (sys)", "builtins": "builtins",
         "lib": "a library the checks use", "ipython": "IPython"}


@dataclass
class Finding:
    cell: int   # 1-based position of the cell in the student's notebook
    line: int
    what: str

    def __str__(self) -> str:
        return f"cell {self.cell}, line {self.line}: {self.what}"


def _clean(source: str) -> tuple[str, list[str]]:
    """Python source with IPython magics blanked (line numbers kept), and the magic lines."""
    lines, magics = source.split("\n"), []
    if lines and lines[0].lstrip().startswith("%%"):
        magics.append(lines[0].strip())
        if lines[0].split()[0] not in ("%%time", "%%timeit", "%%capture"):
            return "", magics + lines[1:]
        lines = ["pass", *lines[1:]]
    out = []
    for ln in lines:
        s = ln.lstrip()
        if s.startswith(("%", "!")):
            magics.append(s)
            out.append(ln[: len(ln) - len(s)] + "pass")
        else:
            out.append(ln)
    return "\n".join(out), magics


class _Scanner(ast.NodeVisitor):
    def __init__(self):
        self.kinds: dict[str, str] = {"sys": "sys", "builtins": "builtins", "__builtins__": "builtins"}
        self.findings: list[tuple[int, str]] = []

    # ---- what an expression refers to
    def kind(self, node) -> str | None:
        if isinstance(node, ast.Name):
            return self.kinds.get(node.id)
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
            return self.kind(node.value)
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if fname == "get_ipython":
                return "ipython"
            if fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                return _module_kind(str(node.args[0].value))
            if fname in ("getattr", "vars") and node.args:
                return self.kind(node.args[0])
        return None

    def flag(self, node, what: str) -> None:
        self.findings.append((getattr(node, "lineno", 0), what))

    def _target(self, t, node) -> None:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self._target(e, node)
            return
        if isinstance(t, ast.Attribute) and t.attr in CODE_ATTRS:
            self.flag(node, f"assigns {ast.unparse(t)}: swapping a function's {t.attr} changes what it runs")
        elif isinstance(t, (ast.Attribute, ast.Subscript)):
            k = self.kind(t.value)
            if k:
                self.flag(node, f"changes {ast.unparse(t)}, which belongs to {KINDS[k]}")
        elif isinstance(t, ast.Name) and t.id in ("print", "__builtins__", "__import__"):
            self.flag(node, f"rebinds {t.id}")
        elif isinstance(t, ast.Name) and self.kinds.get(t.id) == "course":
            self.flag(node, f"rebinds {t.id}, which the notebook imported from course_utils (pick another name)")

    # ---- statements
    def visit_Import(self, node):
        for a in node.names:
            k = _module_kind(a.name)
            if a.name.split(".")[0] == "ctypes":
                self.flag(node, "imports ctypes, which can rewrite the checks in memory")
            if a.name.startswith((f"{COURSE}.integrity", f"{COURSE}.grade")):
                self.flag(node, f"imports the grader's own module {a.name}")
            if k:
                self.kinds[a.asname or a.name.split(".")[0]] = k

    def visit_ImportFrom(self, node):
        mod = node.module or ""
        if mod.startswith((f"{COURSE}.integrity", f"{COURSE}.grade")) or (
                mod == COURSE and any(a.name in ("integrity", "grade") for a in node.names)):
            self.flag(node, f"imports the grader's own module from {mod}")
        k = _module_kind(mod)
        if mod in ("importlib", "imp") and any(a.name == "reload" for a in node.names):
            self.kinds["reload"] = "reload"
        if k:
            for a in node.names:
                self.kinds[a.asname or a.name] = k

    def visit_Assign(self, node):
        for t in node.targets:
            self._target(t, node)
        k = self.kind(node.value)
        for t in node.targets:
            if isinstance(t, ast.Name):
                if k:
                    self.kinds[t.id] = k
                elif self.kinds.get(t.id) != "course":
                    self.kinds.pop(t.id, None)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._target(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node):
        for t in node.targets:
            if not isinstance(t, ast.Name):
                self._target(t, node)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if node.attr in IPYTHON_HOOKS and self.kind(node.value) == "ipython":
            self.flag(node, f"uses IPython's {node.attr}, which can rewrite or silence the check cells")
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        args = node.args
        if fname in ("setattr", "delattr", "__setattr__", "__delattr__") and args:
            k = self.kind(args[0]) or (self.kind(f.value) if isinstance(f, ast.Attribute) else None)
            if k:
                self.flag(node, f"{fname} on {ast.unparse(args[0])}, which belongs to {KINDS[k]}")
            elif len(args) > 1 and isinstance(args[1], ast.Constant) and args[1].value in CODE_ATTRS:
                self.flag(node, f"{fname}(..., {args[1].value!r}) swaps what a function runs")
        elif fname == "reload" or self.kinds.get(fname) == "reload":
            self.flag(node, "reloads a module: the checks must run the course's code as it was imported")
        elif fname in MUTATORS and isinstance(f, ast.Attribute) and self.kind(f.value):
            self.flag(node, f"{ast.unparse(f)}(...) edits {KINDS[self.kind(f.value)]}")
        elif fname in ("exec", "eval", "compile") and isinstance(f, ast.Name):
            self.flag(node, f"{fname}() runs code built at run time, which the grader cannot check")
        elif fname in ("settrace", "setprofile", "addaudithook", "get_referents", "get_referrers"):
            self.flag(node, f"{fname}() can change the checks while they run")
        elif fname == "open" and _writes(node) and _mentions_course(node, self):
            self.flag(node, "opens one of the course's files for writing")
        elif fname in FILE_WRITES and _mentions_course(node, self):
            self.flag(node, f"{fname}() on the course's files")
        self.generic_visit(node)


def _module_kind(name: str) -> str | None:
    top = name.split(".")[0]
    return {"course_utils": "course", "sys": "sys", "builtins": "builtins"}.get(
        top, "lib" if top in LIBRARIES else None)


def _writes(call: ast.Call) -> bool:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and bool(set(mode.value) & set("wax+"))


def _mentions_course(call: ast.Call, scanner: _Scanner) -> bool:
    for n in ast.walk(call):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(
                r"course_utils|solutions/|exercises/|notebooks/|results/|checkers", n.value):
            return True
        if isinstance(n, ast.Attribute) and n.attr in ("__file__", "__path__"):
            return True
        if isinstance(n, ast.Name) and scanner.kinds.get(n.id) == "course":
            return True
    return False


def scan(cells: list[tuple[int, str]]) -> list[Finding]:
    """Findings over ``(cell number, source)`` pairs, read in order (imports carry over)."""
    scanner, findings = _Scanner(), []
    for number, source in cells:
        text, magics = _clean(source)
        for m in magics:
            word = m.split()[0]
            if word in ("%autoreload", "%aimport", "%%writefile", "%run", "%load") or (
                    "course_utils" in m and word not in ("%timeit", "%time")):
                findings.append(Finding(number, 1 + source.split("\n").index(m) if m in source.split("\n")
                                        else 1, f"the magic {word} can reload or rewrite the course's code"))
        if not text.strip():
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue  # it fails when it runs, with Python's own message
        scanner.findings = []
        scanner.visit(tree)
        findings += [Finding(number, line, what) for line, what in scanner.findings]
    return findings
