"""Which build of kvrag's kernels runs (kernels/native.py): KVRAG_ISA read once at the edge, a lower build than the
CPU's best on request, one line for a name that is wrong or a build the CPU cannot run, and `none` as torch's paths.
The kernels' own results on each build are tested against their twins in their own files (the `isa` fixture)."""

from __future__ import annotations

import pytest

from kvrag.config import KVRagConfig
from kvrag.errors import KvragError
from kvrag.kernels import native


def test_auto_is_the_best_build_this_cpu_runs_and_names_are_checked(monkeypatch):
    avx2_only = frozenset({"avx2", "fma", "f16c", "sse4_2"})  # a Zen 2 or Zen 3 core's flags, in part
    monkeypatch.setattr(native, "cpu_flags", lambda: avx2_only)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    assert native.runnable() == ("avx2",)
    assert native.resolve_isa("auto") == native.resolve_isa(None) == "avx2"
    assert native.resolve_isa("none") == "none"
    with pytest.raises(KvragError, match="this CPU lacks avx512bw avx512dq avx512f avx512vl"):
        native.resolve_isa("avx512")
    with pytest.raises(KvragError, match="KVRAG_ISA must be auto or one of avx512, avxvnni, avx2, none, got 'sse'"):
        native.resolve_isa("sse")
    monkeypatch.setattr(native, "cpu_flags", lambda: avx2_only | {"avx_vnni"})  # Alder Lake's E and P cores
    assert native.runnable() == ("avxvnni", "avx2")
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert native.runnable() == () and native.resolve_isa("auto") == "none"


def test_the_setting_is_read_at_the_edge():
    assert KVRagConfig.resolve({"KVRAG_ISA": "avx2"}).isa == "avx2"
    assert KVRagConfig.resolve({}).isa == "auto"
    assert KVRagConfig.resolve({"KVRAG_ISA": "avx2"}, isa="none").isa == "none"  # the option over the variable


def test_a_lower_build_is_its_own_library(isa):
    """Each build is compiled apart (its own file, its own flags) and the process's choice picks its entry points."""
    assert native.isa() == isa
    lib = native.library()
    assert lib is not None and f"kvrag-kernels-{isa}-" in lib._name
    assert native.function("kvrag_fp16_to_bf16", None, []) is not native._function("none", "kvrag_fp16_to_bf16", None, ())


def test_none_turns_the_kernels_off_in_the_model(tiny_llama_hd64_dir):
    from kvrag.model.runtime import Runtime

    before = native.isa()
    try:
        rt = Runtime.load(str(tiny_llama_hd64_dir), dtype="float32", device="cpu", isa="none", keep_prepared=False)
        assert rt.model.native is False and native.library() is None
    finally:
        native.use(before)


def test_a_build_the_cpu_cannot_run_is_one_line_from_the_cli(monkeypatch):
    from kvrag.tests.conftest import run_kvrag

    monkeypatch.setenv("KVRAG_ISA", "avx1024")
    result = run_kvrag("model", "info", "--json", check=False)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].endswith("KVRAG_ISA must be auto or one of avx512, avxvnni, avx2, "
                                                           "none, got 'avx1024'")
    assert "Traceback" not in result.stderr
