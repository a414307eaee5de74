"""`specdec serve --replicas N`: the OpenAI server on Ray Serve, over N engine replicas.

    HTTP (Ray Serve's proxy) -> Ingress (today's FastAPI app: endpoints, SSE, /metrics, /health,
                                the chat page; tokenizing and the chat template happen here)
                                  | deployment handle, routed by SpecdecRouter (prefix cache)
                                  v
                                EngineReplica x N (one Engine each)

With `prefill_replicas` M > 0 (prefill/decode disaggregation, `pd.py`): M of the N are
`PrefillReplica`s, which prefill prompts and hand their KV over, and the other N - M decode
(`EngineReplica`s, each with a handle to the prefill replicas to pull the KV from).

`build_app` makes the Ray Serve application (tests deploy it on a local Ray with tiny engines);
`run` is the command: it joins `--ray-address` or starts a local Ray (dashboard off, bounded object
store), deploys, and serves until interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from specdec.api.cluster.routing import POLICIES, ROUTER_HEADER, PrefixPolicyConfig, check_policy

logger = logging.getLogger("specdec.api")

APP_NAME = "specdec"


@dataclass
class ClusterOptions:
    """How the replicas are deployed and routed (the engine's own settings are its factory's)."""

    replicas: int = 2
    prefill_replicas: int = 0  # of `replicas`, those that only prefill (0: every replica does both)
    router: str = "prefix"
    replica_cpus: float = 1.0  # Ray's CPU reservation per replica
    replica_threads: int | None = None  # torch / OpenMP threads per replica (default: its CPUs)
    route_timeout_s: float = 120.0  # a request no replica takes within this fails (503 / SSE error)
    stall_timeout_s: float = 300.0  # one engine step running longer fails the health check
    health_check_period_s: float = 2.0
    stats_period_s: float = 1.0  # how often each replica reports its cached blocks to the router
    warmup: bool = False
    step_delay_s: float = 0.0  # slow every engine step (fault tests)
    log_level: str = "INFO"  # the replicas' and the ingress's (Ray Serve logging); replicas log no access lines
    balance: PrefixPolicyConfig | None = None
    kv_lease_timeout_s: float = 30.0  # a prefill replica frees handed-over blocks nobody pulled by then
    kv_pull_timeout_s: float = 30.0  # a decode replica recomputes the prompt when a pull takes longer
    pull_delay_s: float = 0.0  # wait before every pull (fault tests: kill a prefill replica meanwhile)
    # prefill replicas' CPU priority below the decode replicas' (Unix nice): on shared cores the
    # scheduler serves the latency-bound decode steps first (the streams' gaps), prefill after
    prefill_nice: int = 10
    # a tensor- or pipeline-parallel target with Ray ranks: each replica and its ranks one
    # placement group of `ranks` bundles (bundle 0 the replica's), packed or spread over machines
    ranks: int = 1
    rank_placement: str = "pack"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.prefill_replicas and not 0 < self.prefill_replicas < self.replicas:
            raise ValueError(f"--prefill-replicas must leave at least one decode replica: got {self.prefill_replicas} "
                             f"of {self.replicas} replicas")
        if self.prefill_replicas < 0:
            raise ValueError(f"--prefill-replicas must be >= 0, got {self.prefill_replicas}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"--prefill-nice must be in 0..19 (a replica can only lower its priority), got {self.prefill_nice}")
        if self.kv_lease_timeout_s <= 0 or self.kv_pull_timeout_s <= 0:
            raise ValueError("--kv-lease-timeout and --kv-pull-timeout must be positive")
        check_policy(self.router)
        if self.route_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("--route-timeout and --stall-timeout must be positive")


class Ingress:
    """The ingress deployment's body: the FastAPI app over a `ReplicaEngine`."""

    def __init__(self, engine_handle: Any, settings: Any, route_timeout_s: float, prefill_handle: Any = None) -> None:
        from specdec.api.cluster.client import ReplicaEngine
        from specdec.api.cluster.pd import PDReplicaEngine

        if prefill_handle is not None:
            self._engine = PDReplicaEngine(engine_handle, prefill_handle, route_timeout_s)
        else:
            self._engine = ReplicaEngine(engine_handle, route_timeout_s)
        self._settings = settings

    def __serve_build_asgi_app__(self) -> Any:
        from specdec.api.server import create_app

        app = create_app(self._engine, self._settings)
        app.add_middleware(RouterHeaderMiddleware)
        return app


class RouterHeaderMiddleware:
    """`x-specdec-router: prefix|pow2|round-robin|one` routes this request by that policy instead of
    the server's (benchmarks compare policies on one cluster); an unknown name is a 400."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from specdec.api.cluster.client import REQUEST_POLICY

        value = dict(scope.get("headers") or []).get(ROUTER_HEADER.encode())
        if value is None:
            return await self.app(scope, receive, send)
        policy = value.decode("latin-1").strip()
        if policy not in POLICIES:
            from fastapi.responses import JSONResponse

            from specdec.api.errors import error_body

            body = error_body(f"unknown router {policy!r} in {ROUTER_HEADER}; choose one of {', '.join(POLICIES)}",
                              "invalid_request_error", ROUTER_HEADER, "invalid_value")
            return await JSONResponse(body, status_code=400)(scope, receive, send)
        token = REQUEST_POLICY.set(policy)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_POLICY.reset(token)


def build_app(engine_factory: Any, settings: Any, options: ClusterOptions, decode_factory: Any = None) -> Any:
    """The Ray Serve application: an ingress bound to N engine replicas (M of them prefill
    replicas, the others decode replicas built by `decode_factory` (default: `engine_factory`),
    with `options.prefill_replicas` M > 0)."""
    from ray import serve

    from specdec.api.cluster.replica import EngineReplica

    def deployment(name: str, num_replicas: int) -> Any:
        return _engine_deployment(EngineReplica, name, num_replicas, settings, options)

    ingress = serve.deployment(
        serve.ingress()(Ingress), name="Ingress", num_replicas=1,
        max_ongoing_requests=max(16, 2 * settings.max_concurrent), ray_actor_options={"num_cpus": 0},
        logging_config={"log_level": options.log_level},
    )
    common = dict(warmup=options.warmup, stall_timeout_s=options.stall_timeout_s, step_delay_s=options.step_delay_s)
    if not options.prefill_replicas:
        replica = deployment("EngineReplica", options.replicas).bind(engine_factory, **common)
        return ingress.bind(replica, settings, options.route_timeout_s)
    prefill = deployment("PrefillReplica", options.prefill_replicas).bind(
        engine_factory, role="prefill", lease_timeout_s=options.kv_lease_timeout_s, nice=options.prefill_nice, **common)
    decode = deployment("EngineReplica", options.replicas - options.prefill_replicas).bind(
        decode_factory or engine_factory, role="decode", prefill_handle=prefill, pull_timeout_s=options.kv_pull_timeout_s,
        pull_delay_s=options.pull_delay_s, **common)
    return ingress.bind(decode, settings, options.route_timeout_s, prefill)


def _engine_deployment(cls: Any, name: str, num_replicas: int, settings: Any, options: ClusterOptions) -> Any:
    """One deployment of engine replicas, routed by `SpecdecRouter`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    balance = options.balance or PrefixPolicyConfig()
    threads = options.replica_threads or max(1, int(options.replica_cpus))
    return serve.deployment(
        cls, name=name, num_replicas=num_replicas,
        max_ongoing_requests=max(8, settings.max_concurrent),
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=max(30.0, options.health_check_period_s * 5),
        graceful_shutdown_timeout_s=5.0,
        logging_config={"log_level": options.log_level, "enable_access_log": False},
        ray_actor_options={
            "num_cpus": options.replica_cpus / options.ranks,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        **({} if options.ranks == 1 else {  # the replica's ranks (Ray actors) go in bundles 1..N-1
            "placement_group_bundles": [{"CPU": options.replica_cpus / options.ranks}] * options.ranks,
            "placement_group_strategy": options.rank_placement.upper(),
        }),
        request_router_config=RequestRouterConfig(
            request_router_class="specdec.api.cluster.ray_router.SpecdecRouter",
            request_router_kwargs={"policy": options.router, "balance_abs": balance.balance_abs,
                                   "balance_rel": balance.balance_rel, "min_match": balance.min_match},
            request_routing_stats_period_s=options.stats_period_s,
            request_routing_stats_timeout_s=max(10.0, options.stats_period_s * 5),
        ),
    )


def build_engine(config: Any) -> Any:
    """The replicas' engine factory for `specdec serve` (picklable with `functools.partial`)."""
    from specdec.engine import Engine

    return Engine(config)


def start_ray(address: str | None, num_cpus: int | None = None, object_store_bytes: int = 256 << 20,
              log_to_driver: bool = True) -> None:
    """Join the cluster at `address`, or start a local Ray of `num_cpus`: no dashboard, a bounded
    object store, and its workers (the replicas) at niceness 0. Ray starts workers at 15 by
    default (`worker_niceness`), under its own daemons and the clients on the same cores: a
    decode replica's step lost its core whenever one of them woke (steps of 2-3x the median on a
    2-core machine); a prefill replica still lowers its own (`--prefill-nice`). A cluster joined
    at `address` keeps the niceness it was started with (`RAY_worker_niceness=0 ray start ...`)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, object_store_memory=object_store_bytes,
             logging_level=logging.WARNING, log_to_driver=log_to_driver, _system_config={"worker_niceness": 0})


def deploy(engine_factory: Any, settings: Any, options: ClusterOptions, host: str, port: int,
           decode_factory: Any = None) -> None:
    """Start Ray Serve's proxy on host:port and deploy the app (returns once every replica is up)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(engine_factory, settings, options, decode_factory), name=APP_NAME, route_prefix="/",
              blocking=False)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (Ray Serve; pip install -e '.[cluster]')")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve with N engine replicas on Ray Serve, routed by the prefix cache they hold "
                        "(without it: one engine in this process, and Ray is not imported)")
    g.add_argument("--prefill-replicas", type=int, default=0, metavar="M",
                   help="prefill/decode disaggregation: M of the N replicas only prefill prompts (through "
                        "target and draft) and hand both KV caches over; the other N - M decode. "
                        "Pays when long prompts arrive while other streams decode (docs/scaling.md)")
    g.add_argument("--decode-steps", choices=["steady", "adaptive"], default="steady",
                   help="with --prefill-replicas: steady (default): decode replicas draft only where a step "
                        "stays within 1.5x a plain one, keep each step's k (no early stop; another k only for "
                        "a 15%% gain), so the streams' gaps stay even; adaptive: k chosen each step, as a "
                        "colocated replica does")
    g.add_argument("--prefill-nice", type=int, default=ClusterOptions.prefill_nice, metavar="N",
                   help="with --prefill-replicas: the prefill replicas' CPU priority, N steps below the decode "
                        "replicas' (Unix nice; 0: the same), so that decode steps go first where they share cores")
    g.add_argument("--kv-lease-timeout", type=float, default=30.0, metavar="S",
                   help="with --prefill-replicas: a prefill replica frees handed-over KV nobody pulled after S seconds")
    g.add_argument("--kv-pull-timeout", type=float, default=30.0, metavar="S",
                   help="with --prefill-replicas: a decode replica whose pull takes longer recomputes the prompt")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (`ray start --head` on one machine, `ray start --address` "
                        "on the others); default: start a local Ray")
    g.add_argument("--router", choices=POLICIES, default="prefix",
                   help="prefix: the replica holding the longest cached prefix of the prompt (power of two "
                        "choices when queues are unbalanced); pow2; round-robin; one (everything to one "
                        "replica). A request may override it with the x-specdec-router header")
    g.add_argument("--router-balance-abs", type=int, default=PrefixPolicyConfig.balance_abs, metavar="N",
                   help="queues are unbalanced (power of two choices instead of the cache) when the longest "
                        "exceeds the shortest by more than N requests ...")
    g.add_argument("--router-balance-rel", type=float, default=PrefixPolicyConfig.balance_rel, metavar="X",
                   help="... and by more than X times")
    g.add_argument("--router-min-match", type=float, default=PrefixPolicyConfig.min_match, metavar="F",
                   help="a cached prefix counts when it covers at least this fraction of the prompt's blocks")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: this machine's CPUs / N, at least 1)")
    g.add_argument("--route-timeout", type=float, default=120.0, metavar="S",
                   help="a request that no replica takes within S seconds fails")
    g.add_argument("--stall-timeout", type=float, default=300.0, metavar="S",
                   help="a replica whose engine step runs longer than S seconds is replaced")


def run(args: argparse.Namespace, config: Any, settings: Any) -> int:
    """`specdec serve --replicas N`: deploy and serve until interrupted."""
    try:
        from ray import serve
    except ImportError:
        logger.error("--replicas needs Ray Serve: pip install -e '.[cluster]' (or pip install 'ray[serve]')")
        return 2
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    if args.replica_cpus is not None and args.replica_cpus <= 0:
        raise ValueError(f"--replica-cpus must be positive, got {args.replica_cpus}")
    cpus = os.cpu_count() or 1
    replica_cpus = args.replica_cpus or max(1.0, cpus // args.replicas)
    options = ClusterOptions(
        replicas=args.replicas, prefill_replicas=args.prefill_replicas, router=args.router, prefill_nice=args.prefill_nice,
        replica_cpus=replica_cpus, kv_lease_timeout_s=args.kv_lease_timeout, kv_pull_timeout_s=args.kv_pull_timeout,
        route_timeout_s=args.route_timeout, stall_timeout_s=args.stall_timeout, warmup=args.warmup,
        balance=PrefixPolicyConfig(args.router_balance_abs, args.router_balance_rel, args.router_min_match),
        log_level=args.log_level.upper(),
        ranks=config.parallel_size if config.parallel_ranks == "ray" else 1, rank_placement=config.parallel_placement,
    )
    start_ray(args.ray_address, num_cpus=max(cpus, int(replica_cpus * args.replicas)))
    logger.info("deploying %d engine replica(s)%s (%g CPU each, router: %s); /health is 200 once one is ready",
                options.replicas, f", {options.prefill_replicas} of them prefill only" if options.prefill_replicas else "",
                replica_cpus, options.router)
    signal.signal(signal.SIGTERM, _interrupt)  # docker stop, systemd: shut down as on Ctrl-C, even mid-deploy
    started = time.perf_counter()
    try:
        try:
            steady = args.decode_steps == "steady"
            decode = functools.partial(build_engine, dataclasses.replace(
                config, steady_steps=config.steady_steps or steady, kv_resident=True)) if options.prefill_replicas else None
            deploy(functools.partial(build_engine, config), settings, options, args.host, args.port, decode)
        except Exception as exc:  # noqa: BLE001 - e.g. the replicas cannot load the models
            logger.error("deploying the replicas failed: %s", _replica_error() or _last_line(exc))
            return 1
        logger.info("serving %r on http://%s:%d with %d replicas (ready in %.1fs; GET /cluster shows them)",
                    settings.model_name, args.host, args.port, options.replicas, time.perf_counter() - started)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        logger.info("shutting down the replicas")
    finally:
        # a second Ctrl-C / SIGTERM while Ray Serve shuts down must not escape it half done (an
        # uncaught KeyboardInterrupt ends the process by SIGINT, exit -2, with actors left behind; SIGKILL
        # still ends it)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        serve.shutdown()
        if not args.ray_address:
            import ray

            ray.shutdown()
    return 0


def _last_line(exc: BaseException | str) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else repr(exc)


def _replica_error() -> str | None:
    """Why the engine replicas failed to start, from Ray Serve's status (their last error line)."""
    from ray import serve

    try:
        deployments = serve.status().applications[APP_NAME].deployments
    except Exception:  # noqa: BLE001 - no status: fall back to the exception
        return None
    for name in ("EngineReplica", "PrefillReplica"):
        deployment = deployments.get(name)
        if deployment is not None and deployment.message:
            return _last_line(deployment.message)
    return None


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def replica_actor_name(replica_id: str, app: str = APP_NAME, deployment: str = "EngineReplica") -> str:
    """The Ray actor name of an engine replica (as /cluster lists it by id), in Serve's namespace."""
    return f"SERVE_REPLICA::{app}#{deployment}#{replica_id}"


def kill_replica(replica_id: str, app: str = APP_NAME, deployment: str = "EngineReplica") -> None:
    """Kill an engine replica's process now, as a crash would (fault drills; Ray Serve replaces it).
    `deployment`: "PrefillReplica" for a prefill replica."""
    import ray

    ray.kill(ray.get_actor(replica_actor_name(replica_id, app, deployment), namespace="serve"), no_restart=True)
