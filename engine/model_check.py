"""A per-model correctness gate: does blending over stored KV give what a full prefill gives, for this model, dtype
and device?

A new family's rotary, norms or attention that the loader or the blend gets subtly wrong would still answer, only
worse; these checks catch it on a handful of invented prompts (facts no model knows, so the answer must come from the
passages) before the model serves a blended request. Each prompt runs through a Prefiller over no store (every
chunk's KV computed here, kept in memory and reused through the layer loader as stored KV would be):

- `blend_ratio_1`: a blend that recomputes every chunk row must be a full prefill, up to rounding;
- `reuse_at_own_position`: prefix caching (the first chunk's KV reused exactly where it was computed, through the
  loader and its rotation) must be a full prefill too, up to rounding;
- `blend_answers`: on long prompts the model can answer, the cheapest ratio and rule at which the blend keeps full
  prefill's answers (engine/answer_check.py): the model's `auto` starts from that ratio and blends by that rule;
- only where the model answers too few of those prompts for its answers to judge: `blend_default`, a blend at the
  default ratio must mostly keep full prefill's first token and stay close to its next-token distribution, and where
  it fails `blend_query`, the same bounds for the `query` selection rule (ProphetKV).

Bounds, and the figures they were chosen from: docs/model-check.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvrag.blend.config import DEFAULT_RATIO, BlendConfig
from kvrag.config import DEFAULT_SELECTION
from kvrag.engine import answer_check
from kvrag.engine.check_prompts import PROMPTS
from kvrag.engine.prefiller import Prefiller
from kvrag.kernels import native as kernel_build
from kvrag.model.files import model_home
from kvrag.model.prompt import leading_special_ids
from kvrag.model.runtime import Runtime

SCHEMA = "kvrag.model-check/1"
CHECK_VERSION = 9  # bump when the prompts, the bounds or what the blends read change: other versions run again

# Bounds, each set between the rounding measured on correct models and the smallest broken figure seen
# (docs/model-check.md). Ratio 1 and reuse at the chunk's own position differ from a full prefill by rounding alone:
# none in float32 on the CPU; in bf16 other shapes round otherwise per shape and per thread count.
EXACT_BOUND = {"float32": 1e-3, "other": 0.05}
# at the default ratio the first token may move on a close call: one of 5 prompts may move (0.2)
AGREEMENT_BOUND = 0.6  # share of confident prompts whose first token is full prefill's (at least)
# the first token counts only where full prefill chose it clearly (its probability this far above the runner-up's):
# a near tie may flip on rounding alone
CONFIDENT_MARGIN = 0.05
KL_BOUND = 0.15  # nats, mean over prompts (at most), whatever the dtype
# ... and a blend must recover most of what full KV reuse loses on the same prompts (its KL as a share of reuse's;
# a blend no better than reuse is 1 or more). Below KL_FLOOR nothing a reader sees moves.
KL_VS_REUSE_BOUND = 0.6
KL_FLOOR = 0.005
# the rules a blend may run, the cheapest first: the first whose check passes is the one the model blends with
BLEND_RULES = {"blend_default": DEFAULT_SELECTION, "blend_query": "query"}
ANSWERS = "blend_answers"  # the judge of a model that answers the long prompts (engine/answer_check.py)
JUDGES = (*BLEND_RULES, ANSWERS)

@dataclass
class Check:
    """One check: its figures, the bound its main figure is held to, and whether it holds."""

    name: str
    figures: dict[str, object]
    bound: dict[str, float]
    passed: bool

    def failure(self) -> str:
        """The figure that broke its bound, as 'name figure > bound' (for one line on stderr)."""
        if self.name == ANSWERS and "deferred_s" in self.figures:
            return f"{ANSWERS} {self.figures['summary']}"
        if self.name == ANSWERS:
            return f"{ANSWERS}: no ratio below full prefill's cost kept its answers ({self.figures.get('summary')})"
        for key, limit in self.bound.items():
            value, sign = self.figures[key], "<" if key == "top1_agreement" else ">"
            if (value < limit) if sign == "<" else (value > limit):
                return f"{self.name} {key} {value:.3g} {sign} {limit:.3g}"
        return f"{self.name} passed"


@dataclass
class CheckReport:
    model: str  # fingerprint
    dtype: str
    key: dict[str, object]  # what the stored report is keyed by (check_key)
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.failed() is None

    @property
    def rule(self) -> str | None:
        """The selection rule the model blends with: the answers check's choice, else (a model its answers cannot
        judge) the first of BLEND_RULES whose check passed; None: none did, or an exactness check failed, and the
        model is answered with full prefill."""
        if any(not c.passed for c in self.checks if c.name not in JUDGES):
            return None
        answers = self._answers()
        if answers is not None:
            return answers.figures["rule"] if answers.passed else None
        return next((BLEND_RULES[c.name] for c in self.checks if c.name in BLEND_RULES and c.passed), None)

    @property
    def ratio(self) -> float | None:
        """The ratio `auto` starts from for this model: the answers check's choice, else r* (None: full prefill)."""
        if self.rule is None:
            return None
        answers = self._answers()
        return float(answers.figures["ratio"]) if answers is not None else DEFAULT_RATIO

    def _answers(self) -> Check | None:
        return next((c for c in self.checks if c.name == ANSWERS), None)

    @property
    def deferred(self) -> bool:
        """The answers check was put off (a first use over its time budget): answered in full until it runs."""
        answers = self._answers()
        return answers is not None and "deferred_s" in answers.figures

    @property
    def judged_by(self) -> str | None:
        """What chose the blend: 'answers' (long prompts), 'first_token' (short ones), None where no judge ran."""
        if self._answers() is not None:
            return None if self.deferred else "answers"
        return "first_token" if any(c.name in BLEND_RULES for c in self.checks) else None

    def failed(self) -> Check | None:
        """The check that keeps the model from blending: an exactness check, else the blend's judge (when no rule
        passed)."""
        exact = next((c for c in self.checks if c.name not in JUDGES and not c.passed), None)
        if exact is not None or self.rule is not None:
            return exact
        return next(c for c in self.checks if c.name in JUDGES)

    def verdict(self) -> dict:
        """What the report makes run: a blend (its rule, the ratio `auto` starts from, what judged it) or full."""
        return {"passed": self.passed, "mode": "blend" if self.rule else "full", "rule": self.rule,
                "ratio": self.ratio, "judged_by": self.judged_by, "deferred": self.deferred}

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "model": self.model, "dtype": self.dtype, "passed": self.passed, "rule": self.rule,
                "ratio": self.ratio, "judged_by": self.judged_by, "seconds": round(self.seconds, 3), "key": self.key,
                "checks": [{"name": c.name, "passed": c.passed, **c.figures, "bound": c.bound} for c in self.checks]}

    @classmethod
    def from_json(cls, data: dict) -> CheckReport:
        checks = [Check(c["name"], {k: v for k, v in c.items() if k not in ("name", "passed", "bound")},
                        c["bound"], c["passed"]) for c in data["checks"]]
        return cls(data["model"], data["dtype"], data["key"], checks, data.get("seconds", 0.0))


def dtype_name(runtime: Runtime) -> str:
    return str(runtime.model.dtype).removeprefix("torch.")


def check_key(runtime: Runtime) -> dict[str, object]:
    """Everything that changes the numbers the checks see: the model, its dtype, the device's type, the kernels, the
    weights' form, the build of kvrag's kernels (their sums' order is the ISA's) and a lead-in set apart from the
    model's own (KVRAG_LEAD_IN)."""
    m = runtime.model
    return key_for(runtime.fingerprint, dtype_name(runtime), m.device.type, m.triton, m.native,
                   getattr(m, "weights", "dense"), runtime.lead_in, kernel_build.isa() if m.native else None)


def key_for(fingerprint: str, dtype: str, device: str, triton: bool, native: bool, weights: str,
            lead_in: int | None = None, isa: str | None = None) -> dict[str, object]:
    """check_key's fields given one by one (`kvrag model info` reads the stored report without loading the model).
    `lead_in` None: the model's own rule (precompute/lead_in.py), which the fingerprint and version already fix.
    `isa`: the kernels' build; the AVX-512 build (every report before the others existed) and none leave the key as
    it was."""
    return {"version": CHECK_VERSION, "model": fingerprint, "dtype": dtype, "device": device, "triton": bool(triton),
            "native": bool(native), "weights": weights, **({} if lead_in is None else {"lead_in": lead_in}),
            **({} if isa in (None, "avx512", "none") else {"isa": isa})}


def check_model(runtime: Runtime, progress: answer_check.Progress | None = None, answers: bool = True,
                journal: answer_check.Journal | None = None, budget_s: float | None = None) -> CheckReport:
    """Run the exactness checks on PROMPTS and the prompt's start, then (where they hold) the blend's judge: the
    answers on long prompts, or for a model too small to answer them the first-token checks (docs/model-check.md).
    `answers` False: the first-token checks only (a random test model, which cannot answer). `journal`: resume from
    it, saving to it as the check goes; `budget_s`: put the answers check off (a `deferred` report, journaled) where
    it would take longer."""
    start = time.perf_counter()
    journal = journal or answer_check.Journal(None, check_key(runtime))
    # the exactness and first-token checks: no store, each chunk's KV computed once here, reused through the loader
    prefiller = Prefiller(runtime)
    dtype, runs = dtype_name(runtime), None
    if journal.exact:
        checks = [Check(c["name"], c["figures"], c["bound"], c["passed"]) for c in journal.exact]
    else:
        runs = last_logits(runtime, prefiller, EXACT_RUNS, progress)
        exact = EXACT_BOUND["float32" if dtype == "float32" else "other"]
        checks = [_exact_check("blend_ratio_1", runs["full"], runs["blend_ratio_1"], exact),
                  _exact_check("reuse_at_own_position", runs["full"], runs["prefix"], exact), _prompt_start(runtime)]
        journal.exact = [asdict(c) for c in checks]
        journal.save()
    report = CheckReport(runtime.fingerprint, dtype, check_key(runtime), checks)
    # the answers' ladder only where the exact paths hold (minutes on a large model); else, and for a model too small
    # to answer, the first-token checks (seconds) say how far the blend strays
    judge = answers and all(c.passed for c in checks)
    try:
        result = answer_check.judge(runtime, progress, journal, budget_s) if judge else None
    except answer_check.Deferred as put_off:
        summary = f"put off: about {put_off.remaining_s / 60:.0f} min of checking left on this machine"
        checks.append(Check(ANSWERS, {"deferred_s": round(put_off.remaining_s, 1), "summary": summary}, {}, False))
        result = None
    if result is not None and result.judged:
        checks.append(_answers_check(result))
    elif not report.deferred:
        runs = runs or last_logits(runtime, prefiller, {"full": EXACT_RUNS["full"]})
        checks.extend(_first_token_checks(runtime, prefiller, runs))
    report.seconds = time.perf_counter() - start
    return report


def _first_token_checks(runtime: Runtime, prefiller: Prefiller, runs: dict) -> list[Check]:
    """The short prompts' first tokens at r*, the default rule and then `query` (only where the one before failed)."""
    runs = {**runs, **last_logits(runtime, prefiller, FIRST_TOKEN_RUNS)}
    full, checks = runs["full"], []
    reuse_kl = sum(kl_divergence(f, r) for f, r in zip(full, runs["reuse"], strict=True)) / len(full)
    for name, rule in BLEND_RULES.items():
        blended = runs["blend_default"] if rule == DEFAULT_SELECTION else \
            last_logits(runtime, prefiller, {name: ("blend", DEFAULT_RATIO, rule)})[name]
        checks.append(_blend_check(name, full, blended, reuse_kl))
        if checks[-1].passed:
            break
    return checks


def _answers_check(result: answer_check.AnswerResult) -> Check:
    """The answers judge as a check: its choice (rule, ratio) where a rung passed, every rung's figures."""
    chosen, tried = result.choice, result.rungs
    best = max(tried, key=lambda r: (r.kept - r.right, r.agreed - r.items), default=None)
    summary = "no rung below the break-even" if best is None else \
        f"best {best.rule}@{best.ratio:g} kept {best.kept} of {best.right}, agreed on {best.agreed} of {best.items}"
    figures = {**result.figures(), "rule": chosen.rule if chosen else None, "ratio": chosen.ratio if chosen else None,
               "summary": summary}
    bound = {"kept_share": answer_check.KEPT_BOUND, "agreement": answer_check.AGREEMENT_BOUND}
    return Check(ANSWERS, figures, bound, chosen is not None)


def _blend_check(name: str, full: list[torch.Tensor], blended: list[torch.Tensor], reuse_kl: float) -> Check:
    """A blend's first tokens against full prefill's: agreement where full prefill was confident, the KL, and the KL
    as a share of full reuse's."""
    clear = [(f, b) for f, b in zip(full, blended, strict=True) if _margin(f) >= CONFIDENT_MARGIN]
    agree = sum(int(f.argmax() == b.argmax()) for f, b in clear) / len(clear) if clear else 1.0
    kl = sum(kl_divergence(f, b) for f, b in zip(full, blended, strict=True)) / len(full)
    vs_reuse = kl / reuse_kl if reuse_kl > 0 else 0.0
    recovers = kl <= KL_FLOOR or vs_reuse <= KL_VS_REUSE_BOUND
    return Check(name, {"top1_agreement": agree, "confident_prompts": len(clear), "mean_kl": kl,
                        "reuse_kl": reuse_kl, "kl_vs_reuse": vs_reuse},
                 {"top1_agreement": AGREEMENT_BOUND, "mean_kl": KL_BOUND, "kl_vs_reuse": KL_VS_REUSE_BOUND},
                 agree >= AGREEMENT_BOUND and kl <= KL_BOUND and recovers)


def _prompt_start(runtime: Runtime) -> Check:
    """A bare prompt (no chat template) starts with what the tokenizer puts before any text: a base model's BOS, without
    which Gemma repeats the question whatever the passages say. A chat template writes its own start."""
    tokenizer, preamble = runtime.tokenizer, runtime.prompts.preamble_ids
    leading = leading_special_ids(tokenizer)
    missing = 0 if getattr(tokenizer, "chat_template", None) or preamble[:len(leading)] == leading else len(leading)
    return Check("prompt_start", {"missing_leading_tokens": missing}, {"missing_leading_tokens": 0}, missing == 0)


def _margin(logits: torch.Tensor) -> float:
    """logits [V]: the most likely token's probability less the runner-up's."""
    top = torch.softmax(logits.float(), dim=-1).topk(2).values  # [2]
    return float(top[0] - top[1])


# what each check compares with a full prefill: (mode, ratio, selection rule)
EXACT_RUNS = {"full": ("full", DEFAULT_RATIO, DEFAULT_SELECTION), "blend_ratio_1": ("blend", 1.0, DEFAULT_SELECTION),
              "prefix": ("prefix", DEFAULT_RATIO, DEFAULT_SELECTION)}
# the first-token checks' (only where the answers cannot judge: a small model, or exactness failed)
FIRST_TOKEN_RUNS = {"blend_default": ("blend", DEFAULT_RATIO, DEFAULT_SELECTION),
                    "reuse": ("reuse", DEFAULT_RATIO, DEFAULT_SELECTION)}


def last_logits(runtime: Runtime, prefiller: Prefiller, runs: dict,
                progress: answer_check.Progress | None = None) -> dict[str, list[torch.Tensor]]:
    """Per run of `runs` (EXACT_RUNS' form), each prompt's last-position logits [V] (float32, on the CPU)."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    for p, (passages, question) in enumerate(PROMPTS):
        if progress is not None:
            progress(answer_check.EXACTNESS, p, len(PROMPTS))
        chunks = [(f"model-check-{p}-{i}", runtime.prompts.passage_ids(title, text))
                  for i, (title, text) in enumerate(passages)]
        for name, (mode, ratio, rule) in runs.items():
            pre = prefiller.prefill(chunks, question, mode, BlendConfig(ratio=ratio, selection=rule), extra=1)
            out[name].append(pre.logits.float().cpu())
    return out


def _exact_check(name: str, full: list[torch.Tensor], other: list[torch.Tensor], bound: float) -> Check:
    err = max(relative_error(o, f) for f, o in zip(full, other, strict=True))
    return Check(name, {"max_rel_error": err}, {"max_rel_error": bound}, err <= bound)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over a position's logits [V]."""
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the next-token distributions of two logits [V], in nats."""
    ref, other = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((ref.exp() * (ref - other)).sum())


def report_path(runtime: Runtime) -> Path:
    """Where the model's report for this key lives: beside its cached files ($KVRAG_HOME/models/<fingerprint>/)."""
    return path_for(check_key(runtime))


def path_for(key: dict[str, object]) -> Path:
    tag = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=6).hexdigest()
    return model_home(str(key["model"])) / f"model-check-{key['dtype']}-{key['device']}-{tag}.json"


def stored_report(runtime: Runtime) -> CheckReport | None:
    """The report stored for this model and key, or None (none, unreadable, or of another key)."""
    return report_for(check_key(runtime))


def report_for(key: dict[str, object]) -> CheckReport | None:
    """The report stored under `key` (key_for), or None."""
    try:
        data = json.loads(path_for(key).read_text())
        report = CheckReport.from_json(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return report if data.get("schema") == SCHEMA and report.key == key else None


def store_report(runtime: Runtime, report: CheckReport) -> Path:
    """Write the report atomically (a reader sees the old one or the new one)."""
    path = report_path(runtime)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{time.monotonic_ns()}")
    tmp.write_text(json.dumps(report.to_json(), indent=1))
    tmp.replace(path)
    return path


def journal_for(runtime: Runtime) -> answer_check.Journal:
    """The check's journal for this model and key (beside its report): what an interrupted or put-off check did."""
    return answer_check.Journal.load(report_path(runtime).with_suffix(".journal.json"), check_key(runtime))


def run_check(runtime: Runtime, budget_s: float | None = None) -> CheckReport:
    """The checks, resumed from their journal, a progress line on stderr; the report stored (and the journal dropped)
    unless the answers check was put off (`budget_s`)."""
    journal = journal_for(runtime)
    report = check_model(runtime, answer_check.stderr_progress(runtime.local.name), journal=journal,
                         budget_s=budget_s)
    if sys.stderr.isatty():  # the progress line rewrote itself in place: end it
        print(file=sys.stderr, flush=True)
    if not report.deferred:
        try:
            store_report(runtime, report)
            journal.drop()
        except OSError:  # a read-only KVRAG_HOME: the check holds for this process, and runs again next time
            pass
    return report


def cached_check(runtime: Runtime, run: bool = True, budget_s: float | None = None) -> CheckReport | None:
    """The stored report for this model and key; else (run) the checks, run now (run_check) and stored; else None."""
    report = stored_report(runtime)
    if report is None and run:
        report = run_check(runtime, budget_s)
    return report


def blend_verdict(runtime: Runtime, budget_s: float | None = None) -> CheckReport:
    """The first-use gate (api.KVRag): the model's report (its check run and stored now if it never ran for this key;
    put off where its answers check would take longer than `budget_s`), whose `rule` and `ratio` the model blends
    with; where `rule` is None one line on stderr says why, and the caller answers in full."""
    report = cached_check(runtime, budget_s=budget_s)
    failed = report.failed()
    name = runtime.local.name
    if report.deferred:
        print(f"kvrag: {name} is not checked for blending yet: {failed.figures['summary']}, over the first use's "
              f"{budget_s:.0f} s (KVRAG_CHECK_BUDGET): answering with full prefill; `kvrag model check` runs the check "
              "once (it resumes where it stopped)", file=sys.stderr, flush=True)
    elif failed is not None:
        print(f"kvrag: {name} failed the blending check ({failed.failure()}): answering with full "
              "prefill; `kvrag model check` for details", file=sys.stderr, flush=True)
    elif report.rule != DEFAULT_SELECTION or report.ratio != DEFAULT_RATIO:
        print(f"kvrag: {name} blends with the '{report.rule}' selection rule from ratio "
              f"{report.ratio:g}, what its blending check chose (`kvrag model check`)", file=sys.stderr, flush=True)
    return report
