"""CPU models of the SM90 sparse prefill kernel's ping-pong (``kernels/sm90/prefill_roles.py``)
and of its swap-AB tile's protocol (``prefill_small_roles.py``).

These check the design, not the compiled kernel: each is a hand transcription of the roles and
must be kept in step with them.

* The barrier protocol: the producer, WG0, WG1 and the Q TMA as generators that perform the
  roles' mbarrier and named-barrier operations and shared-memory accesses in program order, run
  under random interleavings with vector clocks. Checked: no deadlock, no named-barrier arrive
  lapping its sync, no ambiguous parity wait, every barrier generation complete at the end, and
  every pair of conflicting accesses ordered (a wgmma's reads last from its issue to its retiring
  wait; a write while one is pending is a race). Items of 0 to 7 tiles (odd counts end with a
  pair without tile 2i+1), P in the K tiles' RoPE chunks (d_qk 576) or in ``sP`` (512), out
  staged by each ``Sm90PrefillTuning.staging``; known protocol bugs must be caught.
* The arithmetic: the per-row order of operations of ``wg0_pair`` / ``wg1_pair`` /
  ``item_sums`` / ``item_out`` (fp32, bf16 P) in numpy against float64 softmax attention.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from _protocol_model import Race, World, join as _join, run_roles, sync as _sync

def _p(w, b):   # the P buffer of K buffer b
    return f"K{b}rope" if w.p_in_k else f"P{b}"


def producer(w, items):
    c0 = c1 = 0
    for n in items:
        for pr in range((n + 1) // 2):
            odd = 2 * pr + 1 < n
            for b, h in [(0, "E")] + [(1, "E")] * odd + [(0, "L")] + [(1, "L")] * odd:
                yield ("mbar", f"free{b}{h}", (c0 if b == 0 else c1) - 1)
                if h == "E":
                    w.access("P", f"K{b}E", "w")
                else:
                    for r in (f"K{b}Lv", f"K{b}rope", f"mask{b}"):
                        w.access("P", r, "w")
                w.mb_arrive("P", f"full{b}{h}", 132 if h == "L" else 128)
            c0, c1 = c0 + 1, c1 + odd


def _qk(w, a, b, c, after_qk0=False):
    tok = object()
    yield ("mbar", f"full{b}E", c)
    w.wgmma_issue(a, _q_parts(w) + [f"K{b}E"], tok)
    yield ("mbar", f"full{b}L", c)
    if after_qk0:
        yield from _sync(w, a, "QK_ORDER")
    w.wgmma_issue(a, [f"K{b}Lv", f"K{b}rope"], tok)
    w.wgmma_retire(a, _q_parts(w) + [f"K{b}E", f"K{b}Lv", f"K{b}rope"], tok)
    w.access(a, f"mask{b}", "r")


def wg0_pair(w, c0, c1, odd):
    yield from _qk(w, "A", 0, c0)
    arrive_here = odd and w.bug not in ("no QK_ORDER arrive", "QK_ORDER after MAX_B")
    if arrive_here or w.bug == "QK_ORDER in the tail":
        w.nb_arrive("A", "QK_ORDER")
    w.access("A", "maxA", "w")
    w.nb_arrive("A", "MAX_A")
    if not odd:
        w.access("A", _p(w, 0), "w")
        w.nb_arrive("A", "P0_READY")
    rs = object()
    w.wgmma_issue("A", ["K0E"], rs)
    if not odd:
        w.wgmma_retire("A", ["K0E"], rs)
        w.mb_arrive("A", "free0E", 128)
        w.mb_arrive("A", "free0L", 128)
        return
    if w.bug != "no MAX_B sync":
        yield from _sync(w, "A", "MAX_B")
    if w.bug == "QK_ORDER after MAX_B":
        w.nb_arrive("A", "QK_ORDER")
    w.access("A", "maxB", "r")
    kept = w.lazy_max and w.rnd.random() < 0.7    # lazy_max: no row moved its base (WG1's flags)
    if w.lazy_max:
        w.access("A", "flags", "r")
    if not kept:
        w.wgmma_retire("A", ["K0E"], rs)
        w.mb_arrive("A", "free0E", 128)
    w.access("A", _p(w, 0), "w")
    w.nb_arrive("A", "P0_READY")
    w.mb_arrive("A", "free0L", 128)
    if kept:
        if w.bug == "lazy: free0E before the RS PV retired":
            w.mb_arrive("A", "free0E", 128)
        w.wgmma_retire("A", ["K0E"], rs)
        if w.bug != "lazy: free0E before the RS PV retired":
            w.mb_arrive("A", "free0E", 128)
    yield from _sync(w, "A", "P1_READY")
    yield ("mbar", "full1L", c1)
    ss = object()
    w.wgmma_issue("A", [_p(w, 1), "K1Lv"], ss)
    w.wgmma_retire("A", [_p(w, 1), "K1Lv"], ss)
    w.mb_arrive("A", "free1L", 128)


def wg1_pair(w, c0, c1, odd):
    if odd:
        yield from _qk(w, "B", 1, c1, after_qk0=True)
    yield from _sync(w, "B", "MAX_A")
    w.access("B", "maxA", "r")
    if odd or w.bug == "P1_READY in the tail":
        if odd:
            w.access("B", "maxB", "w")
            if w.lazy_max and w.bug != "lazy: flags after MAX_B":
                w.access("B", "flags", "w")
            w.nb_arrive("B", "MAX_B")
            if w.bug == "lazy: flags after MAX_B":
                w.access("B", "flags", "w")
            rs = object()
            w.wgmma_issue("B", ["K1E"], rs)
            w.access("B", _p(w, 1), "w")
        w.nb_arrive("B", "P1_READY")
    if odd or w.bug != "tail skips P0_READY":
        yield from _sync(w, "B", "P0_READY")
    yield ("mbar", "full0L", c0)
    ss = object()
    w.wgmma_issue("B", [_p(w, 0), "K0Lv"], ss)
    if w.bug == "free0L before the SS PV retired":
        w.mb_arrive("B", "free0L", 128)
    if odd:
        w.wgmma_retire("B", ["K1E"], rs)
        w.mb_arrive("B", "free1E", 128)
    w.wgmma_retire("B", [_p(w, 0), "K0Lv"], ss)
    if w.bug != "free0L before the SS PV retired":
        w.mb_arrive("B", "free0L", 128)
    if odd:
        w.mb_arrive("B", "free1L", 128)


def _q_parts(w):
    """Q's regions: the chunks WG0 / WG1 stage their output in, and (d_qk 576) the RoPE chunk."""
    return ["Qlo", "Qhi"] + (["Qrope"] if w.p_in_k else [])


def _load_q(w, a, parts):
    """Q TMA loads of ``parts`` issued by ``a`` (WG0's land as agent T, WG1's as U), one
    completion each on q_full."""
    t = "T" if a == "A" else "U"
    w.tick(a)
    w.clock[t] = _join(w.clock[t], w.clock[a])
    for r in parts:
        w.access(t, r, "w")
    w.mb_arrive(t, "q_full", len(parts))


def _epilogue(w, a, half, rq, staging):
    """L_SUM, then out staged and stored as ``staging`` says: "ring", in the group's own P buffer and its sO chunk, WG0 loading the next Q right after L_SUM; "q_reload",
    in sQ's half, WG0 expecting the next Q and loading its RoPE chunk after L_SUM and each group
    reloading its half behind its stores. The row sums by item parity with the "ring" (with
    "q_reload" WG0's next item waits for WG1's reload, after WG1 read the sums)."""
    last = rq + 1 == w.n_items
    par = rq % 2 if staging == "ring" and w.bug != "one row_sum" else 0
    w.access(a, f"sum{half}{par}", "w")
    yield from _sync(w, a, "L_SUM")
    w.access(a, f"sum{1 - half}{par}", "r")
    if a == "A" and not last and staging == "ring":
        _load_q(w, "A", _q_parts(w))
    if a == "A" and not last and staging == "q_reload":
        w.mb_arrive("A", "q_full", 1)                  # expect_tx of the whole Q
        _load_q(w, "A", _q_parts(w)[2:])
    if staging == "ring":
        own = half if w.bug != "stage in the other P" else 1 - half
        regions = [_p(w, own), f"O{half}"]
    else:
        regions = ["Qlo" if half == 0 else "Qhi"]
    for r in regions:
        w.access(a, r, "w")     # stmatrix
        w.access(a, r, "r")     # its TMA store, waited for (read) by warp 0, then the group syncs
    if staging == "q_reload" and not last:
        _load_q(w, a, regions if w.bug != "reload before the read" else [])


def _item_tiles(w, pair, c, n):
    """A group's part of an item of ``n`` tiles (the kernel's ``item_tiles``): its full pairs, then
    the last tile alone where ``n`` is odd; ``c`` = [buffer 0's, buffer 1's] phase counts, advanced."""
    for _ in range(n // 2):
        yield from pair(w, c[0], c[1], True)
        c[0], c[1] = c[0] + 1, c[1] + 1
    if n % 2:
        yield from pair(w, c[0], c[1], False)
        c[0] += 1


def wg0(w, items, staging):
    c = [0, 0]
    if items:
        if staging == "q_reload":
            w.mb_arrive("A", "q_full", 1)
        _load_q(w, "A", _q_parts(w))
    for rq, n in enumerate(items):
        yield ("mbar", "q_full", rq)
        yield from _item_tiles(w, wg0_pair, c, n)
        yield from _epilogue(w, "A", 0, rq, staging)


def wg1(w, items, staging):
    c = [0, 0]
    for rq, n in enumerate(items):
        if w.bug != "WG1 skips q_full":
            yield ("mbar", "q_full", rq)
        yield from _item_tiles(w, wg1_pair, c, n)
        yield from _epilogue(w, "B", 1, rq, staging)


def run_protocol(items, p_in_k: bool, seed: int, bug: str = "", swapped: bool = False, staging: str = "q_reload",
                 lazy_max: bool = False):
    """One interleaving of the ping-pong's roles with out staged as ``staging`` says
    (``Sm90PrefillTuning.staging``; ``lazy_max``: WG0's pair after MAX_B takes either of its two
    paths at random), or (``swapped``) of the swap-AB tile's."""
    w = World(p_in_k, bug)
    w.lazy_max = lazy_max
    w.rnd = random.Random(seed + 7)
    w.n_items = len(items)
    # "q_reload": WG0's expect and one completion per Q part; otherwise one load of all of Q
    parts = 2 + p_in_k
    w.mb_init("q_full", 1 if swapped else (1 + parts if staging == "q_reload" else parts))
    for b in range(2):
        w.mb_init(f"full{b}E", 128)
        w.mb_init(f"full{b}L", 132)
        w.mb_init(f"free{b}E", 256 if swapped else 128)
        w.mb_init(f"free{b}L", 256)
    if swapped:
        roles = {"P": swapped_producer(w, items), "A": swapped_wg0(w, items), "B": swapped_wg1(w, items)}
    else:
        roles = {"P": producer(w, items), "A": wg0(w, items, staging), "B": wg1(w, items, staging)}
    run_roles(w, roles, seed)


def _items(seed):
    rnd = random.Random(seed)
    return [rnd.choice(range(8)) for _ in range(rnd.randint(0, 5))]


@pytest.mark.parametrize("lazy_max", [False, True], ids=["max", "lazy_max"])
@pytest.mark.parametrize("p_in_k, staging", [(False, "ring"), (True, "q_reload"), (False, "q_reload")],
                         ids=["d512_ring", "d576_q_reload", "d512_q_reload"])
def test_barrier_protocol_has_no_deadlock_lap_or_race(p_in_k, staging, lazy_max):
    for seed in range(1500):
        run_protocol(_items(seed), p_in_k, seed, staging=staging, lazy_max=lazy_max)


@pytest.mark.parametrize("bug", ["lazy: free0E before the RS PV retired", "lazy: flags after MAX_B"])
def test_the_lazy_max_model_catches_known_bugs(bug):
    """With ``lazy_max``, where no row moved its base, WG0 hands P0 over while its RS PV of P0
    still reads buffer 0's early half: that half is free only once the RS PV retired; the flags
    WG1 writes must be written before it arrives on ``MAX_B``, after which WG0 reads them."""
    with pytest.raises(Race):
        for seed in range(1500):
            run_protocol(_items(seed), True, seed, bug, lazy_max=True)


@pytest.mark.parametrize("bug", ["no MAX_B sync", "P1_READY in the tail", "tail skips P0_READY",
                                 "free0L before the SS PV retired", "WG1 skips q_full", "no QK_ORDER arrive",
                                 "QK_ORDER in the tail", "QK_ORDER after MAX_B"])
def test_the_protocol_model_catches_known_bugs(bug):
    with pytest.raises(Race):
        for seed in range(1500):
            run_protocol(_items(seed), True, seed, bug)


@pytest.mark.parametrize("bug, p_in_k, staging", [("one row_sum", False, "ring"), ("stage in the other P", False, "ring"),
                                                   ("reload before the read", True, "q_reload")])
def test_the_early_q_models_catch_known_bugs(bug, p_in_k, staging):
    """Where WG0 loads the next Q early: with the "ring" and without the row sums kept per item
    parity, WG0 (an item of one tile or none waits for nothing) can write the next item's sums
    before WG1 read this item's; out staged in the other group's P buffer races that group's next P; a Q chunk
    reloaded before its store read the staging races the store."""
    with pytest.raises(Race):
        for seed in range(1500):
            run_protocol(_items(seed), p_in_k, seed, bug, staging=staging)


# ------------------------------------------------------------------------------------ arithmetic

# ---------------------------------------------------------------- the swap-AB tile (8, 16, 32 heads)
# ``prefill_small_roles.py``: WG0 does every QK (behind the previous tile's PV), the softmax and P^T;
# both groups do a PV per tile on their V columns (WG0 chunks 0-3, WG1 chunks 4-7) and release both
# halves of the tile's buffer; out is staged in the Q buffer (WG0 "Qa", WG1 "Qb").

def _v(b, h):
    """The resources of K buffer b's half h: early = the V chunks of WG b's O block, late = the
    other V chunks, the RoPE chunk and the mask."""
    own, other = f"K{b}v{b}", f"K{b}v{1 - b}"
    return [own] if h == "E" else [other, f"K{b}rope", f"mask{b}"]


def swapped_producer(w, items):
    c0 = c1 = 0
    for n in items:
        for pr in range((n + 1) // 2):
            odd = 2 * pr + 1 < n
            if w.bug == "ping-pong gather order":
                order = [(0, "E")] + [(1, "E")] * odd + [(0, "L")] + [(1, "L")] * odd
            else:
                order = [(0, "E"), (0, "L")] + [(1, "E"), (1, "L")] * odd
            for b, h in order:
                yield ("mbar", f"free{b}{h}", (c0 if b == 0 else c1) - 1)
                for r in _v(b, h):
                    w.access("P", r, "w")
                w.mb_arrive("P", f"full{b}{h}", 132 if h == "L" else 128)
            c0, c1 = c0 + 1, c1 + odd


def _tile(c0, c1, t):
    b = t % 2
    return b, (c0 if b == 0 else c1) + t // 2


def _swapped_qk(w, b, ph):
    yield ("mbar", f"full{b}E", ph)
    yield ("mbar", f"full{b}L", ph)
    tok = object()
    res = ["Qa", "Qb", f"K{b}v0", f"K{b}v1", f"K{b}rope"]
    w.wgmma_issue("A", res, tok)
    return tok, res


def _release(w, a, b):
    w.mb_arrive(a, f"free{b}E", 128)
    w.mb_arrive(a, f"free{b}L", 128)


def swapped_wg0(w, items):
    c0 = c1 = 0
    for rq, n in enumerate(items):
        if rq > 0:
            yield from _sync(w, "A", "Q_FREE")
        w.tick("A")
        w.clock["T"] = _join(w.clock["T"], w.clock["A"])
        w.access("T", "Qa", "w")
        w.access("T", "Qb", "w")
        w.mb_arrive("T", "q_full", 1)
        yield ("mbar", "q_full", rq)
        if n:
            tok, res = yield from _swapped_qk(w, 0, c0)
            w.wgmma_retire("A", res, tok)
        for t in range(n):
            b, _ = _tile(c0, c1, t)
            w.access("A", f"mask{b}", "r")
            yield from _sync(w, "A", "PT_FREE")
            w.access("A", "scale", "w")
            w.access("A", "PT", "w")
            yield from _sync(w, "A", "PT_READY")
            pv = object()
            w.wgmma_issue("A", [f"K{b}v0", "PT"], pv)
            if t + 1 == n:
                w.wgmma_retire("A", [f"K{b}v0", "PT"], pv)
                _release(w, "A", b)
            else:
                nb, nph = _tile(c0, c1, t + 1)
                tok, res = yield from _swapped_qk(w, nb, nph)
                w.wgmma_retire("A", [f"K{b}v0", "PT"], pv)
                _release(w, "A", b)
                w.wgmma_retire("A", res, tok)
        c0, c1 = c0 + (n + 1) // 2, c1 + n // 2
        yield from _sync(w, "A", "PT_FREE")
        w.access("A", "scale", "w")
        w.nb_arrive("A", "PT_READY")
        w.access("A", "Qa", "w")      # stmatrix.trans staging
        w.access("A", "Qa", "r")      # its TMA stores, waited for (read)
    yield from _sync(w, "A", "PT_FREE")
    if items:
        yield from _sync(w, "A", "Q_FREE")


def swapped_wg1(w, items):
    c0 = c1 = 0
    w.nb_arrive("B", "PT_FREE")
    for n in items:
        for t in range(n):
            b, ph = _tile(c0, c1, t)
            yield from _sync(w, "B", "PT_READY")
            w.access("B", "scale", "r")
            yield ("mbar", f"full{b}E", ph)
            yield ("mbar", f"full{b}L", ph)
            pv = object()
            w.wgmma_issue("B", [f"K{b}v1", "PT"], pv)
            if w.bug == "WG1 releases before its PV retired":
                _release(w, "B", b)
            w.wgmma_retire("B", [f"K{b}v1", "PT"], pv)
            w.nb_arrive("B", "PT_FREE")
            if w.bug != "WG1 releases before its PV retired":
                _release(w, "B", b)
        c0, c1 = c0 + (n + 1) // 2, c1 + n // 2
        yield from _sync(w, "B", "PT_READY")
        w.access("B", "scale", "r")
        w.nb_arrive("B", "PT_FREE")
        w.access("B", "Qb", "w")
        w.access("B", "Qb", "r")
        w.nb_arrive("B", "Q_FREE")


def test_swap_ab_protocol_has_no_deadlock_lap_or_race():
    for seed in range(1500):
        run_protocol(_items(seed), False, seed, swapped=True)


@pytest.mark.parametrize("bug", ["ping-pong gather order", "WG1 releases before its PV retired"])
def test_the_swap_ab_model_catches_known_bugs(bug):
    """The first is the deadlock the GPU found when the swap-AB roles first ran on the ping-pong's
    producer; the second lets the producer refill a buffer WG1's PV still reads."""
    with pytest.raises(Race):
        for seed in range(1500):
            run_protocol(_items(seed), False, seed, bug, swapped=True)


def _bf16(x):
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def _base(m, x, lazy):
    """The running max after a tile whose max is x (``prefill_roles.new_base``)."""
    if lazy:
        return np.float32(x) if x - m > 8.0 else m
    return np.float32(max(m, x))


def _pingpong_row(s, v, valid, scale_log2, sink, lazy=False):
    """One row through the kernel's order of operations (``lazy``: ``lazy_max``, P's base moved
    only past 8 log2 units, the true max kept apart); returns (out, lse, max_logit)."""
    tiles = len(s) // 64
    m, l0, l1 = np.float32(-1e30), np.float32(0), np.float32(0)
    top = -np.inf
    o = np.zeros(512, np.float32)
    masked = np.where(valid, s * scale_log2, -np.inf).astype(np.float32)
    for pr in range((tiles + 1) // 2):
        t0, odd = 2 * pr, 2 * pr + 1 < tiles
        s0 = masked[t0 * 64:(t0 + 1) * 64]
        ma = _base(m, s0.max(), lazy)                           # WG0: MAX_A
        top = max(top, s0.max())
        p0 = np.exp2(s0 - ma).astype(np.float32)
        assert p0.max(initial=0) <= 2.0 ** 8                   # P's bound with the lazy base
        l0 = l0 * np.float32(np.exp2(m - ma)) + p0.sum(dtype=np.float32)
        o[:256] = o[:256] * np.float32(np.exp2(m - ma)) + _bf16(p0) @ v[t0 * 64:(t0 + 1) * 64, :256]
        mb = ma
        if odd:                                                 # WG1: MAX_B
            s1 = masked[(t0 + 1) * 64:(t0 + 2) * 64]
            mb = _base(ma, s1.max(), lazy)
            top = max(top, s1.max())
        sc = np.float32(np.exp2(m - mb))
        o[256:] *= sc
        l1 = l1 * sc
        if odd:
            p1 = np.exp2(s1 - mb).astype(np.float32)
            assert p1.max(initial=0) <= 2.0 ** 8
            l1 += p1.sum(dtype=np.float32)
            o[256:] += _bf16(p1) @ v[(t0 + 1) * 64:(t0 + 2) * 64, 256:]
            f = np.float32(np.exp2(ma - mb))                    # WG0 after MAX_B
            o[:256] *= f
            p0, l0 = p0 * f, l0 * f
            o[:256] += _bf16(p1) @ v[(t0 + 1) * 64:(t0 + 2) * 64, :256]
        o[256:] += _bf16(p0) @ v[t0 * 64:(t0 + 1) * 64, 256:]
        m = mb
    l_sum = l0 + l1                                             # L_SUM
    if l_sum == 0:
        return np.zeros(512), np.inf, -np.inf
    denom = l_sum + (np.exp2(sink * np.log2(np.e) - m) if sink is not None else 0)
    return o / denom, np.log(l_sum) + m * np.log(2), top * np.log(2)


def _reference_row(s, v, valid, scale, sink):
    z = np.where(valid, s.astype(np.float64) * scale, -np.inf)
    if not valid.any():
        return np.zeros(512), np.inf, -np.inf
    mx = z.max()
    lse = np.log(np.exp(z - mx).sum()) + mx
    lse_o = np.logaddexp(lse, sink) if sink is not None else lse
    return np.exp(z - lse_o) @ v.astype(np.float64), lse, mx


@pytest.mark.parametrize("lazy", [False, True], ids=["max", "lazy_max"])
def test_pingpong_arithmetic_is_softmax_attention(lazy):
    rng = np.random.default_rng(0)
    scale = 0.5
    for _ in range(200):
        n = 64 * int(rng.integers(1, 8))
        s = (rng.standard_normal(n) * rng.choice([1, 5, 30])).astype(np.float32)
        v = _bf16(rng.standard_normal((n, 512)).astype(np.float32))
        valid = rng.random(n) < rng.choice([1.0, 0.5, 0.05, 0.0])
        if rng.random() < 0.3:
            k = int(rng.integers(0, n // 64))
            valid[k * 64:(k + 1) * 64] = False                  # a fully masked tile
        sink = None if rng.random() < 0.5 else float(rng.standard_normal())
        out, lse, mx = _pingpong_row(s, v, valid, np.float32(scale * np.log2(np.e)), sink, lazy)
        ref_out, ref_lse, ref_mx = _reference_row(s, v, valid, scale, sink)
        for got, want in ((lse, ref_lse), (mx, ref_mx)):
            assert (np.isinf(got) and got == want) or abs(got - want) <= 1e-4 * max(1.0, abs(want))
        assert np.abs(out - ref_out).max() <= 2e-2 * max(1e-6, np.abs(ref_out).max())
