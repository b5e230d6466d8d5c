"""Tensor and expert parallelism: one model across N ranks (one process per GPU; threads on the CPU).

`sharding.py` says which weight splits how (from the model line's weight declarations) and builds one
rank's shard; `comm.py` the collectives (an in-process numpy group, NCCL on GPUs); `cpu_ops.py` /
`gpu_ops.py` the Ops of a rank (row-parallel sums, expert-parallel MoE, vocab-parallel logits);
`executor.py` rank 0's executor, which sends every step to the other ranks before it runs its own
shard; `ranks.py` the other ranks (threads, or one `worker.py` process per GPU); `launch.py` starts them.
"""
