"""The `isa` fixture: a kernel test runs once on every build of kvrag's kernels this CPU runs (kernels/native.py),
best first, each against its torch twin, so an AVX-512 machine also tests the AVX2 machines' paths."""

from __future__ import annotations

import pytest

from kvrag.kernels import native

KERNEL_ISAS = list(native.runnable())


@pytest.fixture(params=KERNEL_ISAS or [pytest.param("none", marks=pytest.mark.skip("no kvrag kernel runs here"))])
def isa(request):
    """The test runs with kvrag's kernels of this build (native.use), the process's earlier choice restored after."""
    before = native.isa()
    native.use(request.param)
    yield request.param
    native.use(before)
