"""GpuPlan: the sizes every GPU part is built for (the executor options, the model's shapes and KV
layout, the device's facts: gpu_device.DeviceInfo).

Each part (GpuOps, GpuSampler, StepInputs, PrefillAttention, Gemm) states its own bytes from a plan
(`nbytes(plan)`) and takes exactly those from the arena; the executor adds them up, gives the
weights theirs, and hands what is left to the KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.executor.gpu_device import DeviceInfo
from engine.executor.options import ExecutorOptions
from engine.executor.gpu_lora_layout import extended_shape
from engine.lora import lora_sites
from engine.model_config import ModelConfig
from engine.models.moe import ExpertShape
from engine.models.ops import MLASpec
from memory.kv_pool import KVLayout, blocks_for

# Logit rows the eager paths compute at once (prompt logprobs and forward_logits go in chunks of it):
# 1024 rows of a 151,936-token vocabulary are 0.6 GB of float32.
LOGIT_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class GpuPlan:
    options: ExecutorOptions
    config: ModelConfig
    device: DeviceInfo
    kv: KVLayout
    width: int              # widest activation row a forward writes (values)
    num_heads: int          # query heads of the widest attention layer
    head_dim: int           # its head dim
    linear_shapes: tuple[tuple[int, int], ...] = ()   # (N, K) of the bf16-output linear weights
    experts: ExpertShape | None = None     # the routed experts' shape (MoE lines; gpu_moe_ops.py)
    mla: MLASpec | None = None             # the latent attention's shape (MLA lines; gpu_mla_ops.py)
    lora_sites: tuple = ()                 # (name, engine.lora.Site) of the LoRA sites (max_loras > 0)
    families: frozenset = frozenset()      # the op families the ops build (the line's op_families, "lora")
    fp8_experts: bool = False              # routed experts kept in FP8 (their activations quantized: gpu_quant_moe.py)

    @property
    def max_tokens(self) -> int:
        return self.options.max_num_batched_tokens

    @property
    def max_seqs(self) -> int:
        return self.options.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self.options.max_model_len

    @property
    def max_blocks(self) -> int:
        """Block-table width: blocks of one max_model_len sequence."""
        return blocks_for(self.max_model_len)

    @property
    def sample_rows(self) -> int:
        """Sampled rows of a step: one per sequence, 1 + k with k draft tokens (speculative decoding), within
        the step's tokens."""
        k = self.options.num_speculative_tokens
        return max(self.max_seqs, min(self.max_tokens, self.max_seqs * (1 + k))) if k else self.max_seqs

    @property
    def logit_rows(self) -> int:
        """Rows of the logits buffer: every sampled row of a step, and chunks of the eager paths."""
        return max(self.sample_rows, min(self.max_tokens, LOGIT_CHUNK_ROWS))

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def vocab(self) -> int:
        return self.config.vocab_size


def gpu_plan(options: ExecutorOptions, model, device: DeviceInfo) -> GpuPlan:
    """The plan of a model line (its kv_layout, activation width, attention specs, op families and, for the
    MoE and MLA lines, expert_shape and MLASpec; its LoRA sites with max_loras) on a device."""
    widest = max(model.attention_specs, key=lambda s: s.num_heads * s.head_dim)
    shapes = sorted({tuple(w.shape) for w in model.weight_specs()     # routers: float32 logits, cuBLAS
                     if len(w.shape) == 2 and w.name not in ("embed_tokens", "lm_head")
                     and not w.name.endswith(".router") and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0})
    mla = model.attention_specs[0] if isinstance(model.attention_specs[0], MLASpec) else None
    lora = tuple(sorted(lora_sites(model).items())) if options.max_loras else ()
    # small LoRA steps multiply by a site's weight extended with every slot's A rows or B columns (gpu_lora_layout.py)
    shapes = sorted(set(shapes) | {extended_shape(name, dict(lora), options) for name, _ in lora})
    families = frozenset(model.op_families) | ({"lora"} if lora else set())
    return GpuPlan(options=options, config=model.config, device=device, kv=model.kv_layout(),
                   width=model.activation_width, num_heads=widest.num_heads, head_dim=widest.head_dim,
                   linear_shapes=tuple(shapes), experts=model.expert_shape, mla=mla, lora_sites=lora,
                   families=families)
