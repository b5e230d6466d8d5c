"""bench/speculative.py's engine runs, on the CPU executor: the oracle proposer's drafts are all accepted and the
output is the no-speculation run's; the ngram run counts its drafts (the GPU run reports these figures)."""
from __future__ import annotations

from bench import speculative as bench
from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from harness.models import tiny_model_path


def test_oracle_and_ngram_runs():
    model = load_model(tiny_model_path("qwen3_tied"))
    ex = CpuExecutor(model, options_of(num_kv_blocks=200, max_model_len=512, max_num_seqs=8,
                                       max_num_batched_tokens=256, num_speculative_tokens=bench.K))
    oracle = bench.oracle_tpot(ex, model.tokenizer, model.config.vocab_size, 12, prompt_len=12)
    assert oracle["acceptance"] == 1.0 and oracle["converged"] and oracle["iterations"] == 1
    assert oracle["parted_from_no_spec_at"] is None         # the numpy executor: a verify row is the decode row
    run = bench.engine_run(ex, model.tokenizer, [[5, 6, 7, 8] * 3, [9, 10] * 5], 8,
                           bench.SpeculativeConfig("ngram", bench.K, 1, 3))
    assert [len(t) for t in run["tokens"]] == [8, 8] and run["draft_tokens"] >= run["accepted"] > 0
