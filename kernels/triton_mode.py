"""Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1, on CPU tensors), asked of Triton itself:
a Triton kernel takes CPU tensors only there."""

from __future__ import annotations


def interpreting() -> bool:
    """True under Triton's interpreter; False where Triton compiles, or is not installed."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)
