"""Tensor parallelism: a model split across ranks (Megatron-style column/row-parallel linears).

`group.py`: one rank's view of the group (its collectives and its share of heads, columns and vocabulary);
`sharding.py`: the rank's slice of a checkpoint tensor, dense or quantized; `shm_all_reduce.py`: the all-reduce
through shared memory for ranks on one host's CPUs; `workers.py`: the worker processes that rank 0 starts and feeds
each step. Nothing here is imported at TP=1.
"""
