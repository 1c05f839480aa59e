"""Tensor parallelism: a model split across ranks (Megatron-style column/row-parallel linears).

`group.py`: one rank's view of the group (its collectives and its share of heads, columns and vocabulary);
`shm_all_reduce.py`: the all-reduce through shared memory for ranks on one host's CPUs; `workers.py`: the worker
processes that rank 0 starts and feeds each step. A rank's slice of each checkpoint tensor, dense or quantized, is
cut by `LlamaModel.shard` (engine/models/llama.py). Nothing here is imported at TP=1.
"""
