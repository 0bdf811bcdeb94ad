"""The CPU protocol models' machinery (``test_sparse_prefill_protocol.py``,
``test_sparse_decode_small_protocol.py``): roles as generators over a shared :class:`World` of
mbarriers, named barriers and shared-memory resources with vector clocks, run under random
interleavings by :func:`run_roles`. A role yields ``("mbar", name, phase)`` to wait on an
mbarrier's phase and ``("named", bar, generation)`` (from :func:`sync`) to wait on a named barrier;
everything else it does happens in program order between yields."""

from __future__ import annotations

import random

AGENTS = ("P", "Q", "A", "B", "T", "U")   # producer(s), WG0, WG1, the Q TMA loads WG0 / WG1 issue


def _vc():
    return {a: 0 for a in AGENTS}


def join(x, y):
    return {a: max(x[a], y[a]) for a in AGENTS}


def _leq(x, y):
    return all(x[a] <= y[a] for a in AGENTS)


class Race(Exception):
    pass


class World:
    def __init__(self, p_in_k: bool, bug: str):
        self.clock = {a: _vc() for a in AGENTS}
        self.mbar, self.nbar, self.acc, self.pending = {}, {}, {}, {}
        self.p_in_k, self.bug = p_in_k, bug

    def tick(self, a):
        self.clock[a][a] += 1

    def access(self, a, res, kind):
        self.tick(a)
        c = dict(self.clock[a])
        if kind == "w" and self.pending.get(res):
            raise Race(f"{a} writes {res} while a wgmma still reads it")
        for b, k, cb in self.acc.get(res, []):
            if b != a and "w" in (k, kind) and not _leq(cb, c):
                raise Race(f"{a} {kind} {res} unordered with {b} {k}")
        self.acc.setdefault(res, []).append((a, kind, c))

    def wgmma_issue(self, a, res, tok):
        for r in res:
            self.access(a, r, "r")
            self.pending.setdefault(r, set()).add(tok)

    def wgmma_retire(self, a, res, tok):
        for r in res:
            self.pending[r].discard(tok)
            self.access(a, r, "r")

    def mb_init(self, name, count):
        self.mbar[name] = dict(count=count, arrived=0, done=0, cur=_vc(), clocks=[])

    def mb_arrive(self, a, name, n):
        m = self.mbar[name]
        self.tick(a)
        m["cur"] = join(m["cur"], self.clock[a])
        m["arrived"] += n
        assert m["arrived"] <= m["count"], name
        if m["arrived"] == m["count"]:
            m["clocks"].append(m["cur"])
            m["done"], m["arrived"], m["cur"] = m["done"] + 1, 0, _vc()

    def mb_ready(self, a, name, phase):
        """A parity wait for phase ``phase`` (-1: a fresh barrier's "previous" phase, passes)."""
        if phase < 0:
            return True
        m = self.mbar[name]
        if m["done"] > phase + 1:
            raise Race(f"{a}: parity wait on {name} phase {phase} is ambiguous ({m['done']} done)")
        if m["done"] > phase:
            self.clock[a] = join(self.clock[a], m["clocks"][phase])
            self.tick(a)
            return True
        return False

    def nb_arrive(self, a, bar):
        """One warp group's 128 arrivals on a 256-thread named barrier; returns its generation."""
        b = self.nbar.setdefault(bar, dict(members=[], clock=_vc(), gen=0, gen_clock={}))
        if a in b["members"]:
            raise Race(f"{a} laps named barrier {bar}")
        self.tick(a)
        b["members"].append(a)
        b["clock"] = join(b["clock"], self.clock[a])
        g = b["gen"]
        if len(b["members"]) == 2:
            b["gen_clock"][g] = b["clock"]
            b["gen"], b["members"], b["clock"] = g + 1, [], _vc()
        return g

    def nb_done(self, a, bar, g):
        b = self.nbar[bar]
        if g in b["gen_clock"]:
            self.clock[a] = join(self.clock[a], b["gen_clock"][g])
            self.tick(a)
            return True
        return False


def sync(w, a, bar):
    g = w.nb_arrive(a, bar)
    yield ("named", bar, g)


def run_roles(w: World, roles: dict, seed: int) -> None:
    """Run ``roles`` ({agent: generator}) to the end under one random interleaving (``seed``);
    raises :class:`Race` on a deadlock, a race, a lapped or a half-arrived named barrier."""
    rnd = random.Random(seed)
    waiting = {a: None for a in roles}
    while roles:
        ready = []
        for a in roles:
            op = waiting[a]
            if op is None or (op[0] == "mbar" and w.mb_ready(a, op[1], op[2])) or (
                    op[0] == "named" and w.nb_done(a, op[1], op[2])):
                waiting[a] = None
                ready.append(a)
        if not ready:
            raise Race(f"deadlock: {waiting}")
        a = rnd.choice(ready)
        try:
            waiting[a] = next(roles[a])
        except StopIteration:
            del roles[a]
    for bar, b in w.nbar.items():
        if b["members"]:
            raise Race(f"named barrier {bar} left half arrived by {b['members']}")
