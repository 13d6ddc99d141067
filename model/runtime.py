"""Everything needed to run a model: weights, tokenizer, prompt builder, device and dtype."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvrag.config import KVRagConfig
from kvrag.kernels import native as kernel_build
from kvrag.model.device import resolve_device, resolve_triton, set_cpu_threads
from kvrag.model.files import LocalModel, resolve_model
from kvrag.model.names import default_weights
from kvrag.model.prepared import load_weights
from kvrag.model.prompt import PromptBuilder, check_segmentation
from kvrag.model.quant import form_dtype, resolve_weights, torch_ops_wanted
from kvrag.model.transformer import Transformer


@dataclass
class Runtime:
    local: LocalModel
    model: Transformer
    tokenizer: object
    prompts: PromptBuilder
    lead_in: int | None = None  # tokens of corpus text a stored chunk follows (None: the model's own rule)
    keep_prepared: bool = True  # write the weights' compute layout to disk for the next load (model/prepared.py)
    dtype_setting: str | None = None  # `--dtype` as given (auto: each weights form's own, model/device.py)

    @property
    def fingerprint(self) -> str:
        return self.local.fingerprint

    @classmethod
    def load(cls, model: str | None = None, dtype: str | None = None, device: str | None = None,
             tune_process: bool = False, kernels: str | None = None, *, threads: int | None = None,
             keep_freed: bool = True, native: bool = True, weights: str = "dense", lead_in: int | None = None,
             keep_prepared: bool = True, isa: str | None = None) -> Runtime:
        """Resolve (and on first use convert) the model, then load it for compute; None for a setting is its
        default (auto; config.py resolves the environment at the edge). tune_process: also set the process's torch
        threads (`threads`, None: every core) and keep freed memory in the allocator unless `keep_freed` is False
        (device.set_cpu_threads), as the CLI does. kernels: auto or torch (device.resolve_triton). native: kvrag's
        C++ CPU kernels where they serve (False: torch's ops). weights: the layers' matrices dense, int8 or int4, or
        auto (model/quant.py's resolve_weights; the configuration's default, read at the edge). lead_in: what stored
        chunks follow (precompute/lead_in.py; None: the model's rule). keep_prepared: False loads without writing the
        prepared file (a test's one load of a model is not worth gigabytes of cache). isa: the build of kvrag's
        kernels the process runs (kernels/native.py's `use`: auto, avx512, avxvnni, avx2, none; None keeps the
        process's choice); none turns them off as native=False does."""
        if isa is not None:
            native = native and kernel_build.use(isa) != "none"
        if tune_process:
            set_cpu_threads(threads, keep_freed)
        local = resolve_model(model)
        dev = resolve_device(device)
        tokenizer = local.load_tokenizer()
        prompts = PromptBuilder(tokenizer)
        check_segmentation(prompts, local.name)
        form = resolve_weights(weights, dev, native, default_weights(local.name))
        net = load_weights(local, form_dtype(dtype, local.config, form, dev, native), dev, form, keep_prepared,
                           torch_ops_wanted(dev, native))
        net.triton, net.native, net.weights = resolve_triton(kernels, dev), native, form
        return cls(local, net, tokenizer, prompts, lead_in, keep_prepared, dtype)

    @classmethod
    def from_config(cls, config: KVRagConfig) -> Runtime:
        """The model of a resolved configuration (config.py)."""
        return cls.load(config.model, config.dtype, config.device, config.tune_process, config.kernels,
                        threads=config.threads, keep_freed=not config.malloc_defaults, native=config.native,
                        weights=config.weights, lead_in=config.lead_in, isa=config.isa)

    def with_weights(self, form: str) -> Runtime:
        """This model with its layers' matrices in `form` (dense, int8, int4), on the same device and kernels and
        the dtype the same `--dtype` gives that form (auto: dense weights on a CPU without bf16 hardware are float32
        where a quantized form's integer products ran in bf16): itself where it has them."""
        if self.model.weights == form:
            return self
        dev, native = self.model.device, self.model.native
        dtype = form_dtype(self.dtype_setting, self.local.config, form, dev, native)
        net = load_weights(self.local, dtype, dev, form, self.keep_prepared, torch_ops_wanted(dev, native))
        net.triton, net.native, net.weights = self.model.triton, self.model.native, form
        return replace(self, model=net)

    def ids_tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)
