# Protocol model of the v3 forward with per-warpgroup key ranges (the s27 own-blocks patch): producer + W consumer
# warpgroups, mbarrier phases, ping-pong turns as named barriers. Random interleavings; checks deadlock, barrier
# over-arrival, turn double-pass, and a load into a stage that a warpgroup is still reading.
# Run: python3 <this file> (bench/NOTES.md session 27).
import random

class Bar:
    def __init__(s, count): s.count, s.arr, s.done = count, 0, 0
    def arrive(s, n=1):
        s.arr += n
        assert s.arr <= s.count, "over-arrival"
        if s.arr == s.count: s.arr, s.done = 0, s.done + 1
    def passed(s, parity): return (s.done & 1) != parity

def run(seed, W, S, tiles, overlap=True):
    rng = random.Random(seed)
    full_k = [Bar(1) for _ in range(S)]; full_v = [Bar(1) for _ in range(S)]
    empty_k = [Bar(W) for _ in range(S)]; empty_v = [Bar(W) for _ in range(S)]
    q_full, q_empty = Bar(1), Bar(W)
    reading = {}  # (kind, stage) -> set of wgs
    tokens = [0] * W
    tokens[0] = 1
    def load(kind, stage):
        assert not reading.get((kind, stage)), f"load into {kind}{stage} while read by {reading[(kind, stage)]}"
    def producer():
        kv = 0; qi = 0
        for (n, ranges) in tiles:
            if n == 0: continue
            yield lambda: q_empty.passed((qi & 1) ^ 1)
            load("q", 0); q_full.arrive()
            order = [("k", 0)] + [x for i in range(n) for x in ((("k", i + 1),) if i + 1 < n else ()) + (("v", i),)]
            for kind, i in order:
                r = kv + i; st, ph = r % S, (r // S) & 1
                e = empty_k[st] if kind == "k" else empty_v[st]
                yield lambda e=e, ph=ph: e.passed(ph ^ 1)
                load(kind, st); (full_k if kind == "k" else full_v)[st].arrive()
            kv += n; qi += 1
    def turn_wait(w):
        yield lambda: tokens[w] > 0
        tokens[w] -= 1
    def turn_pass(w):
        nxt = (w + 1) % W
        tokens[nxt] += 1
        assert tokens[nxt] <= 1, "turn passed twice before the next warpgroup synced"
    def slot(r): return r % S, (r // S) & 1
    def skip_steps(w, kv, n):
        for i in range(n):
            for _ in range(1 if overlap else 2):
                yield from turn_wait(w); turn_pass(w)
            st, ph = slot(kv + i)
            yield lambda st=st, ph=ph: full_k[st].passed(ph); empty_k[st].arrive()
            yield lambda st=st, ph=ph: full_v[st].passed(ph); empty_v[st].arrive()
    def rd(kind, st, w, on):
        s = reading.setdefault((kind, st), set())
        (s.add if on else s.discard)(w)
    def consume(w, kv, n):  # overlap path of consume_tile
        st, ph = slot(kv)
        yield lambda: full_k[st].passed(ph)
        yield from turn_wait(w); rd("k", st, w, True); turn_pass(w)
        rd("k", st, w, False); empty_k[st].arrive()
        if n == 1: q_empty.arrive()
        for i in range(1, n):
            ks, kp = slot(kv + i); vs, vp = slot(kv + i - 1)
            yield lambda ks=ks, kp=kp: full_k[ks].passed(kp)
            yield from turn_wait(w); rd("k", ks, w, True)
            yield lambda vs=vs, vp=vp: full_v[vs].passed(vp)
            rd("v", vs, w, True); turn_pass(w)
            yield lambda: True  # GEMMs in flight
            rd("k", ks, w, False); empty_k[ks].arrive()
            if i == n - 1: q_empty.arrive()
            yield lambda: True
            rd("v", vs, w, False); empty_v[vs].arrive()
        vs, vp = slot(kv + n - 1)
        yield lambda: full_v[vs].passed(vp)
        yield from turn_wait(w); rd("v", vs, w, True); turn_pass(w)
        yield lambda: True
        rd("v", vs, w, False); empty_v[vs].arrive()
    def consumer(w):
        kv = 0; qi = 0
        for (n, ranges) in tiles:
            if n == 0: continue
            yield lambda qi=qi: q_full.passed(qi & 1)
            own = ranges[w]  # (lead, n_own) or None
            if own is None:
                yield from skip_steps(w, kv, n)
                q_empty.arrive()
                if overlap:
                    yield from turn_wait(w); turn_pass(w)
            else:
                lead, n_own = own
                yield from skip_steps(w, kv, lead)
                yield from consume(w, kv + lead, n_own)
                yield from skip_steps(w, kv + lead + n_own, n - lead - n_own)
            kv += n; qi += 1
    agents = [producer()] + [consumer(w) for w in range(W)]
    conds = [None] * len(agents)
    alive = list(range(len(agents)))
    def step(a):
        try: conds[a] = next(agents[a])
        except StopIteration: alive.remove(a)
    for a in list(alive): step(a)
    while alive:
        ready = [a for a in alive if conds[a]()]
        if not ready: raise RuntimeError(f"deadlock, alive {alive}")
        step(rng.choice(ready))

def random_tiles(rng, W, count):
    tiles = []
    for _ in range(count):
        n = rng.choice([0, 1, 1, 2, 3, 5, 8])
        ranges = []
        for w in range(W):
            if n == 0 or rng.random() < 0.2: ranges.append(None); continue
            n_own = rng.randint(1, n); lead = rng.randint(0, n - n_own)
            ranges.append((lead, n_own))
        if n and all(r is None for r in ranges): ranges[0] = (0, n)  # the CTA range is the union
        tiles.append((n, ranges))
    return tiles

for trial in range(3000):
    rng = random.Random(trial)
    W = rng.choice([2, 3]); S = rng.choice([2, 3])
    tiles = random_tiles(rng, W, rng.randint(1, 6))
    run(trial, W, S, tiles)
print("3000 random schedules: no deadlock, no over-arrival, no load under a reader")
