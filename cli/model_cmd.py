"""`kvrag model info`, `kvrag model check`, and `kvrag model bench` as a hidden alias of `kvrag bench model`."""

from __future__ import annotations

import sys

import typer
from rich.table import Table

from kvrag.cli.common import (
    DEVICE_OPTION,
    DTYPE_OPTION,
    JSON_OPTION,
    MODEL_OPTION,
    load_runtime,
    print_json,
    stderr_console,
)
from kvrag.cli.typer_apps import model_app


@model_app.command("info")
def info(model: str = MODEL_OPTION, dtype: str = DTYPE_OPTION, device: str = DEVICE_OPTION,
         as_json: bool = JSON_OPTION) -> None:
    """Resolve the model (converting the default GGUF on first use) and show what will run.

    Example: kvrag model info --json
    """
    from kvrag.kernels import row_attention
    from kvrag.kernels.attention import row_kernel_serves
    from kvrag.model.device import attention_dtype, resolve_device, resolve_dtype
    from kvrag.model.files import resolve_model

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



@model_app.command("check")
def check(model: str = MODEL_OPTION, dtype: str = DTYPE_OPTION, device: str = DEVICE_OPTION,
          as_json: bool = JSON_OPTION) -> None:
    """Check that blending over stored KV gives this model what a full prefill gives, and store the result.

    Runs afresh (a few seconds on SmolLM2): blending at ratio 1 and reusing a chunk's KV where it was computed must
    equal a full prefill up to rounding, and blending at the default ratio must stay close to it. The stored result
    is what `kvrag ask`, `kvrag serve` and the Python API read at first use: a model that fails is answered with full
    prefill. Exit status 1 when a check fails.

    Example: kvrag model check --dtype float32 --json
    """
    from kvrag.engine.model_check import check_model, report_path, store_report

    runtime = load_runtime(model, dtype, device)
    report = check_model(runtime)
    store_report(runtime, report)
    if as_json:
        print_json(report.to_json())
    else:
        table = Table(title=f"{runtime.local.name} ({report.dtype}): blending check, {report.seconds:.1f} s",
                      caption=f"kept in {report_path(runtime)}")
        for column in ("check", "figure", "value", "bound", "passed"):
            table.add_column(column)
        for c in report.checks:
            for key, value in c.figures.items():
                bound = f"{c.bound[key]:.4g}" if key in c.bound else "-"  # a count that qualifies another figure
                table.add_row(c.name, key, f"{value:.4g}", bound, "yes" if c.passed else "NO")
        stderr_console().print(table)
    failed = report.failed()
    if failed is not None:
        print(f"kvrag: {runtime.local.name} failed the blending check ({failed.failure()}); questions are answered "
              "with full prefill", file=sys.stderr)
        raise typer.Exit(1)
