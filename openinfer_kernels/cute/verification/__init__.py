"""The CuTe kernels' verification harness: not part of the serving path.

`checks` holds the GPU checks (fresh random bf16 inputs, a NaN-poisoned output, a float32 reference)
and the ordered case catalogue; `run` runs the catalogue one case at a time in a worker process that
survives hangs and crashes (`python -m openinfer_kernels.cute.verification.run`). Tests and benchmarks use
both; the runtime uses one check only, for the start-up product of `openinfer_kernels.cute.self_check`.
"""
