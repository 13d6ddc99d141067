"""`kvrag model info` and `kvrag model bench`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from kvrag.cli.app import model_app
from kvrag.cli.common import (
    DEVICE_OPTION,
    DTYPE_OPTION,
    JSON_OPTION,
    MODEL_OPTION,
    print_json,
    stderr_console,
)


@model_app.command("info")
def info(model: str = MODEL_OPTION, dtype: str = DTYPE_OPTION, device: str = DEVICE_OPTION,
         as_json: bool = JSON_OPTION) -> None:
    """Resolve the model (converting the default GGUF on first use) and show what will run.

    Example: kvrag model info --json
    """
    from kvrag.blend.device import attention_dtype, resolve_device, resolve_dtype
    from kvrag.blend.model import row_kernel_serves
    from kvrag.blend.model_files import resolve_model
    from kvrag.kernels import row_attention

    local = resolve_model(model)
    dev = resolve_device(device)
    compute_dtype = resolve_dtype(dtype, dev)
    attn_dtype = attention_dtype(compute_dtype, dev)
    attn_name = str(attn_dtype).removeprefix("torch.")
    if row_kernel_serves(local.config.head_dim, attn_dtype, dev):
        pairs = ", Q.K in bf16 pairs" if row_attention.bf16_dot_serves(compute_dtype) else ""
        attention = f"kvrag row kernel (AVX-512, {attn_name}{pairs})"
    else:
        attention = f"SDPA ({attn_name})"
    payload = {
        "name": local.name,
        "path": str(local.path),
        "fingerprint": local.fingerprint,
        "tokenizer_fingerprint": local.tokenizer_fingerprint,
        "device": str(dev),
        "dtype": str(compute_dtype).removeprefix("torch."),
        "attention": attention,
        "config": {k: v for k, v in local.config.__dict__.items() if k != "rope_scaling"},
        "rope_scaling": local.config.rope_scaling.__dict__,
    }
    if as_json:
        print_json(payload)
        return
    table = Table(show_header=False, box=None)
    for key in ("name", "path", "fingerprint", "device", "dtype", "attention"):
        table.add_row(key, str(payload[key]))
    c = local.config
    table.add_row("architecture", f"{c.architecture}: {c.n_layers} layers, {c.n_heads} query heads, "
                                  f"{c.n_kv_heads} KV heads, head dim {c.head_dim}, rope θ {c.rope_theta:g}")
    stderr_console().print(table)


@model_app.command("bench")
def bench(
    dataset: Path = typer.Option(None, "--dataset", help="MuSiQue-format JSON (default ../shared/data/musique_s.json)."),
    items: int = typer.Option(20, "--items", help="Prompts for the bf16-vs-fp32 fidelity check."),
    cold: bool = typer.Option(True, "--cold/--no-cold", help="Also time a conversion from the GGUF."),
    transformers_baseline: bool = typer.Option(True, "--transformers/--no-transformers",
                                               help="Also time transformers' own forward."),
    model: str = MODEL_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Measure model load times, prefill speed (ours vs transformers, fp32 and bf16) and bf16 fidelity.

    Example: kvrag model bench --items 20 --json
    """
    from kvrag.blend.bench.items import read_dataset
    from kvrag.blend.device import set_cpu_threads
    from kvrag.blend.model_bench import run_model_bench

    set_cpu_threads()
    data = read_dataset(dataset)
    console = stderr_console()
    report = run_model_bench(data, model, items, cold, with_transformers=transformers_baseline,
                             log=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    if as_json:
        print_json(report.to_dict())
        return
    table = Table(title=f"{report.model} on {report.threads} threads, {report.prompt_tokens}-token prompt")
    table.add_column("measure")
    table.add_column("value", justify="right")
    if report.cold_load_s is not None:
        table.add_row("cold load (GGUF conversion)", f"{report.cold_load_s:.1f} s")
    table.add_row("warm load (cache, fp32 + bf16 weights)", f"{report.warm_load_s:.1f} s")
    for name, tps in report.prefill_tokens_per_s.items():
        table.add_row(f"prefill {name}", f"{tps:,.0f} tok/s")
    table.add_row(f"bf16 vs fp32 top-1 agreement ({report.bf16_items} prompts)", f"{report.bf16_top1_agreement:.0%}")
    table.add_row("bf16 vs fp32 mean first-token KL", f"{report.bf16_mean_kl:.4f}")
    console.print(table)
