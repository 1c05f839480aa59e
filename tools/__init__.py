"""Command-line tools beside the engine, run as `pagedserve eval` (the quality harness, eval.py) and `pagedserve
plan` (the memory planner, plan.py); installed as pagedserve.tools. They use the engine and the engine never
imports them."""
