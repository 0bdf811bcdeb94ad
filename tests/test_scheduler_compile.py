"""CPU-only: the device scheduler compiles for both archs, and its launcher rejects bad shapes."""


import pytest
import torch

from cute_mla.dsl.compile import CompiledKernel
from cute_mla.playground.inspect import read_ptx
from cute_mla.scheduler.device import SchedulerKernelConfig, compile as compile_scheduler, launch as launch_scheduler

ARCHS = ("sm_90a", "sm_100a")


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_with_expected_ptx(arch, tmp_path):
    compile_scheduler(SchedulerKernelConfig(arch=arch), dump_dir=str(tmp_path))
    ptx = read_ptx(str(tmp_path))
    assert f".target {arch}" in ptx
    assert ptx.count(".entry") == 1
    assert ".reqntid 32, 1, 1" in ptx, "one warp per CTA"
    assert "shfl.sync.bfly" in ptx, "the total is a warp reduction"
    # A DecodingSchedMeta row leaves as two 16-byte stores, not 8 scalar ones.
    assert ptx.count("st.global.v4.b32") == 2
    assert "bar.sync" not in ptx and "barrier.sync" not in ptx, "a single warp needs no CTA barrier"


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_is_cached(arch):
    cfg = SchedulerKernelConfig(arch=arch)
    assert compile_scheduler(cfg) is compile_scheduler(cfg)


def test_config_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch"):
        SchedulerKernelConfig(arch="sm_80")


def test_launcher_checks_shapes_before_launch():
    dummy = CompiledKernel(key="never-called", fn=None)  # the checks must fire before fn is used
    i32 = torch.int32
    nb = torch.ones(4, dtype=i32)
    good_md, good_ns = torch.empty(3, 8, dtype=i32), torch.empty(5, dtype=i32)
    with pytest.raises(ValueError, match="num_blocks"):
        launch_scheduler(dummy, torch.ones(0, dtype=i32), good_md, torch.empty(1, dtype=i32), 5)
    with pytest.raises(ValueError, match="tile_md"):
        launch_scheduler(dummy, nb, torch.empty(3, 7, dtype=i32), good_ns, 5)
    with pytest.raises(ValueError, match="num_splits"):
        launch_scheduler(dummy, nb, good_md, torch.empty(4, dtype=i32), 5)
    with pytest.raises(ValueError, match="fixed_overhead"):
        launch_scheduler(dummy, nb, good_md, good_ns, -1)
