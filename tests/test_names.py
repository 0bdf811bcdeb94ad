"""CPU-only: every global name a function in the test modules and the benchmark scripts reads is defined.

The GPU tests and the benchmarks do not run on the CPU machine, so a typo in one (a name left over
from an edit) would only show on the H200, one device call later. Python resolves a name a function never assigns
as a global at run time; this reads each function's bytecode for such loads (LOAD_GLOBAL, and
LOAD_NAME in class bodies) and checks them against the module's globals and the builtins.
"""

import builtins
import dis
import importlib
import importlib.util
import pathlib
import sys
import types

import pytest

TESTS = pathlib.Path(__file__).parent
BENCHMARKS = TESTS.parent / "benchmarks"
MODULES = sorted(TESTS.glob("test_*.py")) + sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")


def _benchmark_module(name):
    """``benchmarks.<name>``, the package (whose modules import each other as ``benchmarks.<name>``)
    loaded from this checkout's folder: ``python -m pytest`` from the repository root has it on
    sys.path, a bare ``pytest`` does not."""
    pkg = sys.modules.get("benchmarks")
    if pkg is None or pathlib.Path(pkg.__file__).resolve().parent != BENCHMARKS.resolve():
        spec = importlib.util.spec_from_file_location("benchmarks", BENCHMARKS / "__init__.py",
                                                      submodule_search_locations=[str(BENCHMARKS)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"benchmarks.{name}")


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _global_loads(code):
    for c in _code_objects(code):
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                yield c.co_name, ins.argval


@pytest.mark.parametrize("path", MODULES, ids=[f"{p.parent.name}/{p.stem}" for p in MODULES])
def test_global_names_are_defined(path):
    if path.parent == BENCHMARKS:
        module = _benchmark_module(path.stem)
    else:
        spec = importlib.util.spec_from_file_location(f"_names_check_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    code = compile(path.read_text(), str(path), "exec")
    # names the module body binds (imports and assignments under ``if __name__ == "__main__"`` too,
    # which exec_module does not run), class bodies bind, and functions declare global
    stored = {ins.argval for c in _code_objects(code) for ins in dis.get_instructions(c)
              if ins.opname in ("STORE_NAME", "STORE_GLOBAL", "IMPORT_NAME")}
    known = set(vars(module)) | set(dir(builtins)) | stored
    missing = sorted({f"{fn}: {name}" for fn, name in _global_loads(code) if name not in known})
    assert not missing, f"{path.name}: undefined names {missing}"


def test_the_check_finds_an_undefined_name():
    code = compile("def f():\n    return undefined_here + 1\n", "<t>", "exec")
    assert ("f", "undefined_here") in set(_global_loads(code))
