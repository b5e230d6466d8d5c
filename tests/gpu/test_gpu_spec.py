"""Speculative decoding on the GPU executor (engine/executor/gpu_verify.py).

* The free-running greedy gate (test_gpu_free_running.py's floor method against transformers float32) with
  speculation on: every path of test_free_running (batch 1, batched, chunked prefill, prefix hits from the device
  and the host tier, preemption), CUDA graphs on and off, on a dense line (piecewise graphs serve its verify
  steps), a MoE line, an MLA line and the Qwen3.5 hybrid (its Gated DeltaNet state holds a verify step's drafts
  out and applies the accepted ones at the next step: gpu_held_drafts.py); a run speculation changes may differ
  from the spec-off run only from a near tie of transformers' float32 on. Drafts come from the spec-off run's own tokens with 30% of them wrong (a
  random model repeats too little for prompt lookup): long acceptances and rejections both run.
* The verify sampling on device logits against engine/sampling.py verify_seq on the same logits: ids exactly,
  logprobs to float32 rounding, for greedy, seeded sampling (the graph tail's kernels), logprobs and penalties
  (the eager sampler), with sequences of several draft counts in one step.
* Start: one GPU takes --speculative-config through EngineHandle (ngram), a Gated DeltaNet line included.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from test_free_running import PATHS
from test_gpu_free_running import assert_floor_gate, gate_line

from engine.batch import SeqStep
from engine.executor.verify_rows import verify_rows
from engine.loader import load_model
from engine.request import SamplingParams
from engine.sampling import sample_row, verify_seq
from engine.speculative import SpeculativeConfig
from harness.executors import new_gpu_executor
from harness.free_running_models import GATE_VOCAB, gate_model_path
from harness.free_running_paths import engine_greedy

pytestmark = pytest.mark.gpu
K = 4
NGRAM = SpeculativeConfig("ngram", K, 1, 3)
SPEC_LINES = ["qwen3_tied", "qwen3_moe", "deepseek_v2", "qwen3_5_text"]


class ReferenceProposer:
    """Drafts from a spec-off run of the same prompt (its tokens after the sequence's), each replaced by a wrong
    one with probability `wrong`, seeded by the prompt and length (the same drafts every run)."""

    def __init__(self, runs, wrong: float, vocab: int):
        self.reference = {tuple(r.prompt): r.prompt + r.tokens for r in runs}
        self.wrong, self.vocab = wrong, vocab

    def propose(self, seqs, limits):
        out = []
        for seq, k in zip(seqs, limits):
            ref = self.reference.get(tuple(seq.token_ids[:seq.prompt_len]), [])
            n = len(seq.token_ids)
            # past a parting from the reference: k drafts all the same (wrong, almost surely), so every step
            # keeps its k + 1 rows whatever was accepted before
            draft = list(ref[n:n + k]) if ref[:n] == list(seq.token_ids) else [0] * k
            rng = random.Random(f"{seq.prompt_len}/{seq.token_ids[:4]}/{n}")
            out.append([(t + 1 + rng.randrange(self.vocab - 1)) % self.vocab if rng.random() < self.wrong else t
                        for t in draft])
        return out


@pytest.fixture(scope="module", params=SPEC_LINES)
def line(request):
    yield from gate_line(request.param, num_speculative_tokens=K)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_gpu_speculative_greedy(line, run, graphs):
    name, model, exact, bf16, prompts, executors = line
    ex = executors[graphs]
    if ex.num_state_slots and run.host_kv_blocks:
        pytest.skip("a line with per-sequence state keeps no prefix cache, hence no host KV tier")
    prompts = prompts[2:4] if run.follow_up else prompts
    off = engine_greedy(ex, model.tokenizer, prompts, run)
    proposer = ReferenceProposer(off.runs, 0.3, ex.vocab_size)
    on = engine_greedy(ex, model.tokenizer, prompts, run, speculation=(NGRAM, proposer))
    assert on.accepted_drafts > 10, on.accepted_drafts
    row = assert_floor_gate(f"spec/{name}/{run.name}/{'graphs' if graphs else 'eager'}", exact, bf16, on)
    assert_divergences_are_ties(exact, off, on, row["tie_tol"], row["hf_bf16_misses"] + 1)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_acceptance_never_changes_the_tokens(line, graphs):
    """Which drafts a step accepts never changes what it emits: every draft wrong (next to nothing accepted) and 30% wrong
    give the same tokens, exactly, as every step has k + 1 rows either way and row j is the plain decode row after
    the drafts before it. A wrong rollback of rejected rows (KV, positions, prefix blocks) breaks it. (On MoE lines
    a (k+1)-row step may round a near tie other than a 1-row decode step does: that parting is the floor gate's.)"""
    name, model, exact, bf16, prompts, executors = line
    ex = executors[graphs]
    off = engine_greedy(ex, model.tokenizer, prompts, PATHS[0])
    runs = {wrong: engine_greedy(ex, model.tokenizer, prompts, PATHS[0],
                                 speculation=(NGRAM, ReferenceProposer(off.runs, wrong, ex.vocab_size)))
            for wrong in (1.0, 0.3)}
    assert runs[1.0].accepted_drafts < runs[0.3].accepted_drafts, {w: r.accepted_drafts for w, r in runs.items()}
    assert [r.tokens for r in runs[1.0].runs] == [r.tokens for r in runs[0.3].runs]


def assert_divergences_are_ties(exact, off, on, tie_tol: float, allowed_flips: int) -> None:
    """Where speculation changes a greedy run, its first differing token must be a near tie of transformers'
    float32 on that prefix (both choices within the floor's tie tolerance of its best), or one of the flips the
    floor gate allows (HF bf16's misses along the same runs + 1). A verify step multiplies k+1 rows per sequence,
    and a MoE line's kernels route those rows through other kernels than a 1-row decode step (cuBLAS + moe_topk
    and the grouped experts, as a batched decode step does): a router's near tie there can move the logits past
    the tie tolerance, which the floor gate counts as it does for batched decoding (measured on an H100,
    2026-12-06: qwen3_moe batch 1, one parting of 0.78 nats, the same with every draft wrong or right). A wrong
    rollback or acceptance parts every run where the oracle has a clear winner, and fails here;
    test_gpu_acceptance_never_changes_the_tokens checks the rollback exactly."""
    clear = []
    for a, b in zip(off.runs, on.runs):
        if a.prompt != b.prompt:        # a follow-up of runs that already parted (that parting was judged)
            continue
        t = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        if t is None:
            assert len(a.tokens) == len(b.tokens), (a.prompt, len(a.tokens), len(b.tokens))
            continue
        step = exact.step(a.prompt + a.tokens[:t])
        gaps = step.gap_to(a.tokens[t]), step.gap_to(b.tokens[t])
        if max(gaps) > tie_tol:
            clear.append((len(a.prompt), t, a.tokens[t], b.tokens[t], gaps, tie_tol))
    assert len(clear) <= allowed_flips, (allowed_flips, clear)


PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
          SamplingParams(temperature=0.8, top_p=0.9, seed=4, logprobs=1),
          SamplingParams(temperature=1.1, top_k=20, min_p=0.02, seed=9)]
PENALTIES = [SamplingParams(temperature=0.7, seed=2, repetition_penalty=1.3, presence_penalty=0.5),
             SamplingParams(temperature=0, frequency_penalty=0.8, logit_bias={3: 4.0})]


def verify_batch(params: list[SamplingParams], logits: np.ndarray, rng: random.Random) -> list[SeqStep]:
    """One SeqStep per params, drafts 0..K long: the row tokens plain decoding would emit, 30% replaced."""
    steps, at = [], 0
    for i, p in enumerate(params):
        k = i % (K + 1)
        history = [rng.randrange(GATE_VOCAB) for _ in range(9)]
        base = SeqStep(seq_id=i, token_ids=[history[-1]], start_pos=8, block_table=[0], sample=True, params=p,
                       prompt_len=6, history=history, num_generated=3)
        drafts = []
        for j in range(k):
            t = sample_row(logits[at + j], base, None, drafts).token_id
            drafts.append(t if rng.random() > 0.3 else (t + 1) % GATE_VOCAB)
        steps.append(SeqStep(seq_id=i, token_ids=[history[-1]] + drafts, start_pos=8, block_table=[0], sample=True,
                             params=p, prompt_len=6, history=history, num_generated=3, num_drafts=k))
        at += k + 1
    return steps


@pytest.mark.parametrize("params", [PARAMS, PENALTIES, PARAMS + PENALTIES], ids=["device", "eager", "mixed"])
def test_gpu_verify_sampling_matches_the_reference(params):
    import cupy

    from engine.executor.gpu_sampler import needs_processing
    model = load_model(gate_model_path("qwen3_tied"))
    ex = new_gpu_executor(model, num_speculative_tokens=K, cuda_graphs=False)
    try:
        rng = random.Random(0)
        params = (params * 6)[:12]                  # 12 sequences, 33 rows: within the executor's 16 and 80
        S = sum(i % (K + 1) + 1 for i in range(len(params)))
        logits = (np.random.default_rng(1).standard_normal((S, GATE_VOCAB)) * 3).astype(np.float32)
        steps = verify_batch(params, logits, rng)
        rows = verify_rows(steps)
        ex.verify.check(len(steps), rows.num_rows)
        device = cupy.asarray(logits)
        if any(map(needs_processing, rows.steps)):
            got = rows.accept(ex.sampler.sample(device, rows.steps, rows.bitmask))
        else:
            greedy = ex.sampler.queue_rows(device, rows.steps, rows.bitmask)
            got = ex.verify.queue(rows, greedy, ex.readback).result().sampled
        at = 0
        for s, token in zip(steps, got):
            want = verify_seq(logits[at:at + 1 + s.num_drafts], s)
            at += 1 + s.num_drafts
            assert [t.token_id for t in token.emitted()] == [t.token_id for t in want.emitted()], s.seq_id
            for a, b in zip(token.emitted(), want.emitted()):
                assert (a.logprob is None) == (b.logprob is None)
                if a.logprob is not None:
                    assert abs(a.logprob - b.logprob) < 1e-4
                    assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    finally:
        ex.close()


def test_engine_handle_serves_ngram_on_one_gpu():
    """Through EngineHandle: a dense line's prompt lookup drafts (its random model repeats the prompt's tokens);
    the Qwen3.5 hybrid starts and serves (its 151k-token random model repeats nothing: no drafts to count; the
    greedy gate above verifies its drafts)."""
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from harness.hybrid_models import hybrid_model_path
    from harness.models import tiny_model_path
    prompt = [5, 6, 7, 8, 9] * 6
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for model in (tiny_model_path("qwen3_tied"), hybrid_model_path("qwen3_5_text")):
        config = EngineConfig(model=model, device="cuda", max_model_len=256, progress=False, num_kv_blocks=64,
                              speculative_config=NGRAM)
        with EngineHandle(config) as h:
            got = h.generate([prompt], params)[0].outputs[0].token_ids
            stats = h.stats()
        assert stats.spec_decode_num_draft_tokens > 0 or "qwen3_5" in model, model
        assert len(got) == 24, model
