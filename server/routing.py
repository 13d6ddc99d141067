"""Which replica answers a request, when several serve one store (`kvrag serve --ray-serve`): chunk-aware routing.

A request's key is its chunks (retrieved at the router, named by `chunk_ids`, or the stored passages found in its
prompt), each with its token count. A replica's score for it is, over those chunks,

    tokens x (HELD if the replica reports the chunk in its memory tiers) + tokens x (1 if it is the chunk's home)

where a chunk's home is its rendezvous (highest-random-weight) hash over the replicas. The replica that already holds
most of the prompt wins; chunks nobody holds go to their home, so one chunk set always lands on one replica and
warms it there, and a replica joining or leaving moves only the chunks whose home it was.

Load is bounded as in consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): a replica
already running ceil(BALANCE x (in flight + 1) / replicas) requests is passed over for the next by score, so one
hot chunk set spills to a second replica (which warms a copy) instead of queueing on its home.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

import xxhash

HELD = 2.0  # a token a replica holds in memory outweighs a token whose home it is: warm beats assigned
# c in the bounded-load cap: 25 % over an even share, the paper's and HAProxy's (hash-balance-factor 125). On 2 real
# replicas (docs/performance.md) 1.0 lost a fifth of the hits; in bench/cluster_sim.py's open-loop queue at 90 %
# utilisation 1.0 had the better p90 (--ray-balance sets it).
BALANCE = 1.25


@dataclass(frozen=True)
class RoutingConfig:
    held: float = HELD
    balance: float = BALANCE

    def __post_init__(self) -> None:
        if self.held < 0 or self.balance < 1:
            raise ValueError(f"held must be >= 0 and balance >= 1, got {self.held} and {self.balance}")


def weight(key: str, replica: str) -> int:
    """The rendezvous weight of `key` on `replica`: a 64-bit hash of both, the same in every process."""
    return xxhash.xxh3_64_intdigest(f"{replica}\0{key}".encode())


def home(chunk_id: str, replicas: Sequence[str]) -> str:
    return max(replicas, key=lambda r: weight(chunk_id, r))


def scores(chunks: Sequence[tuple[str, int]], replicas: Sequence[str], held: Mapping[str, Container[str]],
           config: RoutingConfig = RoutingConfig()) -> dict[str, float]:
    """Each replica's score for a request of `chunks` ((chunk id, tokens)); `held`: replica -> chunk ids it holds."""
    out = dict.fromkeys(replicas, 0.0)
    for chunk_id, tokens in chunks:
        w = max(int(tokens), 1)
        out[home(chunk_id, replicas)] += w
        for replica in replicas:
            if chunk_id in held.get(replica, ()):
                out[replica] += config.held * w
    return out


def load_cap(load: Mapping[str, int], n_replicas: int, balance: float) -> int:
    """The most requests in flight a replica may have and still be given one more."""
    return math.ceil(balance * (sum(load.values()) + 1) / n_replicas)


def rank(chunks: Sequence[tuple[str, int]], replicas: Sequence[str], held: Mapping[str, Container[str]],
         load: Mapping[str, int], config: RoutingConfig = RoutingConfig()) -> list[str]:
    """The replicas in the order to try them: by score (ties: the less loaded, then the chunk set's own rendezvous
    order), those under the load cap before those at or over it. A request with no chunks goes to the least loaded."""
    if not replicas:
        return []
    score = scores(chunks, replicas, held, config)
    key = "\0".join(chunk_id for chunk_id, _ in chunks)
    order = sorted(replicas, key=lambda r: (-score[r], load.get(r, 0), -weight(key, r)))
    cap = load_cap(load, len(replicas), config.balance)
    under = [r for r in order if load.get(r, 0) < cap]
    return under + [r for r in order if load.get(r, 0) >= cap]
