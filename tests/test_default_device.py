"""CPU: the host-side tensors the library makes name their device, so a non-CPU default device
(``torch.set_default_device("cuda")``, ``with torch.device("cuda")``, as FlashMLA's own tests and
many notebooks set) cannot move them. On a CPU machine the ``meta`` device stands in for CUDA: a
tensor that silently follows the default device lands there and the checks below fail."""

import pytest
import torch

from cute_mla import plan_sparse_decode
from cute_mla.plan import schedule
from cute_mla.scheduler import plan_splits
from cute_mla.testing import make_inputs


@pytest.fixture(params=["set_default_device", "context"])
def meta_default(request):
    """torch's default device set to ``meta`` for the test, one way or the other."""
    if request.param == "set_default_device":
        torch.set_default_device("meta")
        try:
            yield
        finally:
            torch.set_default_device(None)
    else:
        with torch.device("meta"):
            yield


def test_meta_default_catches_a_bare_factory(meta_default):
    """The stand-in works: a factory call without a device follows it."""
    assert torch.tensor([1]).device.type == "meta"


def test_host_schedule_upload_stays_on_the_host(meta_default):
    plan = plan_sparse_decode(4, 1, 64, 576, 2048, arch="sm_90a", num_sms=132)
    entry = schedule.uploaded_schedule(plan, torch.device("cpu"))
    assert entry.host.device.type == "cpu" and entry.dev.device.type == "cpu"
    tile_md, num_splits, offsets = entry.views
    assert tile_md.shape == (plan.num_sm_parts, 8) and num_splits.tolist()[0] == 0


def test_host_scheduler_returns_host_tensors(meta_default):
    nb = torch.tensor([3, 5, 2], dtype=torch.int32, device="cpu")
    tile_md, num_splits = plan_splits(nb, 4)
    assert tile_md.device.type == "cpu" and num_splits.device.type == "cpu"
    assert num_splits.tolist()[-1] >= 3


def test_device_schedule_follows_the_lengths(meta_default):
    plan = plan_sparse_decode(4, 1, 64, 512, 128, arch="sm_100a", num_sms=148, has_topk_length=True, extra_topk=512)
    lengths = torch.tensor([0, 7, 128, 300], dtype=torch.int32, device="cpu")
    s = schedule.make_schedule(plan, torch.device("cpu"), lengths.clamp(max=128), lengths)
    assert s.tile_md.device.type == "cpu" and s.tile_md[:, 3].tolist() == [1, 1 + 1, 2 + 2, 2 + 5]


@pytest.mark.parametrize("d_qk, extra", [(576, 0), (512, 512)])
def test_make_inputs_builds_on_the_host(meta_default, d_qk, extra):
    inp = make_inputs(2, 1, 64, 128, d_qk=d_qk, extra_topk=extra, with_topk_length=True,
                      generator=torch.Generator().manual_seed(0))
    tensors = [inp.q, inp.k_cache, inp.indices, inp.topk_length] + ([inp.extra_k_cache] if extra else [])
    assert all(t.device.type == "cpu" for t in tensors)
