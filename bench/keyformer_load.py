"""Keyformer at question time: reduced chunks loaded and blended, against a full prefill (issue 27).

For every passage of the items, one forward scores its keys under every rule (as `precompute --keep` does: the same
noise, from (seed, chunk id)) and the store gets its full KV and each (rule, keep) reduction, in fp16 and int8,
keyed apart as precompute keys them. Then each item's prompt (its passages in order) is prefilled in full (the
reference: first-token logits and a greedy answer) and blended at a fixed ratio over every (codec, rule, keep):

    store B/token   the variant's stored bytes (values, headers included) over the passages' tokens
    load B          bytes the prompt's loader read from the store
    TTFT            the blended prefill's wall time (load and compute overlapped), and its ratio to keep 1's in
                    the same codec, per item (configurations run interleaved, so a shared machine's drift weighs
                    on each alike)
    top-1, KL       the first token against the full prefill's, and KL(full || blend) of the first-token
                    distributions
    F1              of the greedy answer (up to `max_tokens`) against the gold answers

Run: kvrag bench keyformer --load --split report --items 50 --store DIR [--records FILE] [--plot FILE] --json
(with --records, each item's records are appended to FILE as it ends, and a rerun skips the items FILE holds)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvrag.bench.keyformer import CODECS, KEEPS, RULE_NAMES, chunk_scores
from kvrag.bench.rag.metrics import best_f1, kl_divergence, top1_agrees
from kvrag.blend.config import BlendConfig
from kvrag.cli.common import load_runtime
from kvrag.engine.prefiller import Prefiller
from kvrag.errors import KvragError
from kvrag.model.decode import generate
from kvrag.model.prefill import extend
from kvrag.model.runtime import Runtime
from kvrag.model.sampling import SamplingConfig
from kvrag.precompute import keyformer
from kvrag.precompute.keyformer import KeepConfig
from kvrag.precompute.plain import layers_to_numpy
from kvrag.store.chunks import chunk_id_for
from kvrag.store.env import StoreEnv
from kvrag.store.kv import LocalKVTable


@dataclass(frozen=True)
class Variant:
    codec: str
    rule: str  # "full" at keep 1
    keep: float

    @property
    def name(self) -> str:
        return f"{self.codec}:full" if self.keep == 1 else f"{self.codec}:{self.rule}@{self.keep:g}"

    @property
    def keep_config(self) -> KeepConfig | None:
        return None if self.keep == 1 else KeepConfig(self.keep, self.rule)


def variants(codecs: Sequence[str] = CODECS, rules: Sequence[str] = RULE_NAMES,
             keeps: Sequence[float] = KEEPS) -> list[Variant]:
    out = []
    for codec in codecs:
        out.append(Variant(codec, "full", 1.0))
        out += [Variant(codec, rule, keep) for rule in rules for keep in keeps if keep < 1]
    return out


def _table(env: StoreEnv, runtime: Runtime, v: Variant) -> LocalKVTable:
    cfg = v.keep_config
    return LocalKVTable(env, runtime.fingerprint, v.codec, True, cfg.variant if cfg else "")


def item_chunks(runtime: Runtime, item: dict) -> list[tuple[str, list[int]]]:
    out = []
    for ctx in item["ctxs"]:
        ids = runtime.prompts.passage_ids(ctx["title"], ctx["text"])
        out.append((chunk_id_for(ids, runtime.local.tokenizer_fingerprint), ids))
    return out


def build_store(runtime: Runtime, env: StoreEnv, items: list[dict], vs: list[Variant]) -> int:
    """Every passage's full and reduced KV into the store (resumable: a passage every variant holds is skipped);
    the number of passages computed."""
    tables = {v: _table(env, runtime, v) for v in vs}
    rules = sorted({v.rule for v in vs if v.keep < 1}, key=RULE_NAMES.index)
    cfgs = [KeepConfig(0.5, rule) for rule in rules]
    done = 0
    with torch.inference_mode():
        _, preamble = extend(runtime.model, None, runtime.ids_tensor(runtime.prompts.preamble_ids))
        seen: set[str] = set()
        for item in items:
            for cid, ids in item_chunks(runtime, item):
                if cid in seen or all(t.has(cid) for t in tables.values()):
                    continue
                seen.add(cid)
                kv, scores = chunk_scores(runtime, preamble, ids, cid, cfgs)
                summed = scores.sum(dim=(0, 2))  # [n_rules, T]: one set per chunk, as precompute keeps
                layers = {codec: layers_to_numpy(kv, codec) for codec in {v.codec for v in vs}}
                for v, table in tables.items():
                    if v.keep == 1:
                        table.put_chunk(cid, ids, layers[v.codec])
                        continue
                    kept = keyformer.select(summed[rules.index(v.rule)], v.keep).cpu().numpy().astype(np.int32)
                    table.put_chunk(cid, ids, keyformer.reduce_layers(layers[v.codec], kept), kept)
                done += 1
    return done


def _answer(engine: Prefiller, pre, max_tokens: int) -> str:
    tokens = list(generate(engine.model, pre.cache, pre.logits, SamplingConfig(max_tokens), engine.stop_ids))
    return engine.runtime.tokenizer.decode(tokens, skip_special_tokens=True).strip()


class RecordLog:
    """Per-item records appended to a JSON-lines file as each item ends, so an interrupted run resumes: a header line
    (ratio, max_tokens, variants) that a resumed run must match, then one {"question", "records"} line per item."""

    def __init__(self, path: Path | None, header: dict):
        self.path, self.header, self.done = path, header, {}
        if path is None or not path.exists():
            return
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if lines and lines[0] != header:
            raise KvragError(f"{path} holds records of another run ({lines[0]}); give a new --records file")
        self.done = {line["question"]: line["records"] for line in lines[1:]}

    def add(self, question: str, records: dict[str, dict]) -> None:
        self.done[question] = records
        if self.path is None:
            return
        new = not self.path.exists() or self.path.stat().st_size == 0
        with self.path.open("a") as f:
            if new:
                f.write(json.dumps(self.header) + "\n")
            f.write(json.dumps({"question": question, "records": records}) + "\n")


def _item_records(engines: dict, reference: Prefiller, vs: list[Variant], chunks, item: dict, n: int,
                  config: BlendConfig, max_tokens: int) -> dict[str, dict]:
    """One item: the full prefill, then a blend over every variant (a different one first each item)."""
    golds = item.get("answers") or [item.get("answer", "")]
    out = {}
    with torch.inference_mode():
        full = reference.prefill(chunks, item["question"], "full", extra=max_tokens)
        ref_logits = full.logits.float().cpu()
        out["full prefill"] = {"ttft_s": full.timings["prefill"], "top1": 1.0, "kl": 0.0,
                               "f1": best_f1(_answer(reference, full, max_tokens), golds)}
        for v in vs[n % len(vs):] + vs[:n % len(vs)]:
            engine = engines[v]
            start = time.perf_counter()
            pre = engine.prefill(chunks, item["question"], "blend", config, extra=max_tokens)
            ttft = time.perf_counter() - start
            logits = pre.logits.float().cpu()
            out[v.name] = {
                "ttft_s": ttft, "bytes_loaded": pre.bytes_loaded, "rows": pre.chunk_tokens, "token": int(logits.argmax()),
                "recomputed": pre.recomputed_chunk_tokens, "top1": float(top1_agrees(ref_logits, logits)),
                "kl": kl_divergence(ref_logits, logits), "f1": best_f1(_answer(engine, pre, max_tokens), golds)}
            engine.flush_write_back()
    return out


def run_items(runtime: Runtime, env: StoreEnv, items: list[dict], vs: list[Variant], ratio: float = 0.15,
              max_tokens: int = 32, on_item: Callable | None = None,
              log: RecordLog | None = None) -> dict[str, list[dict]]:
    """Per variant, one record per item: ttft_s, bytes_loaded, rows, top1, kl, f1 (and the full prefill's). Items
    the log already holds are taken from it."""
    log = log or RecordLog(None, {})
    engines = {v: Prefiller.open(runtime, env, v.codec, keep=v.keep_config) for v in vs}
    reference = Prefiller.open(runtime, None)
    config = BlendConfig(ratio)
    for n, item in enumerate(items):
        if item["question"] not in log.done:
            chunks = item_chunks(runtime, item)
            log.add(item["question"], _item_records(engines, reference, vs, chunks, item, n, config, max_tokens))
        if on_item is not None:
            on_item(n + 1, len(items))
    names = [v.name for v in vs] + ["full prefill"]
    return {name: [log.done[item["question"]][name] for item in items] for name in names}


def store_bytes(runtime: Runtime, env: StoreEnv, items: list[dict], vs: list[Variant]) -> dict[str, float]:
    """Stored bytes per passage token, per variant, over the items' distinct passages."""
    chunks = dict(c for item in items for c in item_chunks(runtime, item))
    tokens = sum(len(ids) for ids in chunks.values())
    out = {}
    for v in vs:
        table = _table(env, runtime, v)
        out[v.name] = sum(table.record(cid).total_bytes for cid in chunks) / tokens
    return out


def summarize(records: dict[str, list[dict]], per_token: dict[str, float]) -> dict[str, dict]:
    """Means per variant; TTFT as the median per-item ratio to keep 1's in the same codec; against keep 1's blend,
    the share of first tokens it agrees with and the mean KL's ratio (what the reduction alone costs)."""
    out = {}
    for name, rows in records.items():
        codec = name.split(":")[0]
        base = records.get(f"{codec}:full")
        ratios = [r["ttft_s"] / b["ttft_s"] for r, b in zip(rows, base, strict=True)] if base else []
        same = [r["token"] == b["token"] for r, b in zip(rows, base or [], strict=False) if "token" in r and "token" in b]
        out[name] = {"items": len(rows), "top1": float(np.mean([r["top1"] for r in rows])),
                     "kl": float(np.mean([r["kl"] for r in rows])),
                     "f1": float(np.mean([r["f1"] or 0.0 for r in rows])),
                     "ttft_ms_median": 1000 * float(np.median([r["ttft_s"] for r in rows])),
                     "ttft_vs_keep1_median": float(np.median(ratios)) if ratios else None,
                     "load_bytes_mean": float(np.mean([r.get("bytes_loaded", 0) for r in rows])),
                     "store_bytes_per_token": per_token.get(name),
                     "top1_vs_keep1": float(np.mean(same)) if same else None,
                     "kl_vs_keep1": float(np.mean([r["kl"] for r in rows]) / max(1e-12, np.mean([b["kl"] for b in base])))
                     if base else None}
    return out


def run(items: list[dict], store: Path, model: str | None = None, dtype: str | None = None,
        codecs: Sequence[str] = CODECS, rules: Sequence[str] = RULE_NAMES, keeps: Sequence[float] = KEEPS,
        ratio: float = 0.15, max_tokens: int = 32, on_item=None, records: Path | None = None) -> dict:
    runtime = load_runtime(model, dtype)
    vs = variants(codecs, rules, keeps)
    log = RecordLog(records, {"ratio": ratio, "max_tokens": max_tokens, "variants": [v.name for v in vs]})
    with StoreEnv.open(store, create=True) as env:
        t0 = time.perf_counter()
        built = build_store(runtime, env, items, vs)
        build_s = time.perf_counter() - t0
        records = run_items(runtime, env, items, vs, ratio, max_tokens, on_item, log)
        per_token = store_bytes(runtime, env, items, vs)
    return {"items": len(items), "ratio": ratio, "max_tokens": max_tokens, "passages_computed": built,
            "build_s": build_s, "summary": summarize(records, per_token), "records": records}


def markdown(result: dict) -> str:
    lines = ["| variant | store B/token | load KB/prompt | TTFT ms | TTFT / keep 1 | top-1 | KL | F1 | top-1 = keep 1's "
             "| KL / keep 1's |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        per_token = f"{s['store_bytes_per_token']:,.0f}" if s["store_bytes_per_token"] else "-"
        ratio = f"{s['ttft_vs_keep1_median']:.3f}" if s["ttft_vs_keep1_median"] is not None else "-"
        lines.append(f"| {name} | {per_token} | {s['load_bytes_mean'] / 1024:,.0f} | {s['ttft_ms_median']:.0f} | "
                     f"{ratio} | {s['top1']:.2f} | {s['kl']:.4f} | {s['f1']:.3f} | {_cell(s.get('top1_vs_keep1'))} | "
                     f"{_cell(s.get('kl_vs_keep1'))} |")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(result: dict, path: Path) -> Path:
    """Fidelity (first-token KL against the full prefill) against stored bytes per token, a line per (codec, rule)
    over the keeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    summary = result["summary"]
    for codec in CODECS:
        full = summary.get(f"{codec}:full")
        for rule, marker in zip(RULE_NAMES, "osv", strict=True):
            pts = [(s["store_bytes_per_token"], s["kl"]) for n, s in summary.items()
                   if n.startswith(f"{codec}:{rule}@")] + ([(full["store_bytes_per_token"], full["kl"])] if full else [])
            if pts:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, marker=marker, linestyle="-" if codec == "fp16" else "--", label=f"{codec} {rule}")
    ax.set_xlabel("stored bytes per token")
    ax.set_ylabel("first-token KL vs full prefill (mean)")
    ax.set_title(f"Reduced chunks, blend@{result['ratio']:g}, {result['items']} items")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
