# session 77: a host model of the dynamic tile scheduler's barrier protocol
# (2026-12-07-s77-fwd-dynamic-tiles-claim-records.patch): the claiming thread, the producer (its loads), the
# consumers (8 warps as one), random interleavings; mbarrier phases as try_wait.parity sees them. Changing one
# parity or dropping one release makes it report a deadlock. Run: python3 <this file>
import random

class Bar:
    def __init__(s, count): s.count, s.pending, s.phase = count, count, 0
    def arrive(s, n=1):
        s.pending -= n; assert s.pending >= 0
        if s.pending == 0: s.phase ^= 1; s.pending = s.count
    def ready(s, parity): return s.phase != parity   # try_wait.parity: the phase of that parity has completed

def run(seed, grid=4, n_tiles=23, empty_frac=0.2):
    rnd = random.Random(seed)
    empty = {t for t in range(n_tiles) if rnd.random() < empty_frac}
    counter = [0]
    ctas = []
    for c in range(grid):
        st = dict(tile_full=Bar(1), tile_empty=Bar(8), rec_full=[Bar(1), Bar(1)], rec_empty=[Bar(1), Bar(1)],
                  slot=None, rec=[None, None], issued=-1, cons_round=0, cons_done=-1, done_c=False, done_p=False,
                  done_cl=False, tiles_c=[], tiles_p=[], c=c)
        def claimer(st=st, c=c):
            r = 0
            while True:
                t = c  # round 0: the static order's tile (blockIdx.x)
                if r > 0:
                    while not st['tile_empty'].ready(((r - 1) & 1) ^ 1): yield
                    t = grid + counter[0]; counter[0] += 1
                    yield
                    st['slot'] = t; st['tile_full'].arrive()
                s = r & 1
                while not st['rec_empty'][s].ready(((r >> 1) & 1) ^ 1): yield
                st['rec'][s] = (t, -1 if t >= n_tiles else (0 if t in empty else 1))
                st['rec_full'][s].arrive()
                if t >= n_tiles: st['done_cl'] = True; return
                r += 1; yield
        def producer(st=st):
            rnd_ = 0
            while True:
                s = rnd_ & 1
                while not st['rec_full'][s].ready((rnd_ >> 1) & 1): yield
                t, blocks = st['rec'][s]
                if blocks < 0: st['done_p'] = True; return
                if blocks == 0:
                    st['rec_empty'][s].arrive(); rnd_ += 1; continue
                # Q of round rnd_ needs the consumers past their previous round with loads (one Q buffer)
                while st['cons_done'] < rnd_ - 1 and not st['done_c']: yield
                st['tiles_p'].append(t); st['issued'] = rnd_
                yield
                st['rec_empty'][s].arrive(); rnd_ += 1; yield
        def consumers(st=st, c=c):
            r = 0
            while True:
                if r == 0: t = c
                else:
                    while not st['tile_full'].ready((r - 1) & 1): yield
                    t = st['slot']
                    for _ in range(8): st['tile_empty'].arrive(); yield
                if t >= n_tiles: st['done_c'] = True; return
                if t not in empty:
                    while st['issued'] < r: yield   # this round's loads
                st['tiles_c'].append(t)
                yield
                st['cons_done'] = r; r += 1
        ctas.append((st, [claimer(), producer(), consumers()]))
    actors = [(st, g) for st, gs in ctas for g in gs]
    steps = 0
    while actors:
        steps += 1
        if steps > 200000: raise RuntimeError(f"deadlock, seed {seed}")
        i = rnd.randrange(len(actors))
        try: next(actors[i][1])
        except StopIteration: actors.pop(i)
    allc = sorted(t for st, _ in ctas for t in st['tiles_c'])
    assert allc == list(range(n_tiles)), allc
    for st, _ in ctas:
        assert st['tiles_p'] == [t for t in st['tiles_c'] if t not in empty], (st['tiles_p'], st['tiles_c'])
    return steps

for seed in range(3000):
    run(seed, grid=random.Random(seed).randint(1, 6), n_tiles=random.Random(seed + 1).randint(1, 40))
print("ok: 3000 random schedules, every tile once, producer and consumers on the same tiles, no deadlock")
