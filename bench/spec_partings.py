"""Where speculation on and off part on the GPU, and how close a tie each parting is: the demo SmolLM2 (a GGUF file)
with `ngram` (k = 4, prompt lookup 2..4) on bench/speculative.py's five prompts, 128 greedy tokens each, run with
speculation off, on, and off again on the GPU executor; then each run's tokens teacher-forced through the float32
numpy executor: the first token where a run leaves the float32 argmax, with the log-probability gap between the
two (a near tie: a small gap), and where on and off part from each other.

    python3 bench/spec_partings.py SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.speculative import DEMO_TEXTS, K, build_executor, chat_prompt, cpu_executor, engine_run  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.loader.demo import demo_cache_folder  # noqa: E402
from engine.loader.gguf_convert import convert_gguf  # noqa: E402
from engine.speculative import SpeculativeConfig  # noqa: E402
from harness.models import engine_logits, log_softmax  # noqa: E402

TOKENS = 128


def leaves_argmax(cpu, prompt: list[int], tokens: list[int]) -> str:
    """Where `tokens` first leave the float32 argmax after `prompt`, with the log-probability gap."""
    lp = log_softmax(engine_logits(cpu, [prompt + tokens])[0][len(prompt) - 1:len(prompt) - 1 + len(tokens)])
    best = lp.argmax(-1)
    j = next((t for t in range(len(tokens)) if best[t] != tokens[t]), None)
    if j is None:
        return f"follows the float32 argmax for all {len(tokens)} tokens"
    return (f"leaves the float32 argmax at token {j}: chose {tokens[j]} (logprob {lp[j, tokens[j]]:.3f}) over "
            f"{best[j]} ({lp[j, best[j]]:.3f}), gap {lp[j, best[j]] - lp[j, tokens[j]]:.3f}")


def main() -> None:
    gguf = sys.argv[1]
    model = load_model(convert_gguf(gguf, out_dir=demo_cache_folder(gguf)))
    tok = model.tokenizer
    prompts = [tok.encode(chat_prompt(tok, t), add_special_tokens=False) for t in DEMO_TEXTS]
    spec = SpeculativeConfig("ngram", K, 2, 4)
    ex = build_executor(model, 8, 2048)
    try:
        off = [engine_run(ex, tok, [p], TOKENS)["tokens"][0] for p in prompts]
        on = [engine_run(ex, tok, [p], TOKENS, spec)["tokens"][0] for p in prompts]
        again = [engine_run(ex, tok, [p], TOKENS)["tokens"][0] for p in prompts]
    finally:
        ex.close()
    print(f"speculation off repeated: the same tokens on {sum(a == b for a, b in zip(off, again))} of {len(off)}")
    cpu = cpu_executor(model, 8, 2048)
    for i, p in enumerate(prompts):
        for name, tokens in (("off", off[i]), ("on", on[i])):
            print(f"prompt {i} speculation {name}: {leaves_argmax(cpu, p, tokens)}")
        j = next((t for t in range(min(len(off[i]), len(on[i]))) if off[i][t] != on[i][t]), None)
        print(f"prompt {i}: off and on part at token {j}")


if __name__ == "__main__":
    main()
