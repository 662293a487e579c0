#!/usr/bin/env python3
"""Session 74's host model of the v3 forward's persistent causal tile order: the DRAM bytes it reads through an LRU
cache, and its balance, by head-batches per group (bench/NOTES.md session 74). A replica of tile_config.h
TileOrder::coord (heavy_first), tile_order_cta (the snake) and tile_order_makespan; each CTA runs its static tiles
back to back, a tile of n key blocks taking TILE + n x BLOCK cycles (session 73's trace at 512 causal), reading Q at
its start, K_j and V_j at its j-th block and writing O at its end, all in 32 KB chunks (one 128 x 128 bf16 box).
The cache's size is the one free parameter: 30 MB reproduces session 70's 221 MB read at 512 causal.
    python3 2026-12-07-s74-order-l2-model.py M_BLOCKS HEAD_BATCHES GROUPS [CACHE_MB ...]
    e.g. 4 512 512,57,8,4,2 30 40 50   (d128 512 causal on the bench's grid: b32 h16)
"""
import sys
from collections import OrderedDict

GRID, BLOCK, TILE, CHUNK_KB = 132, 3900, 3400, 32


def coord(t, m_blocks, heads_batches, group):
    g = t // (group * m_blocks)
    r = t - g * group * m_blocks
    size = heads_batches - g * group if heads_batches - g * group < group else group
    k = r // size
    return (k if g & 1 else m_blocks - 1 - k), g * group + r - k * size


def cta_tiles(m_blocks, heads_batches):
    tiles = [[] for _ in range(GRID)]
    for t in range(m_blocks * heads_batches):
        rnd, i = divmod(t, GRID)
        tiles[GRID - 1 - i if rnd & 1 else i].append(t)
    return tiles


def makespan(m_blocks, heads_batches, group, overhead=0.3):
    load = [sum(coord(t, m_blocks, heads_batches, group)[0] + 1 + overhead for t in ts)
            for ts in cta_tiles(m_blocks, heads_batches)]
    return max(load) / (sum(load) / GRID)


def dram_read_mb(m_blocks, heads_batches, group, cache_mb):
    events = []
    for ts in cta_tiles(m_blocks, heads_batches):
        now = 0
        for t in ts:
            m, hb = coord(t, m_blocks, heads_batches, group)
            events.append((now, ("Q", hb, m)))
            for j in range(m + 1):
                events += [(now + TILE / 2 + j * BLOCK, ("K", hb, j)), (now + TILE / 2 + j * BLOCK, ("V", hb, j))]
            now += TILE + (m + 1) * BLOCK
            events.append((now, ("O", hb, m)))
    events.sort(key=lambda e: e[0])
    cache, reads, cap = OrderedDict(), 0, int(cache_mb * 1024 / CHUNK_KB)
    for _, key in events:
        if key in cache:
            cache.move_to_end(key)
            continue
        reads += key[0] != "O"
        cache[key] = True
        if len(cache) > cap:
            cache.popitem(last=False)
    return reads * CHUNK_KB * 1024 / 1e6


def main():
    m_blocks, heads_batches = int(sys.argv[1]), int(sys.argv[2])
    groups = [int(g) for g in sys.argv[3].split(",")]
    caches = [float(c) for c in sys.argv[4:]] or [30.0]
    for g in groups:
        cols = "  ".join(f"{c:g} MB cache: {dram_read_mb(m_blocks, heads_batches, g, c):6.1f} MB read" for c in caches)
        print(f"group {g:4d}: makespan {makespan(m_blocks, heads_batches, g):.4f}x the mean  {cols}")


if __name__ == "__main__":
    main()
