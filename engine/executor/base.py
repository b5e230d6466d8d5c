"""The executor interface: the CPU (numpy) and GPU (CuPy) executors both implement it, with the same
paged KV layout (memory/kv_pool.py), so everything above runs identically on either.

Capabilities are declared, not discovered: `supports_host_tier` says whether `copy_blocks` works
(the host KV tier's slots are allocated from `options.host_kv_blocks`), and `submit` always exists
(an executor that cannot launch asynchronously runs the step and returns it done).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from engine.batch import ModelBatch, StepOutput
from engine.executor.options import ExecutorOptions
from engine.step_budget import StepCost


class PendingStep(Protocol):
    """A launched step; result() waits for it (the step's one sync) and returns its output."""

    def result(self) -> StepOutput:
        ...


@dataclass
class DoneStep:
    """A step that already ran (synchronous executors, eager GPU steps)."""
    output: StepOutput

    def result(self) -> StepOutput:
        return self.output


class Executor(Protocol):
    options: ExecutorOptions    # every setting it was built with (limits the scheduler also obeys)
    num_kv_blocks: int          # size of the paged KV pool, in BLOCK_SIZE-token blocks
    vocab_size: int
    supports_host_tier: bool    # copy_blocks works (host_kv_blocks > 0)
    supports_block_copies: bool  # a step's block_copies are done before it (the scheduler's partial prefix hits)
    kv_block_bytes: int         # bytes one KV block holds (what a host-tier copy of it moves; 0: unknown)
    supports_fed_steps: bool    # submit(batch, fed=True) works (async scheduling)
    last_step_graphed: bool     # the last step replayed a CUDA graph (the step trace's mode)
    last_host_s: float          # host time of the last step up to its launch (0.0: not measured)
    num_state_slots: int        # per-sequence state slots (linear-attention lines; 0: none)
    step_cost: StepCost | None  # a step's modelled time (None: the token budget alone bounds it)
    supports_draft_verify: bool  # steps with draft tokens (SeqStep.num_drafts) are verified: speculative decoding
    rolls_back_state: bool      # a verify step's rejected drafts leave the state slots as if never fed
    supports_eagle3: bool       # attach_eagle3 works: an EAGLE-3 head drafts from the target's hidden states
    supports_mtp: bool          # attach_mtp works: the target's MTP layer (engine/mtp.py) drafts
    supports_device_ngram: bool  # method 'ngram' drafts on the device (gpu_ngram.py), not engine/ngram.py's host lookup
    model_path: str             # the folder the model was loaded from (its MTP layers are read from there)
    world_size: int             # ranks a step runs on (tensor parallelism; 1: this executor alone)
    gemm: object | None         # the GPU executor's linear-layer library (gpu_gemm.py Gemm; None: numpy matmul)
    threads: object | None      # the numpy executor's BLAS threads (cpu_threads.py CpuThreads; None: not numpy)

    def rank0(self) -> Executor:
        """The executor of rank 0's shard: itself (tensor parallelism: the one beside the other ranks)."""
        ...

    @property
    def replay_tokens(self) -> Callable[[int], int] | None:
        """The model line's replay_tokens (engine/models/decoder.py): hit -> the tokens before a prefix hit
        recomputed to rebuild a sequence's state slot; None: a hit cannot rebuild it."""
        ...

    def execute(self, batch: ModelBatch) -> StepOutput:
        """Run one step: write the new tokens' KV, sample where asked. A step with draft tokens samples its
        1 + num_drafts rows (batch.sample_rows) and verifies them as engine/sampling.py verify_seq defines:
        its SampledToken carries the accepted drafts (`accepted`) before the token after them."""
        ...

    def submit(self, batch: ModelBatch, fed: bool = False) -> PendingStep:
        """Launch one step; the caller's host work overlaps it until result(). fed: a step whose
        leading rows' input ids (placeholders -1, ModelBatch.fed_rows) are the sampled ids of the step
        submitted just before it, row for row (async scheduling: it is queued before those ids reach the
        caller); prompts admitted with it follow those rows with their own ids."""
        ...

    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        """float32 logits [T, vocab] for every token of the batch (tests, prompt logprobs)."""
        ...

    def attach_eagle3(self, head) -> object:
        """Keep, on every step from now on, the hidden states the EAGLE-3 head (engine/eagle3.py) reads; returns
        the DraftProposer (engine/ngram.py) running the head over them, with keep(seq_ids) dropping the states
        of the sequences not among seq_ids."""
        ...

    def attach_ngram(self, config) -> object:
        """Where supports_device_ngram: prompt lookup on the device from every step on; its DraftProposer, with
        keep(seq_ids) as attach_eagle3's."""
        ...

    def attach_mtp(self, mtp) -> object:
        """Keep, on every step from now on, the last hidden state the MTP layer (engine/mtp.py) reads; returns its
        DraftProposer, with keep(seq_ids) as attach_eagle3's."""
        ...

    supports_async_copies: bool  # copy_blocks returns a ticket for copies that land on their own time

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]],
                    through: list[tuple[int, int]] = ()) -> object:
        """Host KV tier: offloads (device block -> host slot), then restores (host slot -> device block).
        Returns None where they are ordered before the next step (the default); with
        supports_async_copies, a ticket for copies_done / wait_copies covering the restores and the
        write-through copies `through` (device block -> host slot, blocks the scheduler holds until then):
        the restored blocks may be read, and the written slots restored, only once it is done
        (engine/scheduler.py keeps the sequences LOADING and the blocks held until then)."""
        ...

    def copies_done(self, ticket: object) -> bool:
        """Whether the restores of copy_blocks' ticket have landed (never blocks)."""
        ...

    def wait_copies(self, ticket: object) -> None:
        """Block until the restores of copy_blocks' ticket have landed."""
        ...

    def copy_fence(self) -> Callable[[], None]:
        """Called on the engine thread after copy_blocks: a wait (callable from any thread) that returns
        once the copies queued so far have landed."""
        ...

    def last_gpu_ms(self) -> float | None:
        """Device time of the last step (after its result()), or None where steps are not timed."""
        ...

    def discard_step_times(self) -> None:
        """The steps launched and not yet read failed: their timings are never asked for (last_gpu_ms then
        answers for the next step launched)."""
        ...

    def set_lora(self, slot: int, adapter) -> None:
        """Load a LoRA adapter (engine/lora.py LoRAAdapter) into slot < options.max_loras (None: empty
        it), ordered after the steps already launched and before the next."""
        ...

    def warm_up(self) -> bool:
        """Do one piece of start-up work while the engine is idle; False when there is none left."""
        ...

    def close(self) -> None:
        ...


class ExecutorBase:
    """Defaults for the optional parts of Executor: synchronous submit, no host tier, no step timing,
    nothing to close."""
    supports_host_tier = False
    supports_block_copies = False  # ModelBatch.block_copies refused: the scheduler plans no partial hits
    kv_block_bytes = 0
    supports_fed_steps = False    # async scheduling's fed steps (an asynchronous executor's)
    supports_async_copies = False  # host-tier restores land before the next step (copy_blocks: None)
    last_step_graphed = False     # the last step replayed a CUDA graph
    last_host_s = 0.0             # host time of the last step up to its launch (the GPU executor measures it)
    num_state_slots = 0
    step_cost = None              # a StepCost (engine/step_budget.py): time bounds a step besides its tokens
    supports_draft_verify = False  # a step with draft tokens is refused: no speculative decoding
    rolls_back_state = False      # rejected drafts would advance the state slots: no speculation with state
    supports_eagle3 = False       # no EAGLE-3 head drafts (attach_eagle3)
    supports_mtp = False          # no MTP layer drafts (attach_mtp)
    supports_device_ngram = False  # 'ngram' drafts on the host (engine/ngram.py NgramProposer)
    spec_off_batch_size = None    # drafting's default batch-size limit (speculative.py with_batch_default): none
    world_size = 1
    gemm = None                   # (the GPU executor's Gemm)
    threads = None                # (the numpy executor's CpuThreads)
    options: ExecutorOptions

    def rank0(self) -> ExecutorBase:
        return self

    @property
    def replay_tokens(self) -> Callable[[int], int] | None:
        return self.rank0().model.replay_tokens

    def execute(self, batch: ModelBatch) -> StepOutput:
        raise NotImplementedError

    def submit(self, batch: ModelBatch, fed: bool = False) -> PendingStep:
        if fed:
            raise ValueError(f"{type(self).__name__} takes no fed steps (supports_fed_steps is False)")
        return DoneStep(self.execute(batch))

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        raise RuntimeError(f"{type(self).__name__} has no host KV tier")

    def copy_fence(self) -> Callable[[], None]:
        """Copies that complete inside copy_blocks (the numpy executor's) need no wait."""
        return lambda: None

    def copies_done(self, ticket: object) -> bool:
        return True

    def wait_copies(self, ticket: object) -> None:
        pass

    def set_lora(self, slot: int, adapter) -> None:
        raise RuntimeError(f"{type(self).__name__} has no LoRA slots (options.max_loras = 0)")

    def last_gpu_ms(self) -> float | None:
        """Device time of the last step, where the executor times steps (options.time_steps)."""
        return None

    def discard_step_times(self) -> None:
        pass

    def warm_up(self) -> bool:
        """One piece of warm-up work (a CUDA graph capture); False when nothing is left."""
        return False

    def close(self) -> None:
        pass
