"""`kvrag store stats|verify|gc`: inspect and maintain the KV store. The result (a table, or with --json the
JSON) goes to stdout; stderr holds progress, warnings and errors alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from kvrag.cli.common import (
    JSON_OPTION,
    STORE_OPTION,
    print_json,
    resolve_store,
    stderr_console,
    stdout_console,
)
from kvrag.cli.typer_apps import store_app
from kvrag.errors import KvragError

if TYPE_CHECKING:  # the store's maintenance code loads when a store command runs, not with every command
    from rich.console import Console

    from kvrag.store.env import StoreEnv
    from kvrag.store.maintenance import GcReport, StoreStats, VerifyReport

_SHOWN_PROBLEMS = 20  # listed one by one; all of them are in --json


def _open(store: Path | None) -> StoreEnv:
    from kvrag.store.env import StoreEnv

    return StoreEnv.open(resolve_store(store))


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


@store_app.command("stats")
def stats_command(
    store: Path | None = STORE_OPTION,
    json_out: bool = JSON_OPTION,
) -> None:
    """Chunks, tokens and bytes per token of the stored KV, per model, codec and variant (full chunks, or a
    reduced `precompute --keep` form with the share of tokens it kept), with per-layer sizes.

    Example: kvrag store stats --store ./my-store
    """
    with _open(store) as env:
        from kvrag.store.chunks import ChunkTable
        from kvrag.store.maintenance import stats
        from kvrag.store.prefix_table import table_stats

        result = stats(env)
        kept = ChunkTable(env).client_records()
        prefix = table_stats(env)
    client = {"passages": len(kept), "tokens": sum(len(r.token_ids) for r in kept),
              "tenants": len({r.doc_id for r in kept})}
    if json_out:
        print_json({**_stats_json(result), "client_passages": client, "prefix_table": prefix})
    else:
        out = stdout_console()
        _print_stats(out, result)
        out.print(f"passages kept from clients' prompts: {client['passages']:,} ({client['tokens']:,} tokens, "
                  f"{client['tenants']} tenant(s)); `kvrag store gc --client-passages` drops them")
        out.print(f"prefix cache blocks spilled by servers: {prefix['blocks']:,} ({_mib(prefix['bytes'])}); "
                  "`kvrag store gc --prefix-blocks` drops them")


@store_app.command("verify")
def verify_command(
    store: Path | None = STORE_OPTION,
    repair: bool = typer.Option(False, "--repair", help="Delete every chunk with a corrupt value; "
                                                        "the next `kvrag precompute` computes it again."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Read and decode every stored value, checking checksums, lengths and shapes.

    Exits 1 when something is corrupt (unless --repair deleted it).

    Example: kvrag store verify --repair
    """
    with _open(store) as env, stderr_console().status("verifying every stored value"):
        from kvrag.store.maintenance import verify
        from kvrag.store.prefix_table import bad_blocks, drop

        report = verify(env, repair=repair)
        bad = bad_blocks(env)  # the prefix table's blocks that are not whole
        if repair:
            drop(env, bad)
    if json_out:
        print_json({**asdict(report), "bad_prefix_blocks": len(bad), "ok": report.ok and not bad})
    else:
        _print_verify(stdout_console(), report)
        if bad:
            stdout_console().print(f"{len(bad)} prefix cache block(s) not whole" + (": deleted" if repair else ""))
    if not report.ok and not repair:
        chunks = len({(p.model_fp, p.codec, p.variant, p.chunk_id) for p in report.problems})
        raise KvragError(f"{len(report.problems)} problem(s) in {chunks} chunk(s); "
                         "`kvrag store verify --repair` deletes them so the next precompute redoes them")
    if bad and not repair:
        raise KvragError(f"{len(bad)} prefix cache block(s) not whole; `kvrag store verify --repair` deletes them")


@store_app.command("gc")
def gc_command(
    store: Path | None = STORE_OPTION,
    model: str | None = typer.Option(None, "--model", help="Keep only this model fingerprint's KV; "
                                                          "drop every other model's."),
    drop_model: str | None = typer.Option(None, "--drop-model", help="Drop all KV of this model fingerprint."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would go; delete nothing."),
    client_passages: bool = typer.Option(False, "--client-passages",
                                         help="Drop the passages kept from clients' prompts too (records and KV)."),
    prefix_blocks: bool = typer.Option(False, "--prefix-blocks", help="Drop every prefix cache block servers "
                                       "spilled (else only those of the models dropped)."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Drop KV of chunks that are no longer indexed, and of other models with --model / --drop-model.

    Model fingerprints are listed by `kvrag store stats`. LMDB reuses the freed pages; the file
    does not shrink.

    Example: kvrag store gc --model 3f2a9c0d1e4b5a6f7c8d9e0f
    """
    from kvrag.store.chunks import ChunkTable

    with _open(store) as env:
        table = ChunkTable(env)
        clients = table.client_records() if client_passages else []
        dropped = frozenset(r.chunk_id for r in clients)
        indexed = table.ids() - dropped
        if not indexed:
            if model is None and drop_model is None and not dropped:
                raise KvragError(f"no chunks are indexed in {env.path}, so gc would drop all KV; "
                                 "run `kvrag index` first, or use --model / --drop-model")
            indexed = None  # only the model-wise drop, or the clients' passages
        from kvrag.store.maintenance import gc

        if dropped and not dry_run:  # records first: a record never names KV that is gone
            table.delete_records(dropped)
        report = gc(env, indexed, keep_model=model, drop_model=drop_model, dry_run=dry_run, drop_ids=dropped,
                    drop_lead_in=_holds_any(clients) if clients else None)
        from kvrag.store.prefix_table import drop_models

        prefix = 0 if dry_run else drop_models(
            env, lambda fp: prefix_blocks or (model is not None and fp != model) or fp == drop_model)
    if json_out:
        print_json({**asdict(report), "dropped_prefix_blocks": prefix})
    else:
        _print_gc(stdout_console(), report)
        if prefix:
            stdout_console().print(f"dropped {prefix:,} prefix cache block(s)")


def _holds_any(records) -> Callable[[tuple[int, ...]], bool]:
    """Whether a lead-in's token ids hold any of these passages (one chosen, by an earlier release, from clients')."""
    from kvrag.precompute.lead_in import LeadIn

    return lambda ids: any(LeadIn(ids).holds(r.token_ids) for r in records)


def _stats_json(result: StoreStats) -> dict:
    out = asdict(result)
    for group, raw in zip(result.groups, out["groups"], strict=True):
        raw["bytes_per_token"] = round(group.bytes_per_token, 1)
        raw["kept_share"] = round(group.kept_share, 4)
    return out


def _print_stats(out: Console, result: StoreStats) -> None:
    out.print(f"store {result.path} (schema {result.schema_version}): {_mib(result.used_bytes)} used, "
              f"map {_mib(result.map_size)}; models: {', '.join(result.models) or 'none'}")
    if not result.groups:
        out.print("no KV stored yet (run `kvrag precompute`)")
        return
    table = Table("model", "codec", "variant", "chunks", "tokens", "kept", "size", "bytes/token", "layers", "preamble")
    for g in result.groups:
        preamble = f"{g.preamble_tokens} tokens" if g.preamble_tokens else "missing" if not g.variant else "-"
        table.add_row(g.model_fp, g.codec, g.variant or "full", f"{g.chunks:,}", f"{g.tokens:,}",
                      f"{g.kept_share:.0%}", _mib(g.bytes), f"{g.bytes_per_token:,.0f}", str(len(g.layer_bytes)),
                      preamble)
    out.print(table)
    for g in result.groups:
        if g.layer_bytes:
            sizes = " ".join(f"{b / (1 << 20):.1f}" for b in g.layer_bytes)
            out.print(f"{g.model_fp} {g.codec} {g.variant or 'full'} per-layer MiB: {sizes}")
        if g.damaged_records:
            stderr_console().print(f"[red]{g.damaged_records} damaged chunk record(s): run `kvrag store verify`[/red]")


def _print_verify(out: Console, report: VerifyReport) -> None:
    out.print(f"checked {report.chunks:,} chunks, {report.values:,} values ({_mib(report.bytes)})")
    if report.ok:
        out.print("[green]no problems[/green]")
        return
    table = Table("model", "codec", "variant", "chunk", "layer", "problem")
    for p in report.problems[:_SHOWN_PROBLEMS]:
        table.add_row(p.model_fp, p.codec, p.variant or "full", p.chunk_id, "-" if p.layer is None else str(p.layer),
                      p.reason)
    out.print(table)
    if len(report.problems) > _SHOWN_PROBLEMS:
        out.print(f"… and {len(report.problems) - _SHOWN_PROBLEMS} more (see --json)")
    if report.repaired_chunks:
        out.print(f"repaired: deleted {report.repaired_chunks} chunk(s); `kvrag precompute` recomputes them")


def _print_gc(out: Console, report: GcReport) -> None:
    verb = "would drop" if report.dry_run else "dropped"
    models = f"; {verb} model(s) {', '.join(report.dropped_models)}" if report.dropped_models else ""
    out.print(f"{verb} {report.dropped_chunks:,} chunk(s), {_mib(report.dropped_bytes)}{models}; "
              f"kept {report.kept_chunks:,}")
    if report.dropped_lead_ins:
        out.print(f"{verb} {report.dropped_lead_ins} lead-in(s) holding a client's passage, with the chunks computed "
                  "after them: the next `kvrag precompute` chooses one from the corpus and computes them again")
