"""Which ranks hold each rank's own state (its buddies), placed so a whole node can fail.

Each rank pushes its per-step bundle (random streams, buffers, data position) to
`redundancy` buddies. Buddies on other nodes come first (rank r's counterpart on the next
nodes, r + per_node, r + 2 * per_node, ...), so losing a node loses none of its ranks'
bundles; with one node, or more buddies than other nodes, the next ranks fill in. The
orchestrator (where to push, where a lost rank's bundle is) and every rank (whose bundles
it holds) compute the same lists from the same numbers.
"""

from __future__ import annotations


def buddies_of(rank: int, world: int, per_node: int, redundancy: int) -> list[int]:
    if world <= 1 or redundancy <= 0:
        return []
    per_node = max(1, min(per_node, world))
    node = rank // per_node
    order = [(rank + per_node * i) % world for i in range(1, -(-world // per_node))]
    order = [r for r in order if r // per_node != node]
    order += [(rank + i) % world for i in range(1, world)]
    out: list[int] = []
    for r in order:
        if r != rank and r not in out:
            out.append(r)
        if len(out) == min(redundancy, world - 1):
            break
    return out


def wards_of(rank: int, world: int, per_node: int, redundancy: int) -> list[int]:
    """The ranks whose bundles `rank` holds."""
    return [r for r in range(world) if rank in buddies_of(r, world, per_node, redundancy)]
