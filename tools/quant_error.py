"""How far int8 and int4 move each kind of matrix from the checkpoint's float32 values (docs/quantized.md): the
relative error ||dequantized - w|| / ||w|| of one layer's matrices and of the LM head. A GGUF's own blocks come
back exactly where the form matches the block type (a Q4_1 layer in int4, a Q8_0 head in int8).

    python tools/quant_error.py [MODEL] [LAYER]      (MODEL: a `--model` name, default smollm2; LAYER default 3)
"""

import sys

import torch

from kvrag.kernels import quant
from kvrag.model.files import resolve_model
from kvrag.model.transformer import Transformer


def main(model: str | None = None, layer: int = 3) -> None:
    local = resolve_model(model)
    net = Transformer.from_safetensors(local.config, local.weight_files(), torch.float32)
    matrices = {name: getattr(net.layers[layer], name) for name in ("wqkv", "wo", "w_gate_up", "w_down")}
    print(f"{local.name}, layer {layer}: relative error of the dequantized values")
    for name, w in {**matrices, "lm_head": net.lm_head}.items():
        errors = [float((quant.dequantize(quant.Packed.of(w, bits)) - w).norm() / w.norm()) for bits in quant.BITS]
        print(f"{name:>10}: " + "  ".join(f"int{bits} {100 * e:.2f} %" for bits, e in zip(quant.BITS, errors, strict=True)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
