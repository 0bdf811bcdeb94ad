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



# ------------------------------------------------------------------ the lab stays small and outside

REPO = ROOT.parent
MAX_BENCH_SCRIPTS = 8
MAX_RESULT_FILES = 30
GPU_MODEL = re.compile(r"\b(?:[AHBL]\d{2,3}S?|GB\d{3}|RTX ?\d{4})\b")
BENCH_PATH = re.compile(r"\bbenchmarks/|\bbenchmarks\.\w")


def bench_scripts(folder: pathlib.Path):
    """The top-level scripts of a benchmarks folder (``__init__.py`` is the package, not a tool)."""
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py")


def result_files(folder: pathlib.Path):
    return sorted(p.name for p in (folder / "results").iterdir()) if (folder / "results").is_dir() else []


def module_assignments(source: str, package: str = "cute_mla"):
    """Assignments (``x.attr = ...``, ``setattr(x, ...)``, ``del x.attr``) to an attribute of a name
    bound to ``package`` or one of its modules by an import in ``source``."""
    import importlib.util

    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == package or a.name.startswith(package + "."):
                    bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and (node.module == package
                                                                    or node.module.startswith(package + ".")):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    is_module = importlib.util.find_spec(full) is not None
                except (ImportError, ValueError):
                    is_module = False
                if is_module:
                    bound.add(a.asname or a.name)

    def rooted(expr):
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in bound

    hits = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and rooted(node.args[0])):
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets += t.elts
            elif isinstance(t, ast.Attribute) and rooted(t.value):
                hits.append(f"{node.lineno}: {ast.unparse(t)}")
    return hits


def comment_lines(source: str):
    """(line number, text) of every comment and docstring line of a module."""
    import io
    import tokenize

    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body and isinstance(node.body[0], ast.Expr):
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def comment_hits(source: str):
    return [f"{n}: {text.strip()[:100]}" for n, text in comment_lines(source)
            if GPU_MODEL.search(text) or BENCH_PATH.search(text)]


def test_benchmarks_keep_at_most_eight_scripts_and_thirty_results():
    scripts, results = bench_scripts(REPO / "benchmarks"), result_files(REPO / "benchmarks")
    assert len(scripts) <= MAX_BENCH_SCRIPTS, f"benchmarks/ has {len(scripts)} scripts (at most {MAX_BENCH_SCRIPTS}): {scripts}"
    assert len(results) <= MAX_RESULT_FILES, f"benchmarks/results has {len(results)} files (at most {MAX_RESULT_FILES})"
    assert "README.md" in results, "benchmarks/results keeps an index"


def test_benchmark_limits_can_fail(tmp_path):
    (tmp_path / "results").mkdir()
    for i in range(MAX_BENCH_SCRIPTS + 1):
        (tmp_path / f"probe{i}.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    for i in range(MAX_RESULT_FILES + 1):
        (tmp_path / "results" / f"r{i}.log").write_text("")
    assert len(bench_scripts(tmp_path)) == MAX_BENCH_SCRIPTS + 1
    assert len(result_files(tmp_path)) == MAX_RESULT_FILES + 1


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks").rglob("*.py")) + sorted((REPO / "examples").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_tools_assign_no_library_attribute(path):
    """Benchmarks and examples pass values (a tuning, a policy) through the library's seams; none
    assigns into a ``cute_mla`` module (monkeypatching)."""
    hits = module_assignments(path.read_text())
    assert not hits, f"{path.relative_to(REPO)} assigns a cute_mla module attribute: {hits}"


def test_module_assignments_can_fail():
    src = ("import cute_mla\nfrom cute_mla.plan import sparse_decode as sd\nfrom cute_mla import plan\n"
           "import cute_mla.plan.policy as pol\nfrom cute_mla.plan import plan_sparse_decode\n"
           "sd.SUPPORTED_H_Q = (32,)\nplan.x = 1\ncute_mla.plan.y += 2\nsetattr(pol, 'POLICIES', {})\n"
           "plan_sparse_decode.cache = None\nobj = object()\nobj.attr = 1\n")
    hits = module_assignments(src)
    assert [h.split(":")[0] for h in hits] == ["6", "7", "8", "9"], hits


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_name_no_gpu_model_or_benchmark_path(path):
    """Library comments say why in the code's terms: which card measured what, and which script
    measured it, belong in docs/performance.md."""
    hits = comment_hits(path.read_text())
    assert not hits, f"{path.relative_to(ROOT)}: {hits[:5]}"


def test_comment_check_can_fail():
    src = ('"""Measured on the H200."""\n\n\ndef f():\n    """see benchmarks/timeline.py"""\n    x = "H100"  # B200 too\n'
           '    return x  # python -m benchmarks.bench_v4\n')
    assert [h.split(":")[0] for h in comment_hits(src)] == ["6", "7", "1", "5"]
    assert not comment_hits('x = "H100"  # an SM90 card\n"""Hopper and Blackwell; tile 64x64; h100 lowercase"""\n')
