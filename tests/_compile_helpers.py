"""Compile tests' shared fixture body: each named config compiled once, its PTX and cubin kept."""

from cute_mla.playground import inspect as ki


def compile_artifacts(tmp_path_factory, names, config_of, compile_fn, arch: str) -> dict:
    """{name: (PTX text, cubin path)} of ``compile_fn(config_of(name), dump_dir=...)`` for each name."""
    out = {}
    for name in names:
        d = str(tmp_path_factory.mktemp(name))
        compile_fn(config_of(name), dump_dir=d)
        ptx, cubin = ki.find_artifacts(d, arch)
        assert ptx and cubin, f"{name}: no PTX/cubin in {d}"
        with open(ptx) as f:
            out[name] = (f.read(), cubin)
    return out
