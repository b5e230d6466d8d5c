"""LoRA on the GPU (ops.lora; models/ops.py LoRAOps), a part GpuOps builds with --enable-lora over the executor's
GpuShared; the dense ops call it at each projection that names a LoRA site. The adapter slots in the arena, the step's token -> slot map and the LoRA ops as two raw CUDA kernels per
packed projection, vLLM V1's design: lora_shrink.cu (x · A of every slice, q/k/v or gate/up in one
launch, split in K into float32 partials) and lora_expand.cu (the partials summed, · B, scaled, and one
epilogue: added into the projection's bf16 output, into a split-K GEMM's first float32 partial before
its fused reduction, or SiLU·up of the gate_up product with the delta added first). So a step with
adapters keeps the base forward's fused kernels (gemv.cu's norm prologue, the split-K reduction with
the residual add and the next norm) and pays two launches per packed projection — in steps of more than
FUSED_MAX_ROWS rows; smaller steps fold the shrink into the base product (below).

Slots: per site (engine/lora.py) A [max_loras, slices · R, K] and B [max_loras, N, R] bf16, R the
max_lora_rank padded to 8 (zero ranks past an adapter's own), B's rows in the executor's output order
(gate_up interleaved like its weight) with lora_alpha / r folded in. A lives in the rows after the site's
weight (the executor uploads each site's weight into [N + max_loras · slices · R, K]: the model sees the
first N rows), so one product by the extended weight computes the base output and every slot's shrink.
`set_slot` fills one slot, queued on the compute stream behind the steps already launched.

Steps of at most FUSED_MAX_ROWS rows (decode) take that extended product where its extra columns are at
most FUSED_MAX_EXTRA of the site's: q/k/v and gate/up then pay one kernel after the product (lora_expand.cu
reading the shrink from the product's output: the delta added and the columns compacted, or SiLU·up),
o/down none (rms_norm.cu's splitk_rms_norm_residual_lora adds the delta in the split-K reduction that
already adds the residual and applies the next norm). Larger steps run lora_shrink + lora_expand.

Per step (`use`, from the executor's upload): the token -> slot map grouped by slot on the host
(order: the tokens of slot 0, then slot 1, ..., then the rows without an adapter; starts: where each
group begins) into a static device buffer, so the batch keeps its order and a decode graph reads the map
at fixed addresses; the kernels' grids depend on the step's rows alone (padded to the graph's bucket).
A step without adapters sets nothing (`step` None) and its forward takes the dense paths unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.executor.gpu_gemm import interleave_gate_up
from engine.executor.gpu_lora_layout import FUSED_MAX_ROWS, extra_rows, fused_site, padded_rank
from engine.executor.gpu_shared import splitk_norm_threads
from openinfer_kernels.raw_cuda import kernel
from memory.device_arena import Buffer, buffers_nbytes
from memory.streams import PinnedTwins

TILE_TOKENS = 8             # lora_shrink.cu / lora_expand.cu TT
SMALL_TILE_TOKENS = 4       # lora_expand.cu TT in steps of at most FUSED_MAX_ROWS rows (more CTAs, shorter threads)
SHRINK_ROWS = 8             # lora_shrink.cu ROWS
SHRINK_KC_MAX = 1024        # lora_shrink.cu KC_MAX
SHRINK_TARGET_CTAS = 264    # split K until a shrink's grid has about this many CTAs (2 per SM)
EXPAND_COLUMNS = 256        # lora_expand.cu: a thread per output column
EXPAND_ADD, EXPAND_ADD_F32, EXPAND_SWIGLU, EXPAND_COPY = 0, 1, 2, 3      # lora_expand.cu's modes
SPLITK_LORA_THREADS = 1024  # rms_norm.cu LORA_THREADS (compiled per rank, LORA_R = the padded max_lora_rank)


def bf16_bits(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).view(np.uint16)


def group_by_slot(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): the step's tokens grouped by slot, batch order within a group, the tokens without
    an adapter (-1) last; group g's tokens are order[starts[g]:starts[g + 1]], g = num_slots the ones
    without (the kernels' view of the token -> slot map)."""
    key = np.where(token_slots >= 0, token_slots, num_slots)
    order = np.argsort(key, kind="stable")
    starts = np.zeros(num_slots + 2, np.int64)
    starts[1:] = np.cumsum(np.bincount(key, minlength=num_slots + 1))
    return order, starts


def shrink_chunk(k: int, nr: int, rows: int) -> int:
    """lora_shrink.cu's KC for a site of input width k and nr shrunk rows at a step of `rows` rows: 256
    (the most CTAs: a decode step's latency) until the grid reaches SHRINK_TARGET_CTAS, up to KC_MAX."""
    ctas = -(-k // 256) * -(-nr // SHRINK_ROWS) * -(-rows // TILE_TOKENS)
    return 256 * min(SHRINK_KC_MAX // 256, max(1, -(-ctas // SHRINK_TARGET_CTAS)))


def shrink_floats(k: int, nr: int, max_rows: int) -> int:
    """The most float32 partials a site's shrink writes at any step up to max_rows rows."""
    return max(-(-k // shrink_chunk(k, nr, rows)) * rows * nr for rows in range(TILE_TOKENS, max_rows + TILE_TOKENS,
                                                                                  TILE_TOKENS))


def slice_bounds(slices: tuple[int, ...]) -> tuple[int, int]:
    """lora_expand.cu's b1, b2: the output rows where the second and the third slice begin (the
    projection's width where it has fewer slices)."""
    ends = list(np.cumsum(slices)[:-1]) + [sum(slices)] * 2
    return int(ends[0]), int(ends[1])


@dataclass
class GpuLoRAStep:
    """One step's grouped token -> slot map (device views of the static buffer) and its token tiles."""
    order: object           # int32 [max tokens]: the step's rows grouped by slot, those without an adapter last
    starts: object          # int32 [slots + 2]: group g's rows are order[starts[g]:starts[g + 1]]
    token_slots: object     # int32 [max tokens]: each row's slot (-1: none), in batch order
    tiles: int              # ceil(rows / TILE_TOKENS): the kernels' grid.y


class GpuLoRAOps:
    """ops.lora on the GPU: weights, site -> its weight extended with every slot's A rows (the upload); norm: the
    dense ops' rms_norm (a product whose GEMM takes no norm prologue runs it first)."""
    # Threads of the split-K LoRA norm (rms_norm.cu splitk_rms_norm_residual_lora, at most
    # SPLITK_LORA_THREADS): a thread per 8 columns sums the partials, the warps past them compute the delta.
    # 1,024 threads at 64 registers take a whole SM's register file (bench/lora.py --norm-threads compares).
    norm_threads = SPLITK_LORA_THREADS

    def __init__(self, plan, shared, arena, weights: dict, norm):
        """Carve the LoRA slots (A: the rows after each site's weight, zeroed, so the extended product's columns
        of an empty slot are zeros) and load the kernels."""
        bad = [name for name, site in plan.lora_sites if site.k % 8]
        if bad:
            raise ValueError(f"GPU LoRA kernels need input widths % 8 == 0; {bad[0]} has {dict(plan.lora_sites)[bad[0]].k}")
        missing = [name for name, _ in plan.lora_sites if name not in weights]
        if missing:
            raise ValueError(f"LoRA site {missing[0]}: no extended weight from the executor's upload")
        self.shared, self.norm = shared, norm
        b = arena.take_all("lora", self.buffers(plan))
        sites = self.sites = dict(plan.lora_sites)
        self.num_slots, self.rank = plan.options.max_loras, padded_rank(plan.options.max_lora_rank)
        self.w = {name: (weights[name][site.n:].reshape(self.num_slots, len(site.slices) * self.rank, site.k),
                         b[f"{name}.b"]) for name, site in sites.items()}      # site -> (A, B) of every slot
        self.full = {name: weights[name] for name, site in sites.items()
                     if fused_site(site, plan.options)}   # the sites whose small steps take the extended product
        for a, _ in self.w.values():           # an empty slot's shrink columns: zeros, never read
            shared.zero(a)
        self.shrunk, self.map, self.wide = b["shrunk"], b["slot_map"], b["wide"]
        self.hosts = PinnedTwins(self.map.shape, np.int32)      # staging used in turn
        self.step: GpuLoRAStep | None = None    # this step's slot map (None: no adapter in the step)
        self.k_shrink = kernel("lora_shrink", "lora_shrink")
        self.k_expand = kernel("lora_expand", "lora_expand")
        self.k_expand_small = kernel("lora_expand", "lora_expand", TT=SMALL_TILE_TOKENS)
        self.k_rms_splitk = kernel("rms_norm", "splitk_rms_norm_residual_lora", LORA_R=self.rank)

    @staticmethod
    def buffers(plan) -> list[Buffer]:
        """Every site's B slots (A: in the rows after its weight), the shrink's float32 rows, the extended
        products' outputs of small steps and the step's slot maps."""
        if not plan.lora_sites:
            return []
        slots, rank, sites = plan.options.max_loras, padded_rank(plan.options.max_lora_rank), dict(plan.lora_sites)
        out, shapes = [], set()
        for name, site in plan.lora_sites:
            out.append(Buffer(f"{name}.b", (slots, site.n, rank), np.uint16))
            shapes.add((site.k, len(site.slices) * rank))
        partials = max(shrink_floats(k, nr, plan.max_tokens) for k, nr in shapes)
        wide = min(plan.max_tokens, FUSED_MAX_ROWS) * max(site.n + extra_rows(name, sites, plan.options)
                                                          for name, site in plan.lora_sites)
        return out + [Buffer("shrunk", (partials,), np.float32), Buffer("wide", (wide,), np.float32),
                      Buffer("slot_map", (2 * plan.max_tokens + slots + 2,), np.int32)]

    @classmethod
    def nbytes(cls, plan) -> int:
        return buffers_nbytes(cls.buffers(plan))

    def set_slot(self, slot: int, adapter) -> None:
        """Load a LoRA adapter (engine/lora.py LoRAAdapter) into a slot, or empty it (None)."""
        for name, site in self.sites.items():
            a = np.zeros((len(site.slices), self.rank, site.k), np.float32)
            b = np.zeros((site.n, self.rank), np.float32)
            w = None if adapter is None else adapter.sites.get(name)
            if w is not None:
                a[:, :w.a.shape[1]] = w.a
                b[:, :w.b.shape[1]] = w.b
            if name.endswith("gate_up_proj") and self.shared.gate_up_interleaved:
                b = interleave_gate_up(b)
            a_dev, b_dev = self.w[name]
            a_dev[slot].set(bf16_bits(a).reshape(a_dev.shape[1:]), stream=self.shared.stream)
            b_dev[slot].set(bf16_bits(b), stream=self.shared.stream)

    def use(self, token_slots: np.ndarray | None, rows: int) -> None:
        """Before a step's forward: its token -> slot map (-1: no adapter; None: no adapter in the step)
        grouped by slot into the static buffer; rows: the step's rows (a decode graph's bucket)."""
        if token_slots is None:
            self.step = None
            return
        import cupy

        slots = self.num_slots
        tm = (self.map.shape[0] - slots - 2) // 2
        if token_slots.size and int(token_slots.max()) >= slots:
            raise ValueError(f"LoRA slot {int(token_slots.max())} is outside the executor's {slots} (max_loras)")
        if token_slots.size < rows:                 # a graph's padding rows: no adapter
            token_slots = np.concatenate([token_slots, np.full(rows - token_slots.size, -1, token_slots.dtype)])
        h = self.hosts.take()                       # [order (tm) | token slots (tm) | starts]
        order, starts = group_by_slot(token_slots, slots)
        h[:order.size], h[tm:tm + order.size], h[2 * tm:] = order, token_slots, starts
        runtime, dev = cupy.cuda.runtime, self.map
        for at, count in ((0, order.size), (tm, order.size), (2 * tm, slots + 2)):
            runtime.memcpyAsync(dev[at:].data.ptr, h[at:].ctypes.data, count * 4, runtime.memcpyHostToDevice,
                                self.shared.stream.ptr)
        self.hosts.sent(self.shared.stream)
        self.step = GpuLoRAStep(order=dev[:tm], starts=dev[2 * tm:], token_slots=dev[tm:2 * tm],
                                tiles=-(-rows // TILE_TOKENS))

    def on(self, site) -> bool:
        """Whether the step runs adapters and `site` is a LoRA site (a fused op then composes)."""
        return self.step is not None and site in self.w

    def fused(self, site, rows: int) -> bool:
        """Whether this step's product at `site` is by the extended weight (small steps, FUSED_MAX_ROWS)."""
        return self.step is not None and site in self.full and rows <= FUSED_MAX_ROWS

    # ---- small steps: the extended product, the delta in the kernel after it ----------------------
    def _wide(self, rows: int, cols: int, dtype):
        buf = self.wide if dtype == np.float32 else self.wide.view(np.uint16)
        return buf[: rows * cols].reshape(rows, cols)

    def extended_product(self, x, norm_weight, eps, site, normed):
        """x (RMSNorm'd by norm_weight where normed is None) · the extended weightᵀ: [T, N + extra] bf16."""
        full, gemm = self.full[site], self.shared.gemm
        wide = self._wide(x.shape[0], full.shape[0], np.uint16)
        if normed is None and gemm.gemv_serves(x, full):
            gemm.gemv(x, full, wide, "norm", norm_w=norm_weight, eps=eps, pdl=self.shared.pdl)
        else:
            if normed is None:
                normed, _ = self.norm(x, norm_weight, eps)
            gemm(normed, full, wide, pdl=self.shared.pdl)
        return wide

    def attention_rows(self, wide, site) -> tuple:
        """rope_paged_decode_attention_lora's row arguments for the extended q/k/v product `wide`."""
        return wide, np.int32(wide.shape[1]), self.step.token_slots, self.w[site][1]

    def norm_linear(self, x, norm_weight, eps, site, normed=None):
        """The projection of rmsnorm(x) (or ``normed``) with the step's adapters' deltas: the extended
        product, then lora_expand.cu compacting its first N columns with the delta added."""
        wide = self.extended_product(x, norm_weight, eps, site, normed)
        out = self.shared.out(x.shape[0], self.sites[site].n)
        self._expand_wide(wide, site, EXPAND_COPY, out)
        return out

    def norm_swiglu(self, x, norm_weight, eps, site, normed=None):
        """SiLU(gate)·up of the gate_up projection with the deltas added first: the extended product, then
        lora_expand.cu's SiLU·up with the delta."""
        wide = self.extended_product(x, norm_weight, eps, site, normed)
        act = self.shared.out(x.shape[0], self.sites[site].n // 2)
        self._expand_wide(wide, site, EXPAND_SWIGLU, act)
        return act

    def add_linear_norm(self, x, site, residual, norm_weight, eps):
        """(residual + x · Wᵀ + delta, its RMSNorm by norm_weight): the extended product (gemv.cu in
        float32, or the CuTe GEMM's split-K partials, or cuBLAS in float32), then one reduction kernel
        (rms_norm.cu splitk_rms_norm_residual_lora) that adds the delta, the residual and norms."""
        full, (_, b), sh = self.full[site], self.w[site], self.shared
        T, n, ld = x.shape[0], self.sites[site].n, full.shape[0]
        gemv = sh.gemm.gemv_serves(x, full)
        partials = None if gemv else sh.gemm.cute_partials(x, full, residual)
        if partials is not None:
            if tuple(partials.shape[1:]) != (T, ld) or tuple(partials.strides[1:]) != (ld, 1):
                raise ValueError(f"split-K partials {partials.shape} / {partials.strides}: not [S, {T}, {ld}] rows")
            splits, ptr = partials.shape[0], partials.ptr
        else:
            wide = self._wide(T, ld, np.float32)
            if gemv:
                sh.gemm.gemv(x, full, wide, pdl=sh.pdl)
            else:
                sh.gemm(x, full, wide)
            splits, ptr = 1, wide.data.ptr
        out = sh.residual_out(T, n)
        threads = min(self.norm_threads, max(splitk_norm_threads(n), -(-n // 32) * 32))   # a column each
        args = (np.uint64(ptr), np.int32(splits), np.int64(T * ld), np.int32(ld), residual, norm_weight)
        lora_args = (self.step.token_slots, b, np.int32(b.shape[2]))
        normed = sh.out(T, n)
        sh.launch(self.k_rms_splitk, (T,), (threads,), args + (normed, out, np.int32(n), np.float32(eps)) + lora_args)
        return out, normed

    def _expand_wide(self, wide, site, mode, act):
        a, b = self.w[site]
        T, ld = wide.shape
        self._expand(wide, 1, 0, ld, b.shape[1], a.shape[1], site, T, wide, ld, mode, act, chunks=1)

    # ---- larger steps: lora_shrink + lora_expand ---------------------------------------------------
    def add(self, y, x, site, norm=None, into=None):
        """y (the projection's bf16 output [T, N], or ``into``: a float32 [T, N] buffer's address, a
        split-K GEMM's first partial) += the step's adapters' deltas at `site` for x [T, K]; norm:
        (norm_w, eps) where x is the un-normed input of a product that fused its RMSNorm."""
        if not self.on(site):
            return y
        part, chunks = self._shrink(x, site, norm)
        self._expand_part(part, chunks, site, x.shape[0], y if into is None else np.uint64(into),
                          EXPAND_ADD if into is None else EXPAND_ADD_F32)
        return y

    def unfused_swiglu(self, x, norm_weight, eps, gate_up_weight, normed, site):
        """SiLU·up of rmsnorm(x) (or ``normed``) · gate_upᵀ with the deltas: the base product, then the
        shrink and lora_expand.cu's SiLU·up (steps of more than FUSED_MAX_ROWS rows)."""
        sh = self.shared
        gate_up, norm = sh.out(x.shape[0], gate_up_weight.shape[0]), None
        if normed is not None and not normed.flags.c_contiguous:     # the shrink reads contiguous rows
            dense = sh.out(*normed.shape)
            with sh.stream:
                dense[...] = normed
            normed = dense
        if normed is None and sh.gemm.gemv_serves(x, gate_up_weight):
            sh.gemm.gemv(x, gate_up_weight, gate_up, "norm", norm_w=norm_weight, eps=eps, pdl=sh.pdl)
            normed, norm = x, (norm_weight, eps)
        else:
            if normed is None:
                normed, _ = self.norm(x, norm_weight, eps)
            sh.gemm(normed, gate_up_weight, gate_up, pdl=sh.pdl)
        return self.swiglu(gate_up, normed, site, norm)

    def swiglu(self, gate_up, x, site, norm=None):
        """SiLU(gate)·up [T, N/2] of the gate_up product [T, N] with the step's adapters' deltas added
        first (rows without an adapter: plain SiLU·up); x, norm as add's."""
        T, n = gate_up.shape
        act = self.shared.out(T, n // 2)
        part, chunks = self._shrink(x, site, norm)
        self._expand_part(part, chunks, site, T, gate_up, EXPAND_SWIGLU, act)
        return act

    def _shrink(self, x, site, norm):
        step, (a, _) = self.step, self.w[site]
        slots, nr, k = a.shape
        T = x.shape[0]
        kc = shrink_chunk(k, nr, T)
        chunks = -(-k // kc)
        part = self.shrunk[: chunks * T * nr]
        norm_w, eps = norm if norm is not None else (np.uint64(0), 0.0)
        self.shared.launch(self.k_shrink, (chunks * -(-nr // SHRINK_ROWS), step.tiles, slots), (256,),
                           (x, a, step.order, step.starts, part, np.int32(T), np.int32(k), np.int32(nr), np.int32(kc),
                            norm_w, np.float32(eps)))
        return part, chunks

    def _expand_part(self, part, chunks, site, T, y, mode, act=None):
        nr = self.w[site][0].shape[1]
        n = self.w[site][1].shape[1]
        self._expand(part, 0, T * nr, nr, 0, 0, site, T, y, n, mode, act, chunks)

    def _expand(self, src, src_bf16, cstride, ld, soff, sslot, site, T, y, ldy, mode, act, chunks):
        """lora_expand.cu over the step's slot groups (modes 2 and 3: and the rows without an adapter)."""
        step, (a, b) = self.step, self.w[site]
        slots, nr, _ = a.shape
        n, rank = b.shape[1], b.shape[2]
        interleaved = site.endswith("gate_up_proj") and self.shared.gate_up_interleaved
        b1, b2 = slice_bounds(self.sites[site].slices)
        cols = n // 2 if mode == EXPAND_SWIGLU else n
        small = T <= FUSED_MAX_ROWS         # T: the step's rows (a graph's bucket), so the grid is fixed
        k, tiles = (self.k_expand_small, -(-T // SMALL_TILE_TOKENS)) if small else (self.k_expand, step.tiles)
        self.shared.launch(k, (-(-cols // EXPAND_COLUMNS), tiles, slots + (mode >= EXPAND_SWIGLU)), (EXPAND_COLUMNS,),
                           (src, np.int32(src_bf16), np.int64(cstride), np.int32(ld), np.int32(soff), np.int32(sslot), b,
                            step.order, step.starts, y, np.int32(ldy), np.uint64(0) if act is None else act,
                            np.int32(n), np.int32(rank), np.int32(nr), np.int32(chunks), np.int32(b1), np.int32(b2),
                            np.int32(interleaved), np.int32(mode)),
                           shared_mem=TILE_TOKENS * nr * 4)
