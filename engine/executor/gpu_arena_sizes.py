"""The GPU executor's memory plan, made before anything is carved: every part's arena bytes from the plan (each part
states its own: parts_nbytes), the weights', the LoRA slots' A rows, the state slots' (ArenaSizes), and the arena's
size (arena_bytes): options.gpu_memory_utilization of the device less what the line's eager steps take from CuPy's
pool outside the arena (eager_pool_nbytes), or exactly the parts and num_kv_blocks."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.executor.gpu_dsv4_ops import GpuDSV4Ops
from engine.executor.gpu_gemm import WORKSPACE_BYTES, cute_rows, cute_workspace_bytes
from engine.executor.gpu_inputs import StepInputs
from engine.executor.gpu_lora_layout import extra_rows
from engine.executor.gpu_ops import GpuOps
from engine.executor.gpu_plan import GpuPlan
from engine.executor.gpu_prefill import PrefillAttention, prefill_min_query
from engine.executor.gpu_quant_ops import device_nbytes
from engine.executor.gpu_sampler import GpuSampler
from engine.executor.gpu_verify import GpuVerify
from engine.loader import LoadedModel
from engine.models.rope import rope_inv_freq
from memory.device_arena import arena_budget, buffers_nbytes
from memory.state_slots import state_buffers

log = logging.getLogger(__name__)
SLACK_BYTES = 64 << 20


def parts_nbytes(plan: GpuPlan, cute_max_m: int, prefill_on: bool, ops=GpuOps) -> dict[str, int]:
    """Every part's arena bytes (the KV pool and the weights aside); ops: the executor's ops class."""
    return {"ops": ops.nbytes(plan), "sampler": GpuSampler.nbytes(plan), "inputs": StepInputs.nbytes(plan),
            "gemm": WORKSPACE_BYTES + cute_workspace_bytes(plan, cute_max_m),
            "prefill": PrefillAttention.nbytes(plan) if prefill_on else 0,
            "verify": GpuVerify.nbytes(plan) if plan.options.num_speculative_tokens else 0}


@dataclass
class ArenaSizes:
    """What the executor carves: every part's bytes (parts_nbytes, the rope table, the state slots), the weights'
    and the LoRA slots' A rows after each site's weight (gpu_lora_layout.py)."""
    parts: dict[str, int]
    weights: int
    lora_rows: dict[str, int]           # site -> rows after its weight
    lora_bytes: int
    cute_max_m: int                     # the CuTe GEMM's row limit (gpu_gemm.cute_rows)
    prefill_min: int | None             # the CuTe prefill attention's min query (None: paged kernel only)
    state: object                       # the line's StateLayout (None: no per-sequence state)
    num_state_slots: int                # one per max_num_seqs where the line keeps state, else 0


def arena_sizes(plan: GpuPlan, model: LoadedModel, ops_class=GpuOps) -> ArenaSizes:
    """Every part's bytes from the plan (before anything is carved); the rope table is computed here."""
    options, tuning, config = plan.options, plan.options.gpu, model.config
    # the CuTe prefill attention reads K and V planes: none for a latent (one-plane) KV layout
    prefill_min = prefill_min_query(tuning.prefill_attention, config.head_dim) if plan.kv.planes == 2 else None
    cute_max_m = cute_rows(tuning.gemm)
    parts = parts_nbytes(plan, cute_max_m, prefill_min is not None, ops_class)
    parts["rope"] = rope_inv_freq(config, model.model.rope_dim)[0].nbytes
    state = model.model.state_layout()          # linear-attention lines: one state slot per sequence
    slots = options.max_num_seqs if state is not None else 0
    if state is not None:
        parts["state"] = buffers_nbytes(state_buffers(state, slots))
    sites = dict(plan.lora_sites)           # every slot's A rows (gpu_lora_layout.py)
    lora_rows = {name: extra_rows(name, sites, options) for name in sites}
    return ArenaSizes(parts=parts, weights=sum(device_nbytes(a) for a in model.weights.values()),
                      lora_rows=lora_rows, lora_bytes=sum(lora_rows[name] * site.k * 2 for name, site in sites.items()),
                      cute_max_m=cute_max_m, prefill_min=prefill_min, state=state, num_state_slots=slots)


def eager_pool_nbytes(plan: GpuPlan) -> int:
    """Bytes the line's eager steps take from CuPy's pool (outside the arena) at their largest: DeepSeek-V4's
    float32 attention and hyper-connections (GpuDSV4Ops.pool_nbytes); every other family works in the arena."""
    return GpuDSV4Ops.pool_nbytes(plan) if "dsv4" in plan.families else 0


def arena_bytes(sizes: ArenaSizes, plan: GpuPlan, kv_itemsize: int) -> int:
    """The arena: options.gpu_memory_utilization of the device less the eager steps' pool (eager_pool_nbytes), or
    exactly the parts and num_kv_blocks."""
    options = plan.options
    if options.num_kv_blocks is not None:
        return (sizes.weights + sizes.lora_bytes + sum(sizes.parts.values())
                + options.num_kv_blocks * plan.kv.block_bytes(kv_itemsize) + SLACK_BYTES)
    pool = eager_pool_nbytes(plan)
    budget = arena_budget(options.gpu_memory_utilization) - pool
    if pool:
        log.info("%.1f GiB left outside the arena for the eager steps' temporaries (%d tokens a step)",
                 pool / 2**30, plan.max_tokens)
    if budget <= sizes.weights:
        raise MemoryError(f"the weights ({sizes.weights / 2**30:.1f} GiB) and the eager steps' temporaries "
                          f"({pool / 2**30:.1f} GiB) leave no room: raise gpu_memory_utilization or lower "
                          "max_num_batched_tokens")
    return budget
