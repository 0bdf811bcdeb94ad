"""GPU: the device scheduler equals the host greedy (plan_splits_host), entry by entry."""

import random

import pytest
import torch

from cute_mla.archs import device_arch
from cute_mla.scheduler.device import SchedulerKernelConfig, compile as compile_scheduler, launch as launch_scheduler
from cute_mla.scheduler.partition import plan_splits_host

pytestmark = pytest.mark.gpu

GARBAGE = -7  # every output entry must be overwritten


def _compiled():
    return compile_scheduler(SchedulerKernelConfig(arch=device_arch(torch.device("cuda"))))


def _outputs(b, P):
    tile_md = torch.full((P, 8), GARBAGE, dtype=torch.int32, device="cuda")
    num_splits = torch.full((b + 1,), GARBAGE, dtype=torch.int32, device="cuda")
    return tile_md, num_splits


def _expect(nb, P, F):
    host = plan_splits_host(nb, P, F)
    return [list(r) for r in host.rows], list(host.num_splits)


def _random_blocks(rnd, b):
    top = rnd.choice([1, 2, 4, 32, 33, 256, 2000])
    return [rnd.randint(1, top) for _ in range(b)]


@pytest.mark.parametrize("P", [1, 2, 13, 66, 132])
@pytest.mark.parametrize("trial", range(8))
def test_matches_host(P, trial):
    rnd = random.Random(1000 * P + trial)
    b = rnd.choice([1, 2, 3, 17, 128, 1000, 3000])
    F = rnd.choice([5, 5, 3, 0])
    nb = _random_blocks(rnd, b)
    num_blocks = torch.tensor(nb, dtype=torch.int32, device="cuda")
    tile_md, num_splits = _outputs(b, P)
    launch_scheduler(_compiled(), num_blocks, tile_md, num_splits, F)
    rows, ns = _expect(nb, P, F)
    assert num_splits.tolist() == ns, f"b={b} P={P} F={F}"
    got = tile_md.tolist()
    for p in range(P):
        assert got[p] == rows[p], f"b={b} P={P} F={F} partition {p}: {got[p]} != {rows[p]}"


def test_worked_example():
    # flashmla-sparse-decode.md §4.5: b=1, 32 blocks, P=13 -> payload 8, 11 splits of 3 blocks.
    tile_md, num_splits = _outputs(1, 13)
    launch_scheduler(_compiled(), torch.tensor([32], dtype=torch.int32, device="cuda"), tile_md, num_splits, 5)
    assert num_splits.tolist() == [0, 11]
    md = tile_md.tolist()
    assert [r[2:4] for r in md[:11]] == [[3 * i, min(3 * i + 3, 32)] for i in range(11)]
    assert all(r[0] == 1 for r in md[11:]), "trailing partitions are empty (begin_req == b)"


def test_cuda_graph_replay():
    """Capture one launch, change num_blocks in place, replay: the outputs must follow.

    A launch that missed torch's capture stream would leave an empty graph and the garbage in place.
    """
    b, P, F = 300, 66, 5
    rnd = random.Random(7)
    num_blocks = torch.tensor(_random_blocks(rnd, b), dtype=torch.int32, device="cuda")
    tile_md, num_splits = _outputs(b, P)
    compiled = _compiled()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch_scheduler(compiled, num_blocks, tile_md, num_splits, F)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_scheduler(compiled, num_blocks, tile_md, num_splits, F)

    for _ in range(3):
        nb = [rnd.randint(1, rnd.choice([2, 32, 300])) for _ in range(b)]
        num_blocks.copy_(torch.tensor(nb, dtype=torch.int32))
        tile_md.fill_(GARBAGE)
        num_splits.fill_(GARBAGE)
        graph.replay()
        torch.cuda.synchronize()
        rows, ns = _expect(nb, P, F)
        assert num_splits.tolist() == ns
        assert tile_md.tolist() == rows
