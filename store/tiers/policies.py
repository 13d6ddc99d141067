"""Replacement policies: the priority of a knowledge-tree node; the lowest-priority evictable leaf goes.

    PGDSF  Clock + Frequency × Cost/Size   Cost/Size: mean over the requests that computed the node of
                                           T(cached, new) / new — per non-cached token, so a chunk computed
                                           behind a long cached prefix (costlier attention) is worth more
    GDSF   Clock + Frequency × Cost/Size   Cost/Size: T(0, size) / size — the chunk alone, prefix-blind
    LRU    last access
    LFU    frequency

A priority is computed when a node is accessed (or enters a tier) with that tier's clock, and kept;
the clock rises to the priority of each node the tier evicts (GreedyDual aging). Ties go to the least
recently used node. Statistics live in `AccessStats`, which outlives the node (see knowledge_tree).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from kvrag.errors import KvragError


@dataclass
class AccessStats:
    """What a policy knows of one tree path (a chunk after its prefix)."""

    size: int  # tokens
    frequency: int = 0  # requests that used this path (hits and computes)
    last_access: int = 0  # logical time of the last use
    cost_sum: float = 0.0  # Σ over computing requests of T(cached, new) / new, in seconds per token
    cost_count: int = 0
    solo_cost: float = 0.0  # T(0, size) / size: seconds per token of computing the chunk alone

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a node holds at least one token, got {self.size}")

    def record_access(self, tick: int) -> None:
        self.frequency += 1
        self.last_access = tick

    def record_compute(self, per_token_cost: float) -> None:
        self.cost_sum += per_token_cost
        self.cost_count += 1

    @property
    def cost_per_token(self) -> float:
        return self.cost_sum / self.cost_count if self.cost_count else self.solo_cost


class Policy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def priority(self, stats: AccessStats, clock: float) -> float:
        """The node's priority in a tier whose clock is `clock` (lower goes first)."""


class PGDSF(Policy):
    name = "pgdsf"

    def priority(self, stats: AccessStats, clock: float) -> float:
        return clock + stats.frequency * stats.cost_per_token


class GDSF(Policy):
    name = "gdsf"

    def priority(self, stats: AccessStats, clock: float) -> float:
        return clock + stats.frequency * stats.solo_cost


class LRU(Policy):
    name = "lru"

    def priority(self, stats: AccessStats, clock: float) -> float:
        return float(stats.last_access)


class LFU(Policy):
    name = "lfu"

    def priority(self, stats: AccessStats, clock: float) -> float:
        return float(stats.frequency)


POLICY_CLASSES: dict[str, type[Policy]] = {p.name: p for p in (PGDSF, GDSF, LRU, LFU)}


def make_policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    try:
        return POLICY_CLASSES[name.lower()]()
    except KeyError:
        raise KvragError(f"unknown cache policy {name!r} (choose {', '.join(POLICY_CLASSES)})") from None
