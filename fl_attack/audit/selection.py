"""Which of a round's client updates are attacked, and how they are grouped."""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence

from .observations import ClientUpdate


def select_units(
    updates: Sequence[ClientUpdate],
    *,
    server_round: int,
    partitions: Collection[int] | None,
    group_size: int,
    fraction: float,
    seed: int,
) -> list[list[ClientUpdate]]:
    """The units attacked in a round: single updates, or secure-aggregation groups.

    Updates of the listed ``partitions`` (all when None) are ordered by partition id, then node
    id, and cut into consecutive groups of ``group_size``; a seeded ``fraction`` of the groups
    is kept (the same ones for the same ``seed`` and ``server_round``).
    """
    eligible = [
        update for update in updates if partitions is None or update.identity.partition_id in partitions
    ]
    eligible.sort(
        key=lambda item: (
            item.identity.partition_id is None,
            item.identity.partition_id or 0,
            item.identity.node_id,
        )
    )
    units = [eligible[start : start + group_size] for start in range(0, len(eligible), group_size)]
    count = math.ceil(fraction * len(units))
    if count >= len(units):
        return units
    chosen = random.Random(f"{seed}-{server_round}").sample(range(len(units)), count)
    return [units[index] for index in sorted(chosen)]
