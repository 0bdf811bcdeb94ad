"""A CPU model of the SM90 sparse decode kernel's swap-AB roles (8, 16 and 32 heads,
``kernels/sm90/decode_small_roles.py``): the two producer warp groups (each writes one half of
every K tile and its half's mask bytes), WG0, WG1 and the Q TMA as generators that
perform the roles' mbarrier and named-barrier operations and shared-memory accesses in program
order, under random interleavings with vector clocks (``_protocol_model.py``). It checks the
design, not the compiled kernel: keep it in step with the roles.

A partition is a list of requests, each of 0 to 5 compacted tiles (0: the request has no block in
this partition); tile n of the partition sits in K buffer n % 2. The Q buffer is two resources,
the parts WG0 (``Q0``) and WG1 (``Q1``) stage their output chunks in; Q's load and the QK cover both. Checked: no deadlock, no
named-barrier lap, no ambiguous parity wait, every conflicting access ordered (a wgmma's reads
last from its issue to its retiring wait); known protocol bugs must be caught.
"""

from __future__ import annotations

import random

import pytest
from _protocol_model import Race, World, join, run_roles, sync


PRODUCERS = ("P", "Q")   # WG2 and WG3: halves 0 and 1 of every tile


def k_tile(b):
    """K buffer ``b``'s two halves (one per producer warp group)."""
    return [f"K{b}.{half}" for half in range(len(PRODUCERS))]


def info_of(b):
    """K buffer ``b``'s tile_info parts: each half's mask bytes (half 0's also the last-tile flag)."""
    return [f"info{b}.{half}" for half in range(len(PRODUCERS))]


def producer(w, reqs, half):
    me = PRODUCERS[half]
    n = 0
    for k in reqs:
        for _ in range(k):
            b = n % 2
            yield ("mbar", f"free{b}", n // 2 - 1)
            w.access(me, k_tile(b)[half], "w")
            w.access(me, info_of(b)[half], "w")
            w.mb_arrive(me, f"full{b}", 1)    # (its 128 threads' arrivals: one event)
            n += 1


def _read_info(w, a, b):
    for part in info_of(b):
        w.access(a, part, "r")


def _load_q(w):
    w.tick("A")                                 # the Q TMA: issued by WG0, written by T
    w.clock["T"] = join(w.clock["T"], w.clock["A"])
    w.access("T", "Q0", "w")
    w.access("T", "Q1", "w")
    w.mb_arrive("T", "q_full", 1)


def _qk(w, b):
    tok = object()
    w.wgmma_issue("A", ["Q0", "Q1"] + k_tile(b), tok)
    return tok


def wg0(w, reqs):
    n = 0
    for rq, k in enumerate(reqs):
        if rq > 0 and w.bug != "no Q_FREE":
            yield from sync(w, "A", "Q_FREE")
        _load_q(w)
        yield ("mbar", "q_full", rq)
        if k:
            b = n % 2
            yield ("mbar", f"full{b}", n // 2)
            tok = _qk(w, b)
            w.wgmma_retire("A", ["Q0", "Q1"] + k_tile(b), tok)
        for t in range(k):
            b = n % 2
            _read_info(w, "A", b)
            if w.bug != "P before P_FREE":
                yield from sync(w, "A", "P_FREE")
            w.access("A", "scale", "w")
            w.access("A", "P", "w")
            if w.bug == "P before P_FREE":
                yield from sync(w, "A", "P_FREE")
            yield from sync(w, "A", "P_READY")
            pv = object()
            w.wgmma_issue("A", k_tile(b) + ["P"], pv)
            if t == k - 1:
                w.wgmma_retire("A", k_tile(b) + ["P"], pv)
                w.mb_arrive("A", f"free{b}", 1)
            else:
                nb = (n + 1) % 2
                yield ("mbar", f"full{nb}", (n + 1) // 2)
                qk = _qk(w, nb)
                if w.bug == "free before the PV retired":
                    w.mb_arrive("A", f"free{b}", 1)
                    w.wgmma_retire("A", k_tile(b) + ["P"], pv)
                else:
                    w.wgmma_retire("A", k_tile(b) + ["P"], pv)    # wait_group(1): the PV retired
                    w.mb_arrive("A", f"free{b}", 1)
                w.wgmma_retire("A", ["Q0", "Q1"] + k_tile(nb), qk)
            n += 1
        # epilogue: the final factors to WG1, its half of the output staged in Q and stored
        yield from sync(w, "A", "P_FREE")
        w.access("A", "scale", "w")
        w.nb_arrive("A", "P_READY")
        w.access("A", "Q0", "w")    # stmatrix of its chunks (its part of the Q buffer)
        w.access("A", "Q0", "r")    # their TMA stores, waited for (read) by warp 0
    yield from sync(w, "A", "P_FREE")
    yield from sync(w, "A", "Q_FREE")


def wg1(w, reqs):
    w.nb_arrive("B", "P_FREE")      # sP / head_scale start out free
    n = 0
    for k in reqs:
        for _ in range(k):
            b = n % 2
            yield from sync(w, "B", "P_READY")
            w.access("B", "scale", "r")
            yield ("mbar", f"full{b}", n // 2)
            _read_info(w, "B", b)
            pv = object()
            w.wgmma_issue("B", k_tile(b) + ["P"], pv)
            w.wgmma_retire("B", k_tile(b) + ["P"], pv)
            w.nb_arrive("B", "P_FREE")
            w.mb_arrive("B", f"free{b}", 1)
            n += 1
        yield from sync(w, "B", "P_READY")
        w.access("B", "scale", "r")
        w.nb_arrive("B", "P_FREE")
        w.access("B", "Q1", "w")    # its chunks, the Q buffer's other part
        w.access("B", "Q1", "r")
        w.nb_arrive("B", "Q_FREE")


def run_protocol(reqs, seed: int, bug: str = ""):
    w = World(False, bug)
    w.mb_init("q_full", 1)
    for b in range(2):
        # each producer warp group's 128 arrivals
        w.mb_init(f"full{b}", 1 if bug == "k_full counts one producer" else len(PRODUCERS))
        w.mb_init(f"free{b}", 2)    # WG0's and WG1's 128 arrivals each
    roles = {me: producer(w, reqs, half) for half, me in enumerate(PRODUCERS)}
    run_roles(w, {**roles, "A": wg0(w, reqs), "B": wg1(w, reqs)}, seed)


def _requests(seed):
    rnd = random.Random(seed)
    return [rnd.choice(range(6)) for _ in range(rnd.randint(1, 5))]


def test_swap_ab_decode_protocol_has_no_deadlock_lap_or_race():
    for seed in range(2000):
        run_protocol(_requests(seed), seed)


@pytest.mark.parametrize("bug", ["no Q_FREE", "P before P_FREE", "free before the PV retired",
                                 "k_full counts one producer"])
def test_the_model_catches_known_bugs(bug):
    with pytest.raises(Race):
        for seed in range(2000):
            run_protocol(_requests(seed), seed, bug)
