"""`pagedserve serve | generate | chat | bench`."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face model directory, or random:<shape> (default: bundled SmolLM2-135M)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's own)")
    g.add_argument("--dtype", default="auto", help="auto (bf16 where fast, else fp32), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256, help="max sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: from --kv-cache-gib)")
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache memory budget (default 1 GiB on CPU, 90%% of free GPU memory)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)


def _engine_config(args: argparse.Namespace):
    from engine.config import make_config

    return make_config(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs,
        max_model_len=args.max_model_len, seed=args.seed,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, policy=args.policy,
        block_size=args.block_size, num_blocks=args.num_blocks, memory_gib=args.kv_cache_gib,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from engine.async_engine import AdmissionLimits
    from engine.llm_engine import LLMEngine
    from server.app import ServerConfig, create_app

    config = _engine_config(args)
    name = args.served_model_name or _default_name(args.model)
    limits = AdmissionLimits(args.max_waiting_requests, args.max_queued_tokens)
    app = create_app(lambda: LLMEngine(config), ServerConfig(name, limits))
    print(f"pagedserve: serving {name!r} on http://{args.host}:{args.port}/v1 (loading the model...)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


def _default_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(model.rstrip("/"))
    return base.removesuffix(".gguf")


def cmd_generate(args: argparse.Namespace) -> None:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import apply_chat_template

    engine = LLMEngine(_engine_config(args))
    tok = engine.tokenizer
    if args.raw or tok is None or not getattr(tok, "chat_template", None):
        prompt = args.prompt
    else:
        prompt = apply_chat_template(tok, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sample_seed)
    engine.add_request("cli", prompt, params)
    finish = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text if tok is not None else " ".join(map(str, out.new_token_ids)) + " ")
            sys.stdout.flush()
            if out.finished:
                finish = out.finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={finish}]", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> None:
    """An interactive terminal chat with a running server, streaming replies over HTTP."""
    import json

    import httpx

    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    with httpx.Client(base_url=args.base_url, timeout=httpx.Timeout(600, connect=5)) as client:
        model = args.model or client.get("/models").json()["data"][0]["id"]
        print(f"chatting with {model} at {args.base_url} (empty line or Ctrl-D to quit)")
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            if not line:
                break
            history.append({"role": "user", "content": line})
            body = {"model": model, "messages": history, "stream": True, "max_tokens": args.max_tokens,
                    "temperature": args.temperature}
            reply = []
            sys.stdout.write("assistant> ")
            with client.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    print(f"[error {r.status_code}: {r.text}]")
                    history.pop()
                    continue
                for raw in r.iter_lines():
                    if not raw.startswith("data: ") or raw == "data: [DONE]":
                        continue
                    chunk = json.loads(raw[6:])
                    if "error" in chunk:
                        print(f"\n[error: {chunk['error']['message']}]")
                        break
                    for choice in chunk.get("choices", []):
                        piece = choice["delta"].get("content") or ""
                        reply.append(piece)
                        sys.stdout.write(piece)
                        sys.stdout.flush()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # the load tester owns its whole argument list
        from benchmarks.serve import main as bench_main

        bench_main(argv[1:])
        return
    ap = argparse.ArgumentParser(prog="pagedserve", description="A small, fast LLM serving engine.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests allowed to wait for a slot; more get 429 + Retry-After")
    p.add_argument("--max-queued-tokens", type=int, default=None, help="prompt tokens allowed to wait")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    _engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None)
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=cmd_chat)

    sub.add_parser("bench", help="load-test an OpenAI-compatible server (pagedserve bench --help)")

    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
