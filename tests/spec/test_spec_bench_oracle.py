"""bench/speculative.py's oracle draft, on the CPU executor: "a draft the target always accepts" holds even where
the no-speculation run is not what the verify step picks. On the GPU a near tie of a random-weight model can round
one way in a 1-row decode step and the other in a k + 1-row verify step; here an executor that flips one decode
step's token stands for it (the numpy verify step is otherwise exact). The drafts must then be the speculation
run's own tokens: every step after the first token drafts k tokens and the verify step accepts all of them."""
from __future__ import annotations

import math

from test_handle_models import loaded

from bench.speculative import K, oracle_tpot
from engine.executor.base import DoneStep
from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of

PROMPT, TOKENS, FLIP_AT = 48, 40, 7         # the no-speculation run's 8th token is the near tie's other side


class DecodeRoundsOtherwise:
    """The executor, but a 1-row decode step that samples the sequence's token at index `at` takes the next id."""

    def __init__(self, executor, at: int):
        self._executor, self.at = executor, at

    def execute(self, batch):
        out = self._executor.execute(batch)
        steps = [s for s in batch.seqs if s.sample]
        for step, token in zip(steps, out.sampled):
            if len(step.token_ids) == 1 and not step.num_drafts and step.start_pos + 1 == self.at:
                token.token_id = (token.token_id + 1) % self._executor.vocab_size
        return out

    def submit(self, batch, fed: bool = False) -> DoneStep:
        assert not fed
        return DoneStep(self.execute(batch))

    def __getattr__(self, name: str):
        return getattr(self._executor, name)


def test_oracle_drafts_what_the_verify_step_picks():
    model = loaded("qwen3_tied")
    cpu = CpuExecutor(model, options_of(max_model_len=256, max_num_seqs=1, max_num_batched_tokens=256))
    ex = DecodeRoundsOtherwise(cpu, PROMPT + FLIP_AT)
    got = oracle_tpot(ex, model.tokenizer, model.config.vocab_size, TOKENS, prompt_len=PROMPT)
    assert got["runs"][0]["parted_at"] == FLIP_AT           # the first run parts from the no-speculation run
    assert got["converged"] and got["iterations"] == 2
    assert got["parted_from_no_spec_at"] == FLIP_AT
    steps = math.ceil((TOKENS - 1) / (K + 1))               # every step emits k drafts and the bonus token
    assert got["steps"] == steps and got["drafted_fraction"] == 1.0 and got["acceptance"] == 1.0
    assert got["tokens_per_step"] == (TOKENS - 1) / steps
