"""A list-scheduling model of the sparse Gluon backward's program order (NOTES, session 27): programs (query head,
key block) of cost = 2 tiles per query block that kept the key block (BLOCK_M 64, blocks of 128) + the own block's
~1.5 tiles + ~4 tiles of prologue / epilogue, random causal top-k selections per kv head, dispatched in grid order to
the first free SM (one program an SM). Prints the makespan over the ideal (total / SMs) for key-tile-fastest order
(HEAD_GROUP 1) and for slices in groups of G, key tile by key tile.

    python scripts/sim_bwd_order.py [--blocks 128,256,512] [--sms 132]
"""
import argparse
import heapq
import random


def costs(nqb, topk, heads, kv_heads, rng):
    per_kv = heads // kv_heads
    out = {}
    for g in range(kv_heads):
        kept = [0] * nqb
        for i in range(1, nqb):
            for j in rng.sample(range(i), min(topk, i)):
                kept[j] += 1
        for h in range(per_kv):
            for j in range(nqb):
                out[(g * per_kv + h, j)] = 2 * kept[j] + 1.5 + 4
    return out


def makespan(order, cost, sms):
    free = [0.0] * sms
    for key in order:
        heapq.heappush(free, heapq.heappop(free) + cost[key])
    return max(free)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="128,256,512,1024")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    rng = random.Random(0)
    for nqb in map(int, args.blocks.split(",")):
        cost = costs(nqb, 16, args.heads, 2, rng)
        ideal = sum(cost.values()) / args.sms
        row = []
        for g in (1, 2, 4, 8, args.heads):
            order = [(g0 + h, j) for g0 in range(0, args.heads, g) for j in range(nqb) for h in range(g)]
            row.append(f"G{g} {makespan(order, cost, args.sms) / ideal:.3f}")
        print(f"{nqb} blocks: " + ", ".join(row))


if __name__ == "__main__":
    main()
