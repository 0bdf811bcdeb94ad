"""CPU: the persistent compile cache (``cute_mla.dsl.compile``): a second process loads what the
first compiled instead of compiling, a corrupt entry is recompiled with one warning line, and
``CUTE_MLA_CACHE_DIR=off`` writes nothing."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Compiles the SM90 combine (the smallest kernel) and prints the cache entry it maps to. With
# argv[1] == "no-compile", cute.compile raises: only a cache hit can succeed.
SCRIPT = r"""
import sys, warnings
import cutlass.cute as cute
if sys.argv[1] == "no-compile":
    def refuse(*a, **k):
        raise RuntimeError("compiled although the cache holds the kernel")
    cute.compile = refuse
from cute_mla.dsl import compile as dc
from cute_mla.kernels.combine import combine_config, compile as compile_combine
cfg = combine_config("sm_90a", 64, False, 132, "bfloat16")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    k = compile_combine(cfg)
print("ENTRY", dc._entry_path(cfg.cache_key))
print("CALLABLE", callable(k.fn))   # a loaded entry is callable on any machine (a fresh compile only with a GPU)
print("WARNINGS", sum("compile cache" in str(x.message) for x in w))
"""


def run(cache, mode="compile", **env_vars):
    env = dict(os.environ, CUTE_MLA_CACHE_DIR=str(cache), **env_vars)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=600, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    return out


def test_second_process_loads_instead_of_compiling(tmp_path):
    first = run(tmp_path)
    entry = pathlib.Path(first["ENTRY"])
    assert entry.is_file() and entry.stat().st_size > 0 and first["WARNINGS"] == "0"
    assert tmp_path in entry.parents and "dsl4.8.1" in entry.parent.name   # versions in the directory name
    second = run(tmp_path, "no-compile")
    assert second["CALLABLE"] == "True" and second["WARNINGS"] == "0"
    assert not [p for p in entry.parent.iterdir() if p.name.endswith(".tmp")], "a temporary file was left behind"


def test_corrupt_entry_is_recompiled_with_one_warning(tmp_path):
    entry = pathlib.Path(run(tmp_path)["ENTRY"])
    entry.write_bytes(b"not an object file")
    again = run(tmp_path)
    assert again["WARNINGS"] == "1"
    assert entry.stat().st_size > 100, "the corrupt entry was not replaced"
    loaded = run(tmp_path, "no-compile")
    assert loaded["WARNINGS"] == "0" and loaded["CALLABLE"] == "True"


def test_off_writes_nothing(tmp_path):
    env_dir = tmp_path / "cache"   # where the default cache directory would be
    out = run("off", XDG_CACHE_HOME=str(env_dir))
    assert out["ENTRY"] == "None"
    assert not env_dir.exists()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from cute_mla.dsl import compile as dc

    monkeypatch.setenv(dc.CACHE_ENV, str(tmp_path))
    assert dc.cache_dir().parent == tmp_path
    monkeypatch.setenv(dc.CACHE_ENV, "OFF")
    assert dc.cache_dir() is None
    monkeypatch.delenv(dc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dc.cache_dir().parent == tmp_path / "xdg" / "cute-mla"
