"""`kvrag bench model`: load times, prefill speed (ours vs transformers), bf16 fidelity."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
from rich.table import Table

from kvrag.model.files import resolve_model
from kvrag.model.prefill import extend
from kvrag.model.prompt import PromptBuilder
from kvrag.model.transformer import Transformer


@dataclass
class ModelBenchReport:
    model: str
    fingerprint: str
    threads: int
    prompt_tokens: int
    cold_load_s: float | None = None
    warm_load_s: float = 0.0
    prefill_tokens_per_s: dict[str, float] = field(default_factory=dict)  # "<impl>/<dtype>" -> tok/s
    bf16_items: int = 0
    bf16_top1_agreement: float = 0.0
    bf16_mean_kl: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def best_time(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of fn, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def musique_prompt_ids(builder: PromptBuilder, item: dict) -> list[int]:
    passages = [builder.passage_ids(c["title"], c["text"]) for c in item["ctxs"]]
    return builder.build(passages, item["question"]).flat()


def time_cold_load() -> float:
    """Convert the default GGUF in a throw-away home and time it."""
    saved = os.environ.get("KVRAG_HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["KVRAG_HOME"] = home
        try:
            start = time.perf_counter()
            resolve_model(None)
            return time.perf_counter() - start
        finally:
            if saved is None:
                os.environ.pop("KVRAG_HOME", None)
            else:
                os.environ["KVRAG_HOME"] = saved


def run_model_bench(items: list[dict], model: str | None, fidelity_items: int, cold: bool,
                    repeats: int = 2, with_transformers: bool = True, log=print) -> ModelBenchReport:
    cold_s = time_cold_load() if cold and model is None else None
    start = time.perf_counter()
    local = resolve_model(model)
    tokenizer = local.load_tokenizer()
    weights = {dt: Transformer.from_safetensors(local.config, local.weight_files(), dt)
               for dt in (torch.float32, torch.bfloat16)}
    warm_s = time.perf_counter() - start
    builder = PromptBuilder(tokenizer)
    ids = torch.tensor(musique_prompt_ids(builder, items[0]))
    report = ModelBenchReport(local.name, local.fingerprint, torch.get_num_threads(), int(ids.shape[0]),
                              cold_s, warm_s)

    with torch.inference_mode():
        for dt, m in weights.items():
            name = str(dt).removeprefix("torch.")
            log(f"prefill, ours, {name}")
            extend(m, None, ids[:256])  # warm-up
            report.prefill_tokens_per_s[f"kvrag/{name}"] = ids.shape[0] / best_time(lambda m=m: extend(m, None, ids), repeats)
        if with_transformers:
            from transformers import AutoModelForCausalLM

            for dt in (torch.float32, torch.bfloat16):
                name = str(dt).removeprefix("torch.")
                log(f"prefill, transformers, {name}")
                hf = AutoModelForCausalLM.from_pretrained(str(local.path), dtype=dt).eval()
                hf(ids[None, :256], logits_to_keep=1)
                seconds = best_time(lambda hf=hf: hf(ids[None], logits_to_keep=1, use_cache=False), repeats)
                report.prefill_tokens_per_s[f"transformers/{name}"] = ids.shape[0] / seconds
                del hf

        agree, kls = 0, []
        for i, item in enumerate(items[:fidelity_items]):
            log(f"bf16 fidelity {i + 1}/{fidelity_items}")
            prompt = torch.tensor(musique_prompt_ids(builder, item))
            ref = extend(weights[torch.float32], None, prompt)[0]
            got = extend(weights[torch.bfloat16], None, prompt)[0]
            agree += int(ref.argmax() == got.argmax())
            kls.append(float(torch.sum(ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1)))))
        report.bf16_items = len(kls)
        report.bf16_top1_agreement = agree / max(1, len(kls))
        report.bf16_mean_kl = sum(kls) / max(1, len(kls))
    return report


def table(report: ModelBenchReport) -> Table:
    out = Table(title=f"{report.model} on {report.threads} threads, {report.prompt_tokens}-token prompt")
    out.add_column("measure")
    out.add_column("value", justify="right")
    if report.cold_load_s is not None:
        out.add_row("cold load (GGUF conversion)", f"{report.cold_load_s:.1f} s")
    out.add_row("warm load (cache, fp32 + bf16 weights)", f"{report.warm_load_s:.1f} s")
    for name, tps in report.prefill_tokens_per_s.items():
        out.add_row(f"prefill {name}", f"{tps:,.0f} tok/s")
    out.add_row(f"bf16 vs fp32 top-1 agreement ({report.bf16_items} prompts)", f"{report.bf16_top1_agreement:.0%}")
    out.add_row("bf16 vs fp32 mean first-token KL", f"{report.bf16_mean_kl:.4f}")
    return out
