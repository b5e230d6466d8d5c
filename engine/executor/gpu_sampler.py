"""The GPU sampler: engine/sampling.py's semantics on device logits, only token ids (and the
asked-for logprobs) come back to the host.

Per step: argmax + logsumexp of the raw logits (every row; greedy rows are done there; up to
ARGMAX_SPLIT_ROWS rows with ARGMAX_CHUNKS CTAs per row); rows with logit_bias / min_tokens /
penalties get a processed copy (apply_penalties over a per-row list of distinct tokens the host
builds); greedy processed rows take the argmax of that copy; sampling rows go through
sample_filtered with the uniform u of default_rng([seed, step]) exactly as the reference draws it
(seeded_uniforms derives it on the device from the seed and step, the same bits; the host draws it
for seeds beyond 32 bits). Logprobs are of the raw distribution (token_logprob, topk_logprobs).

`sample` runs eagerly and syncs. Decode graphs capture the same kernels (`graph_tail`) over every
row of their bucket, reading per-row parameters from a static device block that `fill_graph_rows`
uploads before each replay (greedy and padded rows: temperature 0, which sample_filtered skips).

Structured output: rows with a grammar (SeqStep.grammar) sample from a masked copy of their logits
(`mask_logits`: the grammar's token bitmask, computed on the host by engine/grammar.py and uploaded
from pinned memory; rows without one are copied as they are); logprobs stay those of the raw
logits. A decode step with such rows replays the greedy graph (the forward and the raw argmax) and
`masked_tail` computes the masks on the host while the graph runs, then queues the mask, a greedy
argmax and the sampling kernels over the masked copy: no sync, the step returns through the readback.
"""
from __future__ import annotations

import numpy as np

from engine.batch import SampledToken, SeqStep
from engine.grammar import allowed_tokens, only_stop_tokens, step_bitmask
from openinfer_kernels.raw_cuda import kernel
from memory.device_arena import Buffer, buffers_nbytes
from memory.streams import pinned_array

MAX_TOP_LOGPROBS = 20
PENALTY_ENTRIES = 1 << 20
ARGMAX_SPLIT_ROWS = 32      # steps of at most this many rows (a decode-graph bucket) split each row ...
ARGMAX_CHUNKS = 64          # ... over this many CTAs (argmax_logprob_split)
# The graph's per-row parameter block, field-major (float64 first for alignment): name, dtype.
GRAPH_FIELDS = (("uniform", np.float64), ("temperature", np.float32), ("min_p", np.float32),
                ("top_p", np.float32), ("top_k", np.int32), ("logprobs", np.int32), ("seed", np.uint32),
                ("step", np.uint32))
GRAPH_ROW_BYTES = sum(np.dtype(t).itemsize for _, t in GRAPH_FIELDS)


def needs_processing(s: SeqStep) -> bool:
    p = s.params
    return bool(p.logit_bias) or (s.num_generated < p.min_tokens and bool(p.stop_token_ids)) or \
        (p.repetition_penalty != 1.0 and bool(s.history)) or \
        (bool(p.frequency_penalty or p.presence_penalty) and len(s.history) > s.prompt_len)


def penalty_entries(s: SeqStep, vocab: int, min_tokens_yield: bool = False):
    """Distinct tokens touched by steps 1-3 of the reference: (token, bias, flags, output count).
    min_tokens_yield: the row's grammar allows only stop tokens, so min_tokens masks nothing."""
    p = s.params
    entries: dict[int, list] = {}

    def entry(t: int) -> list:
        return entries.setdefault(t, [0.0, 0, 0])

    for t, b in p.logit_bias.items():
        if 0 <= int(t) < vocab:
            entry(int(t))[0] += float(b)
    if s.num_generated < p.min_tokens and not min_tokens_yield:
        for t in p.stop_token_ids:
            if 0 <= t < vocab:
                entry(t)[1] |= 1
    if p.repetition_penalty != 1.0:
        for t in set(s.history):
            if 0 <= t < vocab:
                entry(t)[1] |= 2
    if p.frequency_penalty or p.presence_penalty:
        ids, counts = np.unique(np.asarray(s.history[s.prompt_len:], dtype=np.int64), return_counts=True)
        for t, c in zip(ids.tolist(), counts.tolist()):
            if t < vocab:
                entry(t)[2] = c
    return entries


def uniform_for(s: SeqStep) -> float:
    seed = 0 if s.params.seed is None else s.params.seed
    return float(np.random.default_rng([seed, s.num_generated]).random())


def seeded_rows(seqs: list[SeqStep]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uniform float64, seed uint32, step uint32) per row for the seeded_uniforms kernel: where seed
    and step fit 32 bits the uniform is -1 and the device derives default_rng([seed, step]).random()
    (sampling.cu, the same bits); elsewhere the host draws it (uniform_for)."""
    seeds = [0 if s.params.seed is None else s.params.seed for s in seqs]
    steps = [s.num_generated for s in seqs]
    uniform = np.full(len(seqs), -1.0)
    for i, (seed, step) in enumerate(zip(seeds, steps)):
        if not (0 <= seed < 1 << 32 and 0 <= step < 1 << 32):
            uniform[i], seeds[i], steps[i] = uniform_for(seqs[i]), 0, 0
    return uniform, np.asarray(seeds, np.uint32), np.asarray(steps, np.uint32)


def pack_graph_rows(host: dict[str, np.ndarray], seqs: list[SeqStep], rows: int) -> None:
    """Fill the GRAPH_FIELDS arrays' first `rows` entries: seqs' parameters (seeded_rows of the
    sampling rows, zeros for greedy ones; logprobs None -> 0), then padded rows, all zero."""
    n = len(seqs)
    ps = [s.params for s in seqs]
    host["temperature"][:n] = [p.temperature for p in ps]
    host["min_p"][:n] = [p.min_p for p in ps]
    host["top_p"][:n] = [p.top_p for p in ps]
    host["top_k"][:n] = [p.top_k for p in ps]
    host["logprobs"][:n] = [p.logprobs or 0 for p in ps]
    sampled = [i for i, p in enumerate(ps) if not p.greedy]
    for name in ("uniform", "seed", "step"):
        host[name][:n] = 0
    if sampled:
        host["uniform"][sampled], host["seed"][sampled], host["step"][sampled] = \
            seeded_rows([seqs[i] for i in sampled])
    for name, _ in GRAPH_FIELDS:
        host[name][n:rows] = 0


class GpuSampler:
    def __init__(self, arena, max_rows: int, vocab: int, stream):
        import cupy

        self.cp, self.stream, self.vocab, self.max_rows = cupy, stream, vocab, max_rows
        b = arena.take_all("sampler", self.buffers(max_rows, vocab))
        self.ids, self.logprob, self.lse = b["ids"], b["logprob"], b["lse"]
        self.top_ids, self.top_lp = b["top_ids"], b["top_lp"]
        self.processed, self.probs, self.rows = b["processed"], b["probs"], b["rows"]
        self.params_f = b["params_f"]           # temp, min_p, top_p, -, rep, freq, pres
        self.uniform, self.seed_step, self.top_k, self.row_ptr = b["uniform"], b["seed_step"], b["top_k"], b["row_ptr"]
        self.pen_i, self.pen_bias = b["pen_i"], b["pen_bias"]   # pen_i: token, flags, count
        self.part_v, self.part_i, self.part_s = b["argmax_part_v"], b["argmax_part_i"], b["argmax_part_s"]
        self.tickets = b["argmax_tickets"]
        # Grammar bitmasks: [max_rows, words] and a per-row flag, uploaded from one of two pinned twins.
        self.words = self.mask_words(vocab)
        self.bitmask, self.mask_flags = b["bitmask"], b["mask_flags"]
        self.mask_hosts = [pinned_array((max_rows, self.words), np.int32) for _ in range(2)]
        self.flag_hosts = [pinned_array((max_rows,), np.int32) for _ in range(2)]
        self.mask_turn = 0
        # argmax_logprob_split's ticket counters start at zero; the kernel leaves them so.
        cupy.cuda.runtime.memsetAsync(self.tickets.data.ptr, 0, self.tickets.nbytes, stream.ptr)
        # The decode graphs' per-row parameters: one device block, uploaded from one of two pinned twins
        # in turn (a step may be queued while the one before still waits for its upload).
        self.graph_block = b["graph_rows"]
        self.graph_block_hosts = [pinned_array((max_rows * GRAPH_ROW_BYTES,), np.uint8) for _ in range(2)]
        self.graph_rows, self.graph_rows_hosts, at = {}, [{}, {}], 0
        for name, dtype in GRAPH_FIELDS:
            n = max_rows * np.dtype(dtype).itemsize
            self.graph_rows[name] = cupy.ndarray((max_rows,), dtype, memptr=self.graph_block.data + at)
            for host, rows_host in zip(self.graph_block_hosts, self.graph_rows_hosts):
                rows_host[name] = host[at:at + n].view(dtype)
            at += n
        self.graph_turn = 0
        self.k_argmax = kernel("argmax_logprobs", "argmax_logprob")
        self.k_argmax_split = kernel("argmax_logprobs", "argmax_logprob_split")
        self.k_token_lp = kernel("argmax_logprobs", "token_logprob")
        self.k_topk = kernel("argmax_logprobs", "topk_logprobs")
        self.k_topk_each = kernel("argmax_logprobs", "topk_logprobs_each")
        self.k_penalties = kernel("sampling", "apply_penalties")
        self.k_sample = kernel("sampling", "sample_filtered")
        self.k_uniforms = kernel("sampling", "seeded_uniforms")
        self.k_mask = kernel("sampling", "mask_logits")

    @staticmethod
    def buffers(max_rows: int, vocab: int) -> list[Buffer]:
        split = ARGMAX_SPLIT_ROWS * ARGMAX_CHUNKS
        return [Buffer("ids", (max_rows,), np.int32), Buffer("logprob", (max_rows,), np.float32),
                Buffer("lse", (max_rows,), np.float32),
                Buffer("top_ids", (max_rows, MAX_TOP_LOGPROBS), np.int32),
                Buffer("top_lp", (max_rows, MAX_TOP_LOGPROBS), np.float32),
                Buffer("processed", (max_rows, vocab), np.float32), Buffer("probs", (max_rows, vocab), np.float32),
                Buffer("rows", (max_rows,), np.int32), Buffer("params_f", (7, max_rows), np.float32),
                Buffer("uniform", (max_rows,), np.float64), Buffer("seed_step", (2, max_rows), np.uint32),
                Buffer("top_k", (max_rows,), np.int32), Buffer("row_ptr", (max_rows + 1,), np.int32),
                Buffer("pen_i", (3, PENALTY_ENTRIES), np.int32), Buffer("pen_bias", (PENALTY_ENTRIES,), np.float32),
                Buffer("argmax_part_v", (split,), np.float32), Buffer("argmax_part_i", (split,), np.int32),
                Buffer("argmax_part_s", (split,), np.float32), Buffer("argmax_tickets", (ARGMAX_SPLIT_ROWS,), np.uint32),
                Buffer("graph_rows", (max_rows * GRAPH_ROW_BYTES,), np.uint8),
                Buffer("bitmask", (max_rows, GpuSampler.mask_words(vocab)), np.int32),
                Buffer("mask_flags", (max_rows,), np.int32)]

    @staticmethod
    def mask_words(vocab: int) -> int:
        return -(-vocab // 32)

    @classmethod
    def nbytes(cls, plan) -> int:
        """A row per sampled row of a step (plan.sample_rows), over the vocabulary."""
        return buffers_nbytes(cls.buffers(plan.sample_rows, plan.vocab))

    def argmax(self, logits, S: int) -> None:
        """ids[:S] = the argmax of each raw logits row, lse[:S] = its logsumexp. Up to
        ARGMAX_SPLIT_ROWS rows (a bucket boundary: a decode graph's bucket is within it exactly when
        its batch is, so a graph and the eager sampler on the same rows run the same kernel and get
        the same bits), each row is split over ARGMAX_CHUNKS CTAs; the ids are the same either way."""
        V, null = np.int32(self.vocab), np.uint64(0)
        if S <= ARGMAX_SPLIT_ROWS:
            self.k_argmax_split((ARGMAX_CHUNKS, S), (256,), (logits, V, self.ids, null, self.lse, self.part_v,
                                                            self.part_i, self.part_s, self.tickets), stream=self.stream)
        else:
            self.k_argmax((S,), (1024,), (logits, V, null, self.ids, null, self.lse), stream=self.stream)

    def fill_graph_rows(self, seqs: list[SeqStep], rows: int) -> None:
        """Upload the per-row parameters a decode graph's sampling tail reads, for `rows` rows (the
        bucket): seqs first, then padded rows (temperature 0, no logprobs), which sample nothing."""
        if rows > self.max_rows:
            raise ValueError(f"{rows} graph rows exceed the sampler's {self.max_rows}")
        self.graph_turn ^= 1
        pack_graph_rows(self.graph_rows_hosts[self.graph_turn], seqs, rows)
        self.cp.cuda.runtime.memcpyAsync(self.graph_block.data.ptr, self.graph_block_hosts[self.graph_turn].ctypes.data,
                                         self.graph_block.nbytes, self.cp.cuda.runtime.memcpyHostToDevice,
                                         self.stream.ptr)

    def graph_tail(self, logits, rows: int) -> None:
        """The sampling a decode graph captures over all `rows` rows of its bucket, reading what
        fill_graph_rows uploaded: the kernels `sample` launches for the same rows (so the same ids
        and logprobs), greedy rows left at their argmax, top logprobs in rows of MAX_TOP_LOGPROBS."""
        self.argmax(logits, rows)
        self._sample_rows(logits, logits, rows)

    def upload_masks(self, seqs: list[SeqStep], bitmask=None) -> dict[int, np.ndarray]:
        """The grammar rows' bitmasks (llguidance, on the host: the step's one mask computation) into
        the device bitmask, flags 1 for them and 0 for the other rows; {row: its bitmask row}. bitmask:
        (rows, their masks) computed already (a verify step's, verify_rows.py)."""
        rows, masks = bitmask if bitmask is not None else step_bitmask([s.grammar for s in seqs])
        if not rows:
            return {}
        n, w = len(seqs), min(self.words, masks.shape[1])
        self.mask_turn ^= 1
        host, flags = self.mask_hosts[self.mask_turn], self.flag_hosts[self.mask_turn]
        host[rows, :w] = masks[:, :w]
        host[rows, w:] = 0
        flags[:n] = 0
        flags[rows] = 1
        last = rows[-1] + 1
        copy, h2d = self.cp.cuda.runtime.memcpyAsync, self.cp.cuda.runtime.memcpyHostToDevice
        copy(self.bitmask.data.ptr, host.ctypes.data, last * self.words * 4, h2d, self.stream.ptr)
        copy(self.mask_flags.data.ptr, flags.ctypes.data, n * 4, h2d, self.stream.ptr)
        return dict(zip(rows, masks))

    def mask(self, logits, out, n: int) -> None:
        """out[:n] = logits[:n] with each flagged row's grammar mask applied (out may be logits)."""
        chunks = min(64, -(-self.vocab // 4096))
        self._launch(self.k_mask, (chunks, n), (256,), (logits, out, np.int32(self.vocab), self.bitmask,
                                                       np.int32(self.words), self.mask_flags))

    def masked_tail(self, logits, seqs: list[SeqStep], bitmask=None) -> None:
        """A decode step with grammar rows, after the greedy graph (ids and lse of the raw logits):
        the masks (computed here, while the graph runs, unless given: upload_masks), the masked copy, its
        greedy argmax, then graph_tail's sampling and logprob kernels over it, for the step's rows."""
        n, V, null = len(seqs), np.int32(self.vocab), np.uint64(0)
        self.fill_graph_rows(seqs, n)
        self.upload_masks(seqs, bitmask)
        self.mask(logits, self.processed, n)
        self._launch(self.k_argmax, (n,), (1024,), (self.processed, V, null, self.ids, null, null))
        self._sample_rows(logits, self.processed, n)

    def _sample_rows(self, logits, source, rows: int) -> None:
        """graph_tail after the argmax: sample `source` where a row's temperature is > 0, logprobs of
        the raw `logits`."""
        g, V = self.graph_rows, np.int32(self.vocab)
        self._launch(self.k_uniforms, (-(-rows // 128),), (128,),
                     (g["seed"], g["step"], g["uniform"], np.int32(rows)))
        self._launch(self.k_sample, (rows,), (1024,), (source, V, np.uint64(0), self.probs, g["temperature"],
                                                       g["min_p"], g["top_k"], g["top_p"], g["uniform"], self.ids))
        self._launch(self.k_token_lp, (-(-rows // 128),), (128,), (logits, V, self.ids, self.lse, self.logprob,
                                                                   np.int32(rows)))
        self._launch(self.k_topk_each, (rows,), (1024,), (logits, V, np.int32(MAX_TOP_LOGPROBS), g["logprobs"],
                                                          self.lse, self.top_ids, self.top_lp))

    def _launch(self, k, grid, block, args) -> None:
        k(grid, block, args, stream=self.stream)

    def _up(self, dev, host: np.ndarray) -> None:
        dev[: host.shape[0]].set(np.ascontiguousarray(host, dtype=dev.dtype), stream=self.stream)

    def queue_rows(self, logits, seqs: list[SeqStep], bitmask=None) -> bool:
        """The kernels of rows that need no logit processing, queued with no sync (their results in this
        sampler's buffers, row i for seqs[i]): grammar rows the masked tail, all-greedy rows without logprobs
        the argmax alone (returns True: only the ids are asked), else graph_tail's sampling."""
        n = len(seqs)
        self.argmax(logits, n)
        if any(s.grammar is not None for s in seqs):
            self.masked_tail(logits, seqs, bitmask)
            return False
        if all(s.params.greedy and s.params.logprobs is None for s in seqs):
            return True
        self.fill_graph_rows(seqs, n)
        self._sample_rows(logits, logits, n)
        return False

    def sample(self, logits, seqs: list[SeqStep], bitmask=None) -> list[SampledToken]:
        """logits: device float32 [S, V] (row i for seqs[i]); bitmask: the grammar rows' masks when computed
        already (upload_masks)."""
        S, V = len(seqs), self.vocab
        if S == 0:
            return []
        if S > self.max_rows:
            raise ValueError(f"{S} sampled rows exceed the sampler's {self.max_rows}")
        null = np.uint64(0)
        self.argmax(logits, S)
        processed = [i for i, s in enumerate(seqs) if needs_processing(s)]
        masks = self.upload_masks(seqs, bitmask)
        source = logits
        if processed or masks:
            self.cp.cuda.runtime.memcpyAsync(self.processed.data.ptr, logits.data.ptr, S * V * 4,
                                             self.cp.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)
            source = self.processed
            if processed:
                self._penalties(seqs, processed, masks)
            if masks:
                self.mask(self.processed, self.processed, S)
            changed = sorted(set(processed) | set(masks))
            greedy = np.asarray([i for i in changed if seqs[i].params.greedy], np.int32)
            if greedy.size:
                self._up(self.rows, greedy)
                self._launch(self.k_argmax, (greedy.size,), (1024,),
                             (source, np.int32(V), self.rows, self.ids, null, null))
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            self._sample(source, seqs, sampled)
        want_lp = [s.params.logprobs is not None for s in seqs]
        k = max([s.params.logprobs or 0 for s in seqs])
        if any(want_lp):
            self._launch(self.k_token_lp, (-(-S // 128),), (128,),
                         (logits, np.int32(V), self.ids, self.lse, self.logprob, np.int32(S)))
        if k:
            self._launch(self.k_topk, (S,), (1024,), (logits, np.int32(V), np.int32(k), self.lse,
                                                      self.top_ids, self.top_lp))
        ids = self.ids[:S].get(stream=self.stream)
        lps = self.logprob[:S].get(stream=self.stream) if any(want_lp) else None
        # topk_logprobs writes rows of k (the largest k asked in this step).
        tids = self.top_ids.reshape(-1)[:S * k].reshape(S, k).get(stream=self.stream) if k else None
        tlps = self.top_lp.reshape(-1)[:S * k].reshape(S, k).get(stream=self.stream) if k else None
        self.stream.synchronize()
        out = []
        for i, s in enumerate(seqs):
            tok = SampledToken(s.seq_id, int(ids[i]))
            if s.params.logprobs is not None:
                tok.logprob = float(lps[i])
                n = s.params.logprobs
                tok.top_logprobs = [(int(t), float(v)) for t, v in
                                    zip(tids[i, :n], tlps[i, :n])] if n else []
            out.append(tok)
        return out

    def _penalties(self, seqs: list[SeqStep], processed: list[int], masks: dict[int, np.ndarray]) -> None:
        """Steps 1-3 of the reference on the processed copy (min_tokens yielding to a grammar)."""
        S, V = len(seqs), self.vocab
        row_ptr = np.zeros(S + 1, np.int32)
        toks, flags, counts, bias = [], [], [], []
        rep, freq, pres = np.ones(S, np.float32), np.zeros(S, np.float32), np.zeros(S, np.float32)
        processed = set(processed)
        for i, s in enumerate(seqs):
            if i in processed:
                yields = i in masks and only_stop_tokens(allowed_tokens(masks[i], V), s.params.stop_token_ids)
                for t, (b, f, c) in sorted(penalty_entries(s, V, yields).items()):
                    toks.append(t); bias.append(b); flags.append(f); counts.append(c)
                rep[i], freq[i], pres[i] = (s.params.repetition_penalty, s.params.frequency_penalty,
                                            s.params.presence_penalty)
            row_ptr[i + 1] = len(toks)
        if len(toks) > PENALTY_ENTRIES:
            raise ValueError(f"penalty lists hold {len(toks)} entries, more than {PENALTY_ENTRIES}")
        if toks:
            self._up(self.pen_i[0], np.asarray(toks, np.int32))
            self._up(self.pen_i[1], np.asarray(flags, np.int32))
            self._up(self.pen_i[2], np.asarray(counts, np.int32))
            self._up(self.pen_bias, np.asarray(bias, np.float32))
        self._up(self.row_ptr, row_ptr)
        self._up(self.params_f[4], rep)
        self._up(self.params_f[5], freq)
        self._up(self.params_f[6], pres)
        self.k_penalties((S,), (256,), (self.processed, np.int32(V), self.row_ptr, self.pen_i[0], self.pen_bias,
                                        self.pen_i[1], self.pen_i[2], self.params_f[4], self.params_f[5],
                                        self.params_f[6]), stream=self.stream)

    def _sample(self, source, seqs: list[SeqStep], sampled: list[int]) -> None:
        n = len(sampled)
        ps = [seqs[i].params for i in sampled]
        self._up(self.rows, np.asarray(sampled, np.int32))
        self._up(self.params_f[0], np.asarray([p.temperature for p in ps], np.float32))
        self._up(self.params_f[1], np.asarray([p.min_p for p in ps], np.float32))
        self._up(self.params_f[2], np.asarray([p.top_p for p in ps], np.float32))
        uniform, seed, step = seeded_rows([seqs[i] for i in sampled])
        self._up(self.uniform, uniform)
        self._up(self.seed_step[0], seed)
        self._up(self.seed_step[1], step)
        self._up(self.top_k, np.asarray([p.top_k for p in ps], np.int32))
        self.k_uniforms((-(-n // 128),), (128,), (self.seed_step[0], self.seed_step[1], self.uniform, np.int32(n)),
                        stream=self.stream)
        self.k_sample((n,), (1024,), (source, np.int32(self.vocab), self.rows, self.probs, self.params_f[0],
                                      self.params_f[1], self.top_k, self.params_f[2], self.uniform,
                                      self.ids), stream=self.stream)
