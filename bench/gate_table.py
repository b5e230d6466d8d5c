"""Print the accuracy-gate tables (markdown) from the JSON lines the gate tests append to $OPENINFER_GATE_LOG:
the teacher-forced rows, then the free-running rows (tests/gpu/test_gpu_free_running*.py).
    python3 bench/gate_table.py GATE_LOG"""
import json
import os
import sys

rows = [json.loads(line) for line in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
print("\n| case | pos | tie tol | agree | agree@0.02 | strict | mean abs dlogprob | p99 | mean bound "
      "| HF bf16 agree | HF bf16 agree@0.02 | HF bf16 mean | HF bf16 p99 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if "positions" in r:
        print(f"| {r['case']} | {r['positions']} | {r['tie_tol']:.3f} | {r['agree']:.4f} | {r['agree_002']:.4f} | "
              f"{r['strict']:.4f} | {r['mean']:.4f} | {r['p99']:.4f} | {r['bound']:.4f} | {r['hf_bf16_agree']:.4f} | "
              f"{r['hf_bf16_agree_002']:.4f} | {r['hf_bf16_mean']:.4f} | {r['hf_bf16_p99']:.4f} |")
free = [r for r in rows if "flips" in r]
if free:
    print("\n| free-running case | tokens | tie tol | flips | HF bf16 misses | ties | mean abs dlogprob | mean bound |")
    print("|---|---|---|---|---|---|---|---|")
    for r in free:
        print(f"| {r['case']} | {r['tokens']} | {r['tie_tol']:.3f} | {r['flips']} | {r['hf_bf16_misses']} | "
              f"{r['ties']} | {r['mean_dlogprob']:.4f} | {r['bound']:.4f} |")
