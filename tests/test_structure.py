"""The package's house rules, checked on the source (CPU, no GPU, no DSL import).

* Arrows: nothing under ``cute_mla/kernels/`` imports the API (``cute_mla.interface``) or the plan,
  and nothing under ``cute_mla/scheduler/`` imports a kernel module.
* Each fact has one place: a V3.2 row's byte count appears in its format module only, and arch
  names in the arch table only.
* Functions stay readable: at most 200 lines and 14 parameters (kernel entry points and
  FlashMLA's own signature excepted).
* Comments explain the code in its own terms: no session dates, commit hashes, notebook or
  out-of-repository references.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "cute_mla"
MODULES = sorted(ROOT.rglob("*.py"))
MAX_LINES = 200
MAX_PARAMS = 14
# FlashMLA's own signature, which the drop-in must keep
PARAM_EXEMPT = {"flash_mla_with_kvcache"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path):
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            yield mod
            for a in node.names:     # "from .. import interface" names a module too
                yield f"{mod}.{a.name}"


def _under(path: pathlib.Path, folder: str) -> bool:
    return path.relative_to(ROOT).parts[0] == folder


@pytest.mark.parametrize("folder,forbidden", [
    ("kernels", ("cute_mla.interface", "cute_mla.plan")),
    ("scheduler", ("cute_mla.kernels",)),
    ("formats", ("cute_mla.kernels", "cute_mla.interface", "cute_mla.plan")),
    ("dsl", ("cute_mla.kernels", "cute_mla.interface", "cute_mla.plan", "cute_mla.scheduler")),
])
def test_import_arrows(folder, forbidden):
    bad = [(str(p.relative_to(ROOT)), m) for p in MODULES if _under(p, folder) for m in _imports(p)
           if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{folder}/ must not import {forbidden}: {bad}"


def test_import_arrows_test_can_fail():
    """The resolver sees a relative import two levels up (what a wrong arrow looks like)."""
    api = ROOT / "interface" / "api.py"
    assert "cute_mla.plan.schedule" in set(_imports(api))


@pytest.mark.parametrize("row_bytes, module", [(656, "formats/v32.py"), (584, "formats/v4.py")])
def test_row_bytes_declared_once(row_bytes, module):
    """A format's row size is a fact of its format module; kernels read it from the spec."""
    hits = [str(p.relative_to(ROOT)) for p in MODULES if re.search(rf"(?<![\d.]){row_bytes}(?![\d])", p.read_text())]
    assert hits == [module], f"the row size {row_bytes} appears outside its format module: {hits}"


def test_sm90_roles_read_the_format_from_the_config():
    """SM90's module-level TILE is the V3.2 tile: format-dependent facts come from ``cfg.tile``."""
    fields = r"d_qk|d_nope|row_bytes|data_row_bytes|scale_offset|rope_offset|fmt|nope_chunks|chunks|k_tile_bytes|" \
             r"k_tile_elems|q_elems|slots_per_row|scale_reg|rope_reg|scale_words"
    hits = [f"{p.relative_to(ROOT)}:{m.group(0)}" for p in MODULES if "kernels/sm90" in str(p)
            for m in re.finditer(rf"\bTILE\.({fields})\b", p.read_text())]
    assert hits == [], f"format-dependent tile facts read from the V3.2 TILE: {hits}"


@pytest.mark.parametrize("literal", ["sm_90a", "sm_100a"])
def test_arch_names_in_the_arch_table_only(literal):
    """Code names an arch through ``cute_mla.archs`` (prose may still say which arch a module is for)."""
    hits = [str(p.relative_to(ROOT)) for p in MODULES for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, ast.Constant) and node.value == literal]
    assert hits == ["archs.py"], f"{literal!r} spelled outside cute_mla/archs.py: {hits}"


def _decorators(fn) -> set:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(ast.unparse(d))
    return names


def _is_entry_point(fn) -> bool:
    """A ``@cute.kernel``, or a ``@cute.jit`` host entry (``__call__`` / ``host*`` / ``_*host*``):
    their parameters are the kernel's launch arguments."""
    decs = _decorators(fn)
    if "cute.kernel" in decs:
        return True
    return "cute.jit" in decs and (fn.name == "__call__" or "host" in fn.name)


def _functions():
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield p, node


def test_functions_are_short():
    long = [f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for p, fn in _functions() if fn.end_lineno - fn.lineno + 1 > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_functions_take_few_parameters():
    def count(fn):
        a = fn.args
        return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)

    many = [f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} ({count(fn)})" for p, fn in _functions()
            if count(fn) > MAX_PARAMS and fn.name not in PARAM_EXEMPT and not _is_entry_point(fn)]
    assert not many, f"functions with more than {MAX_PARAMS} parameters (bundle them): {many}"


HISTORY = [
    (r"\b20\d\d-\d\d-\d\d\b", "a date"),
    (r"\bsession\b", "a session"),
    (r"NOTES\.md", "the old notebook"),
    (r"\.\./shared|shared/reference|shared/seed", "a path outside the repository"),
    (r"spec §|§\s?\d", "an external spec section"),
    # a commit hash: 7-40 hex digits with a digit and a letter, not a 0x literal or part of a word
    (r"(?<![0-9A-Za-z_x])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])", "a commit hash"),
]


@pytest.mark.parametrize("pattern,what", HISTORY)
def test_comments_carry_no_history(pattern, what):
    hits = []
    for p in MODULES:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if re.search(pattern, line):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, f"{what} in cute_mla/ (history belongs in git and docs/performance.md): {hits[:10]}"


def test_history_patterns_catch_examples():
    samples = {"a date": "measured 2026-12-03", "a commit hash": "fixed at 28c5a2a", "the old notebook": "see NOTES.md",
               "a path outside the repository": "../shared/reference/x.md", "an external spec section": "(spec §4.5)"}
    for pattern, what in HISTORY:
        if what in samples:
            assert re.search(pattern, samples[what]), what
    assert not re.search(HISTORY[-1][0], "mask 0x87F087F0 and 0x007FFFFF")

