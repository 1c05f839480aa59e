"""Serve the installed pagedserve from a folder that is not a checkout, as a user of the wheel would (.ci/run runs
this after docker/install.sh, the Docker image's own install steps):

    python docker/smoke.py          # from any folder, in the environment the wheel was installed into

1. `pagedserve serve` (the bundled model): ready, one chat completion through the official openai client, the page
   and every asset it loads, then SIGTERM: exit 0;
2. `pagedserve serve --tensor-parallel-size 2` on a model whose heads split over two ranks: one completion;
3. `pagedserve generate`.
Each step prints one line; the first failure ends it with exit 1.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

import pagedserve

START_S = 600  # a first start compiles the C++ kernels on a cold cache


def fail(message: str) -> None:
    print(f"smoke: FAILED: {message}", flush=True)
    sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*flags: str) -> tuple[subprocess.Popen, str, object]:
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(["pagedserve", "serve", "--port", str(port), *flags], stdout=log,
                            stderr=subprocess.STDOUT)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            fail(f"`pagedserve serve {' '.join(flags)}` exited {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return proc, base, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    fail(f"`pagedserve serve {' '.join(flags)}` not ready within {START_S} s")


def stop(proc: subprocess.Popen, log) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        fail("the server did not stop within 60 s of SIGTERM")
    log.seek(0)
    out = log.read()
    if code != 0 or "Traceback" in out:
        fail(f"the server exited {code} on SIGTERM:\n{out[-3000:]}")


def main() -> None:
    installed = os.path.dirname(pagedserve.__file__)
    if "site-packages" not in installed or os.path.exists(os.path.join(installed, "..", "engine")):
        fail(f"pagedserve comes from {installed}, not from an installed wheel")
    print(f"smoke: pagedserve installed at {installed}; running from {os.getcwd()}", flush=True)

    proc, base, log = serve()
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=16,
                                               messages=[{"role": "user", "content": "Say hello."}])
        if not reply.choices[0].message.content or reply.usage.completion_tokens < 1:
            fail(f"empty chat reply: {reply}")
        print(f"smoke: chat completion from {model}: {reply.choices[0].message.content!r}", flush=True)
        page = httpx.get(f"{base}/", timeout=10)
        assets = sorted(set(re.findall(r'(?:src|href)="(/web/[^"]+)"', page.text)))
        if page.status_code != 200 or not assets:
            fail(f"the page: {page.status_code}, assets {assets}")
        pending, seen = list(assets), set()
        while pending:  # the page's modules import others: follow them
            path = pending.pop()
            if path in seen:
                continue
            seen.add(path)
            r = httpx.get(base + path, timeout=10)
            if r.status_code != 200 or not r.content:
                fail(f"page asset {path}: {r.status_code}")
            if path.endswith(".js"):
                pending += re.findall(r'from "(/web/[^"]+)"', r.text)
        print(f"smoke: the page and its {len(seen)} assets", flush=True)
    finally:
        stop(proc, log)
    print("smoke: SIGTERM: exit 0", flush=True)

    # random:tiny: 4 attention heads, so two ranks take two each; no tokenizer, so the prompt is token ids
    proc, base, log = serve("--model", "random:tiny", "--tensor-parallel-size", "2", "--dtype", "float32")
    try:
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={"prompt": [1, 2, 3, 4], "max_tokens": 4})
        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 4:
            fail(f"tensor-parallel completion: {r.status_code} {r.text[:500]}")
    finally:
        stop(proc, log)
    print("smoke: --tensor-parallel-size 2: a completion, then exit 0", flush=True)

    out = subprocess.run(["pagedserve", "generate", "The capital of France is", "--max-tokens", "8"],
                         capture_output=True, text=True, timeout=START_S)
    if out.returncode != 0 or not out.stdout.strip():
        fail(f"`pagedserve generate` exited {out.returncode}:\n{out.stderr[-3000:]}")
    print(f"smoke: generate: {out.stdout.strip()!r}", flush=True)
    print("smoke: passed", flush=True)


if __name__ == "__main__":
    main()
