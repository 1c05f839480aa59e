"""pagedserve on Ray Serve: one ingress deployment (the same FastAPI app as the single server) in front of N
engine replicas, each one AsyncEngine, routed by server/ray_router.py.

    pagedserve serve --replicas 2                         # a local Ray cluster, started and stopped here
    pagedserve serve --replicas 4 --ray-address auto      # a cluster from `ray start --head` / `--address`
    serve run pagedserve.server.ray_app:app_builder model=/path/model.gguf replicas=2   # Ray's own CLI / KubeRay

Only `pagedserve serve --replicas` and Ray's CLI import this module (and Ray).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from ..engine.async_engine import AdmissionLimits, AsyncEngine, EngineDeadError, OverloadedError
from ..engine.config import EngineConfig
from ..engine.input_processor import InputProcessor
from ..engine.sampling_params import SamplingParams
from .affinity import RoutingKey
from .app import create_app
from .config import ReplicaConfig, ServerConfig
from .fleet import Admitted, Fleet, Item, Refused, ReplicaLostError, Scheduled, published_stats

logger = logging.getLogger(__name__)

ENGINE = "PagedServeEngine"  # the engine deployment's name (the router registry's key)
DESCRIBE_TIMEOUT_S = 600.0  # the ingress waits this long for a replica to load its model
INGRESS_DRAIN_GRACE_S = 5.0  # the ingress's drain outlasts the replicas' by this much


@dataclass(frozen=True)
class ReplicaInfo:
    """What the ingress needs to tokenize and check requests exactly as the replicas will."""

    tokenizer: object
    vocab_size: int
    max_model_len: int
    block_size: int
    scheduling_policy: str  # a non-zero priority is refused at the ingress unless it is "priority"


class EngineReplica:
    """One engine (LLMEngine + its thread) in a Ray Serve replica."""

    def __init__(self, engine_config: EngineConfig, limits: AdmissionLimits, threads: int) -> None:
        import torch

        from ..engine.llm_engine import LLMEngine

        torch.set_num_threads(threads)
        self.engine = LLMEngine(engine_config)
        self.aeng = AsyncEngine(self.engine, limits)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._started = False

    async def describe(self) -> ReplicaInfo:
        e = self.engine
        return ReplicaInfo(e.tokenizer, e.model_config.vocab_size, e.max_model_len, e.config.cache.block_size,
                           e.config.scheduler.scheduling_policy)

    async def generate(self, request_id: str, ids: list[int], params: SamplingParams,
                       key: RoutingKey | None = None) -> AsyncIterator[Item]:
        """Admitted, Scheduled once the engine gives it tokens, then the engine's outputs; or Refused alone. `key`
        is the router's, unused here. The request is built again here, by this engine's input processor and off
        the event loop (the ingress checked it alike; the grammar matcher is this engine's own)."""
        if not self._started:  # the engine thread hands outputs to the loop Ray runs this replica's calls on
            self._started = True
            self.aeng.start(asyncio.get_running_loop())
        try:
            with self.aeng.reserve() as places:
                request = await asyncio.to_thread(self.aeng.input_processor.process, request_id, ids, params)
                stream = self.aeng.submit(request, places)  # takes the place, even when it raises
        except OverloadedError as e:
            yield Refused(self.replica_id, str(e), e.reason)
            return
        yield Admitted(self.replica_id)
        try:  # a cancelled call (client gone, ingress closed the stream) ends here: close() aborts the request
            await stream.wait_scheduled()  # also set by the engine's death, which the stream then raises
            yield Scheduled(self.replica_id)
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def record_routing_stats(self) -> dict:
        s = self.aeng.stats()
        return {"num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "num_preemptions": s.num_preemptions, "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "drain_rate": self.aeng.drain_rate(),
                "estimated_wait": self.aeng.estimated_wait(),
                "max_waiting_requests": self.aeng.limits.max_waiting_requests}

    async def check_health(self) -> None:
        if self._started and not self.aeng.alive:  # Ray replaces a replica whose engine loop died
            raise RuntimeError("the engine loop died")


class Ingress:
    """The single server's FastAPI app, its engine a Fleet of EngineReplicas (see server/fleet.py)."""

    def __init__(self, engine, config: ServerConfig) -> None:
        self.handle = engine
        self.stream_handle = engine.options(stream=True)
        self.config = config
        self.fleet: Fleet | None = None  # once the replicas have described themselves

    def __serve_build_asgi_app__(self):
        # Ray's proxy echoes X-Request-Id itself (and makes one when none came): ours would be a second header
        return create_app(self._describe, self.config, start=self._start, echo_ids=False)

    def _describe(self) -> ReplicaInfo:  # in the app's loading thread: blocking is fine there
        return self.handle.describe.remote().result(timeout_s=DESCRIBE_TIMEOUT_S)

    def _start(self, info: ReplicaInfo, config: ServerConfig, on_outputs, loop) -> Fleet:
        inputs = InputProcessor(info.tokenizer, info.vocab_size, info.max_model_len,
                                scheduling_policy=info.scheduling_policy, build_constraints=False)
        self.fleet = Fleet(inputs, self._dispatch, lambda: published_stats(ENGINE), config.limits, info.block_size,
                           on_outputs)
        return self.fleet

    async def _dispatch(self, request_id: str, ids: list[int], params: SamplingParams,
                        key: RoutingKey) -> AsyncIterator[Item]:
        """One call to some replica, Ray's errors translated: a replica gone is ReplicaLostError, Ray's own
        queue limit is an OverloadedError (our 429, never a 500)."""
        response = self.stream_handle.generate.remote(request_id, ids, params, key=key)
        try:
            async for item in response:
                yield item
        except (RayActorError, ActorUnavailableError, DeploymentUnavailableError) as e:
            raise ReplicaLostError(f"replica lost: {type(e).__name__}") from e
        except RayTaskError as e:
            if isinstance(e.cause, EngineDeadError):
                raise ReplicaLostError("replica's engine died") from e
            raise
        except BackPressureError as e:
            raise OverloadedError("server overloaded: the router's queue is full", self.fleet.retry_after()) from e
        finally:
            response.cancel()


def build_app(engine_config: EngineConfig, server: ServerConfig, replicas: ReplicaConfig):
    """The Ray Serve application: `serve.run(build_app(...))`."""
    from .ray_router import DefaultRouter, PrefixCacheRouter

    n = replicas.replicas or 1
    threads = replicas.threads or max(1, (os.cpu_count() or 1) // n)
    limits = server.limits
    router = PrefixCacheRouter if replicas.router == "prefix" else DefaultRouter
    # Ray's own per-replica cap must not bind before ours does: our admission answers with a 429 and a
    # Retry-After, Ray's would queue silently in the router
    ongoing = (limits.max_waiting_requests or 4096) + engine_config.scheduler.max_num_seqs + 16
    # A replica that Ray stops (scaled down, redeployed, its node drained) is first taken out of routing, then
    # lets its requests in flight run for up to --shutdown-timeout-s before it is killed; a stream still running
    # then ends with an error event (replica_died) and [DONE], and one not yet started is retried elsewhere
    # (server/fleet.py). The ingress outlives its replicas' drain by a little, to pass those last events on.
    drain = {"graceful_shutdown_timeout_s": server.shutdown_timeout_s, "graceful_shutdown_wait_loop_s": 0.5}
    engine = serve.deployment(EngineReplica, name=ENGINE).options(
        **drain, num_replicas=n, max_ongoing_requests=ongoing, ray_actor_options={"num_cpus": threads},
        health_check_period_s=replicas.health_check_period_s, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=router, request_router_kwargs=replicas.router_kwargs if router is
            PrefixCacheRouter else {}, request_routing_stats_period_s=replicas.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, replicas.routing_stats_period_s)))
    ingress = serve.deployment(serve.ingress()(Ingress), name="PagedServeIngress").options(
        num_replicas=1, max_ongoing_requests=max(ongoing * n, 1024), graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=server.shutdown_timeout_s + INGRESS_DRAIN_GRACE_S,
        ray_actor_options={"num_cpus": replicas.ingress_cpus})
    return ingress.bind(engine.bind(engine_config, limits, threads), server)


def app_builder(args: dict):
    """For `serve run pagedserve.server.ray_app:app_builder model=... replicas=2 threads=1 router=prefix` (and a
    Serve config file's `import_path`): engine options by their field names, as the CLI's flags."""
    from ..engine.config import make_config
    from ..engine.models.resolver import resolve_model

    args = dict(args)
    threads = args.pop("threads", None)
    rep = ReplicaConfig(replicas=int(args.pop("replicas", 1)), threads=None if threads is None else int(threads),
                        router=args.pop("router", "prefix"))
    name = args.pop("served_model_name", None)
    files = resolve_model(args.get("model"), args.get("revision"), args.get("gguf_file"))
    config = make_config(**{**args, "model": files.path})
    return build_app(config, ServerConfig(served_model_name=name or files.name), rep)


def run(engine_config: EngineConfig, server: ServerConfig, replicas: ReplicaConfig) -> None:
    """`pagedserve serve --replicas N`: join or start a cluster, deploy, serve until Ctrl-C or SIGTERM, then tear
    down, each deployment draining as above."""
    ray.init(address=replicas.ray_address, include_dashboard=False, log_to_driver=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM tears down as Ctrl-C does
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(build_app(engine_config, server, replicas), name="pagedserve", route_prefix="/",
                  blocking=False)
        print(f"pagedserve: serving {server.served_model_name!r} with {replicas.replicas} replicas on "
              f"http://{server.host}:{server.port}/v1 (Ray Serve)", flush=True)
        threading.Event().wait()  # until Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


__all__ = ["EngineReplica", "Ingress", "ReplicaInfo", "app_builder", "build_app", "run"]
