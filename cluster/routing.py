"""Which replica answers a request, when several serve one store (`kvrag serve --ray-serve`): chunk-aware routing.

A request's key is its chunks (retrieved at the router, named by `chunk_ids`, or the stored passages found in its
prompt), each with its token count. A replica's score for it is, over those chunks,

    tokens x (HELD if the replica reports the chunk in its memory tiers) + tokens x (1 if it is the chunk's home)

where a chunk's home is its rendezvous (highest-random-weight) hash over the replicas. The replica that already holds
most of the prompt wins; chunks nobody holds go to their home, so one chunk set always lands on one replica and
warms it there, and a replica joining or leaving moves only the chunks whose home it was.

Load is bounded as in consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018), on two
counts: a replica is passed over for the next by score while it runs ceil(BALANCE x (in flight + 1) / replicas)
requests, or while it took ceil(BALANCE x (recent + 1) / replicas) of the router's last `recent` (at most WINDOW)
routings. In flight alone bounds nothing with few clients (docs/cluster.md); the window bounds every replica's share
whatever the arrival order, so one hot chunk set spills to a second replica (which warms a copy) instead of queueing
on its home.
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
WINDOW = 32  # the recent routings a replica's share is counted over: 16 each on 2 replicas, 4 each on 8


@dataclass(frozen=True)
class RoutingConfig:
    held: float = HELD
    balance: float = BALANCE
    window: int = WINDOW  # 0: in flight alone bounds the load

    def __post_init__(self) -> None:
        if self.held < 0 or self.balance < 1 or self.window < 0:
            raise ValueError(f"held and window must be >= 0 and balance >= 1, got {self.held}, {self.window} and "
                             f"{self.balance}")


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


def load_cap(counts: Mapping[str, int], n_replicas: int, balance: float) -> int:
    """The most of `counts` (requests in flight, or recent routings) a replica may have and still be given one
    more: `balance` x an even share of them and the one to place."""
    return math.ceil(balance * (sum(counts.values()) + 1) / n_replicas)


def rank(chunks: Sequence[tuple[str, int]], replicas: Sequence[str], held: Mapping[str, Container[str]],
         load: Mapping[str, int], config: RoutingConfig = RoutingConfig(),
         recent: Mapping[str, int] | None = None) -> list[str]:
    """The replicas in the order to try them: by score (ties: the less loaded, the fewer recent routings, then the
    chunk set's own rendezvous order), those under both caps (`load`: in flight; `recent`: of the last routings)
    first, then those under the recent cap (one always is: the caps sum to more than the window), then the rest. A
    request with no chunks goes to the least loaded."""
    if not replicas:
        return []
    recent = recent or {}
    score = scores(chunks, replicas, held, config)
    key = "\0".join(chunk_id for chunk_id, _ in chunks)
    cap, recent_cap = (load_cap(counts, len(replicas), config.balance) for counts in (load, recent))
    return sorted(replicas, key=lambda r: (recent.get(r, 0) >= recent_cap, load.get(r, 0) >= cap, -score[r],
                                           load.get(r, 0), recent.get(r, 0), -weight(key, r)))
