"""Executors and drivers shared by the GPU tests and the benchmarks: a small GPU executor for the tiny
models, and a decoder that prefills prompts into disjoint KV blocks, then steps them one token at a time."""
from __future__ import annotations

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
from engine.request import SamplingParams


def new_gpu_executor(model, executor_class=None, **settings):
    """A GpuExecutor for the tiny models; settings: ExecutorOptions / GpuTuning fields (options_of);
    executor_class: a GpuExecutor subclass (bench/ab_switches.py's, with the A/B switches)."""
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of

    args = dict(num_kv_blocks=96, max_model_len=512, max_num_batched_tokens=512, max_num_seqs=16, progress=False)
    return (executor_class or GpuExecutor)(model, options_of(**{**args, **settings}))


def new_parallel_gpu_executor(model, tensor_parallel_size: int = 2, **settings):
    """new_gpu_executor's settings over `tensor_parallel_size` GPUs (engine/parallel: rank 0 here, the
    others in processes on GPUs 1..N-1)."""
    from engine.executor.options import options_of
    from engine.parallel.launch import create_parallel_executor

    args = dict(num_kv_blocks=96, max_model_len=512, max_num_batched_tokens=512, max_num_seqs=16, progress=False)
    options = options_of(**{**args, **settings, "tensor_parallel_size": tensor_parallel_size})
    return create_parallel_executor(model, options, "cuda")


class Decoder:
    """Sequences prefilled (eagerly, greedy) into disjoint KV blocks, then decoded one step at a time."""

    def __init__(self, ex, prompts: list[list[int]], steps: int):
        free = iter(range(ex.num_kv_blocks))
        self.ex, self.prompts, self.toks = ex, prompts, [list(p) for p in prompts]
        self.tables = [[next(free) for _ in range(-(-(len(p) + steps + 1) // BLOCK_SIZE))] for p in prompts]
        out = ex.execute(ModelBatch.build([SeqStep(seq_id=i, token_ids=list(p), start_pos=0, block_table=t,
                                                   sample=True, params=SamplingParams(temperature=0.0), state_slot=i)
                                           for i, (p, t) in enumerate(zip(prompts, self.tables))]))
        for i, t in enumerate(out.sampled):
            self.toks[i].append(t.token_id)

    def batch(self, params: list[SamplingParams]) -> ModelBatch:
        return ModelBatch.build([SeqStep(seq_id=i, token_ids=[t[-1]], start_pos=len(t) - 1, block_table=tb,
                                         sample=True, params=p, prompt_len=len(pr), history=list(t),
                                         num_generated=len(t) - len(pr), state_slot=i)
                                 for i, (t, tb, pr, p) in enumerate(zip(self.toks, self.tables, self.prompts, params))])

    def advance(self, out) -> None:
        for i, t in enumerate(out.sampled):
            self.toks[i].append(t.token_id)
