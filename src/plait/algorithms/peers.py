"""Pure peer math: ring neighbours, binomial trees, recursive doubling partners."""

from __future__ import annotations


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(left, right) in the ring 0 -> 1 -> ... -> size-1 -> 0."""
    return (rank - 1) % size, (rank + 1) % size


def binomial_parent(vrank: int) -> int | None:
    """Parent of ``vrank`` (rank relative to the root) in a binomial tree; root has none."""
    if vrank == 0:
        return None
    return vrank - (1 << (vrank.bit_length() - 1))


def binomial_children(vrank: int, size: int) -> list[int]:
    """Children of ``vrank`` in the order the tree sends to them, one per step."""
    children = []
    mask = 1 << (vrank.bit_length()) if vrank else 1
    while vrank + mask < size:
        children.append(vrank + mask)
        mask <<= 1
    return children


def pof2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def rd_layout(size: int) -> tuple[int, int]:
    """Recursive doubling for any size: (p, rem) with p the largest power of two <= size.

    The first ``2*rem`` ranks pair up (even -> odd) so that ``p`` ranks remain.
    """
    p = pof2_floor(size)
    return p, size - p


def rd_newrank(rank: int, rem: int) -> int | None:
    """Rank among the ``p`` participants, or None for a rank that sat out (even < 2*rem)."""
    if rank < 2 * rem:
        return None if rank % 2 == 0 else rank // 2
    return rank - rem


def rd_oldrank(newrank: int, rem: int) -> int:
    return newrank * 2 + 1 if newrank < rem else newrank + rem
