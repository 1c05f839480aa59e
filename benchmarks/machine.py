"""One line describing the machine a benchmark ran on: CPU, the flags that decide its fast paths, load."""

from __future__ import annotations

import os
import subprocess

import torch

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_header() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    cpus = fields.get("CPU(s)", "?").strip()
    have = set(fields.get("Flags", "").split())
    flags = " ".join(f if f in have else f"no-{f}" for f in FLAGS)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"machine: {model}, {cpus} CPUs, torch threads {torch.get_num_threads()} | {flags} | load {load}"
