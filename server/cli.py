"""`pagedserve serve | generate | chat | bench | eval | plan`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import os
import socket
import sys
import typing

from ..engine.errors import ArgumentParser

# subcommands with their own argument lists: the load tester, the quality harness, the memory planner
SUBPROGRAMS = {"bench": "pagedserve.benchmarks.serve", "eval": "pagedserve.tools.eval",
               "plan": "pagedserve.tools.plan"}

def add_options(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """Flags for every `opt(...)` field of a config dataclass: names, types, defaults and help come from there."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        flag = "--" + (f.metadata["flag"] or f.name).replace("_", "-")
        kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        if kind is bool:
            group.add_argument(flag, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction,
                               help=f.metadata["help"])
        else:
            group.add_argument(flag, dest=f.name, default=f.default, type=kind, choices=f.metadata["choices"],
                               help=f.metadata["help"] + (" (default: %(default)s)" if f.default is not None else ""))


def options(args: argparse.Namespace, cls: type) -> dict:
    """The parsed values of `cls`'s option fields, by field name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if "help" in f.metadata}


def _engine_args(p: argparse.ArgumentParser) -> None:
    from ..engine.config import CacheConfig, EngineConfig, SchedulerConfig

    add_options(p, EngineConfig, "engine")
    add_options(p, SchedulerConfig, "scheduler")
    add_options(p, CacheConfig, "KV cache")


def _engine_config(args: argparse.Namespace):
    from ..engine.config import CacheConfig, EngineConfig, SchedulerConfig

    try:
        return EngineConfig(**options(args, EngineConfig), cache=CacheConfig(**options(args, CacheConfig)),
                            scheduler=SchedulerConfig(**options(args, SchedulerConfig)))
    except ValueError as e:
        _fail(str(e))


def cmd_serve(args: argparse.Namespace) -> None:
    from ..engine.async_engine import AdmissionLimits
    from ..engine.llm_engine import LLMEngine
    from .app import create_app, uvicorn_config
    from .config import ReplicaConfig, ServerConfig
    from .connections import is_loopback
    from .shutdown import GracefulServer

    config = _engine_config(args)
    if config.node_rank > 0:
        _serve_node(config)
        return
    try:
        server = ServerConfig(**options(args, ServerConfig), limits=AdmissionLimits(**options(args, AdmissionLimits)))
        if server.api_key is None and os.environ.get("PAGEDSERVE_API_KEY"):  # keeps the key out of `ps`
            server = dataclasses.replace(server, api_key=os.environ["PAGEDSERVE_API_KEY"])
        replicas = ReplicaConfig(**options(args, ReplicaConfig))
    except ValueError as e:
        _fail(str(e))
    if server.otlp_traces_endpoint is not None:  # the extra, before the port is bound or the model resolved
        try:
            importlib.import_module("pagedserve.server.otel")
        except ImportError as e:
            _fail(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'pagedserve[otel]' ({e})")
    if not server.api_keys() and not is_loopback(server.host) and not server.allow_insecure_no_auth:
        _fail(f"refusing to serve on {server.host} without an API key: anyone who can reach it could use the model "
              "and read the metrics. Set --api-key (or PAGEDSERVE_API_KEY), or pass --allow-insecure-no-auth if the "
              "network is trusted")
    _check_listen(server.host, server.port)
    files = _resolve_model(config)  # before the port is bound
    config = dataclasses.replace(config, model=files.path)
    if server.served_model_name is None:
        server = dataclasses.replace(server, served_model_name=files.name)
    if replicas.replicas is not None:
        _serve_replicas(config, server, replicas)
        return
    app = create_app(lambda: LLMEngine(config), server)
    _raise_open_files_limit()  # the connection cap, not the file limit, should decide who is refused
    print(f"pagedserve: serving {server.served_model_name!r} on http://{server.host}:{server.port}/v1 "
          f"({'API key required' if server.api_keys() else 'no auth'}; loading the model...)", flush=True)
    uv = GracefulServer(uvicorn_config(app, server), app, server.shutdown_timeout_s)
    app.state.pagedserve.on_load_error = lambda: setattr(uv, "should_exit", True)
    try:
        uv.run()
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, as asked; no traceback
        sys.exit(130)
    if app.state.pagedserve.load_error is not None:  # never a server that answers 503 for ever
        e = app.state.pagedserve.load_error
        _fail(f"the model failed to load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _check_listen(host: str, port: int) -> None:
    """Bind once before the model loads: a bad port, one in use or a host that does not resolve is one line here,
    not uvicorn's exit 3 after the load has begun."""
    if not 1 <= port <= 65535:
        _fail(f"--port must be in 1..65535, got {port}")
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            pass
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def _resolve_model(config):
    """The model's files, checked to fit the context asked for and to split over the tensor-parallel ranks: a
    model that cannot load ends the process here, with one line."""
    from ..engine.models.loader import load_config
    from ..engine.models.resolver import resolve_model
    from ..engine.parallel.group import check_tensor_parallel

    try:
        files = resolve_model(config.model, config.revision, config.gguf_file)
        model_config = load_config(files.path)
        config.context_length(model_config)
        check_tensor_parallel(model_config, config.tensor_parallel_size)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    return files


def _serve_node(config) -> None:
    """Another node of a multi-node tensor-parallel group: its worker ranks only, no HTTP server."""
    from ..engine.parallel.workers import run_node

    model_path = _resolve_model(config).path
    print(f"pagedserve: node {config.node_rank} of {config.nnodes}: tensor-parallel worker ranks for "
          f"{config.dist_init_addr} (no server on this node)", flush=True)
    sys.exit(run_node(config, model_path))


def _serve_replicas(config, server, replicas) -> None:
    """Ray is imported here and only here: without --replicas the server never loads it."""
    try:
        from . import ray_app
    except ImportError as e:
        _fail(f"--replicas needs Ray Serve: pip install 'pagedserve[ray]' ({e})")
    ray_app.run(config, server, replicas)


def _fail(message: str) -> typing.NoReturn:
    print(f"pagedserve: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def _raise_open_files_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cmd_generate(args: argparse.Namespace) -> None:
    from ..engine.llm_engine import LLMEngine
    from ..engine.sampling_params import SamplingParams
    from ..engine.tokenizer import apply_chat_template

    try:  # bad options, a model that cannot load or be split, a prompt the engine refuses: one line each
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.sample_seed)
        engine = LLMEngine(_engine_config(args))
        tok = engine.tokenizer
        if args.raw or tok is None or not getattr(tok, "chat_template", None):
            prompt = args.prompt
        else:
            prompt = apply_chat_template(tok, [{"role": "user", "content": args.prompt}])
        engine.add_request("cli", prompt, params)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
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
    """A terminal chat with a running server, through the official openai client. Ctrl-C stops a reply and keeps
    the conversation; Ctrl-C at the prompt, Ctrl-D or an empty line ends it."""
    import openai

    key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    client = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=1, timeout=600)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.APIConnectionError:
        _fail(f"no server at {args.base_url}: start one with `pagedserve serve` (or give --base-url)")
    except openai.APIStatusError as e:
        _fail(f"{args.base_url}: {e.status_code} {e.message}")
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"chatting with {model} at {args.base_url} (empty line or Ctrl-D to quit; Ctrl-C stops a reply)")
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not line:
            return
        history.append({"role": "user", "content": line})
        reply: list[str] = []
        sys.stdout.write("assistant> ")
        try:
            stream = client.chat.completions.create(model=model, messages=history, stream=True,
                                                    max_tokens=args.max_tokens, temperature=args.temperature)
            with stream:
                for chunk in stream:
                    piece = chunk.choices[0].delta.content if chunk.choices else None
                    if piece:
                        reply.append(piece)
                        sys.stdout.write(piece)
                        sys.stdout.flush()
        except KeyboardInterrupt:  # closing the stream aborts the request on the server
            reply.append(" [stopped]")
            sys.stdout.write(" [stopped]")
        except openai.APIError as e:
            print(f"\n[the server at {args.base_url} went away]" if isinstance(e, openai.APIConnectionError)
                  else f"\n[error: {getattr(e, 'status_code', '')} {e.message}]")
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBPROGRAMS:  # each owns its whole argument list; imported only when run
        if argv[0] != "bench":
            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        importlib.import_module(SUBPROGRAMS[argv[0]]).main(argv[1:])
        return
    ap = ArgumentParser(prog="pagedserve", description="A small, fast LLM serving engine.")
    sub = ap.add_subparsers(dest="command", required=True)

    from ..engine.async_engine import AdmissionLimits
    from .config import ReplicaConfig, ServerConfig

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _engine_args(p)
    add_options(p, ServerConfig, "server")
    add_options(p, AdmissionLimits, "admission")
    add_options(p, ReplicaConfig, "replicas (Ray Serve)")
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
    p.add_argument("--api-key", default=None, help="the server's key (default $PAGEDSERVE_API_KEY, then "
                                                  "$OPENAI_API_KEY; a command line is visible to other users)")
    p.add_argument("--model", default=None)
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=cmd_chat)

    sub.add_parser("bench", help="load-test an OpenAI-compatible server (pagedserve bench --help)")
    sub.add_parser("eval", help="quality of quantized weights: perplexity, battery, agreement (eval --help)")
    sub.add_parser("plan", help="memory planner: weights + KV cache -> resident tokens (plan --help)")

    args = ap.parse_args(argv)
    # the chat is a conversation, not a log: warnings only there
    logging.basicConfig(level=logging.WARNING if args.command == "chat" else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    args.func(args)


if __name__ == "__main__":
    main()
