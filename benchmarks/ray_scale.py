"""Ray Serve scale-out: engine replicas behind one endpoint, and prefix routing against Serve's.

Every configuration is a Serve application from ``inlinelm.serve.ray.build_app`` on a local
Ray instance (``num_cpus=2``, loopback only): echo-runner engines (no weights, the default
model's tokenizer, one 4.5 ms step that releases the GIL, ``num_threads=1``), one Ray CPU per
replica, the ingress on none. Clients are httpx streaming chat completions to 127.0.0.1 in
this process; TTFT is the time to the first frame with content, tokens are the usage
chunk's ``completion_tokens``, tokens/s is their sum over the wall time of the whole load.
Bounded in count and time; each app is deleted before the next, Ray is shut down at the end.

1. **Scaling**: ``--streams`` concurrent streams (``--requests`` in all, distinct prompts,
   ``max_tokens`` 64 with ``ignore_eos``) against 1 and then 2 replicas (``routing="prefix"``;
   ``--scaling-routing prefix serve`` adds Serve's own routing), ``--rounds`` times each
   after a warm-up: tokens/s (median of the rounds), TTFT p50/p99 (all rounds), and the
   2-replica/1-replica ratio of tokens/s. On this 2-core machine the replicas' event loops,
   Serve's proxy, our ingress and this client share the two cores, while the echo steps
   (sleeps) cost none: the engines could emit ~28,000 tokens/s each, so the ratio shows how
   the front end (HTTP, proxy, ingress, Ray's streaming hop, the replica's router and SSE)
   scales with a second replica process, not how a device scales.

2. **Routing**: 2 replicas, ``routing="prefix"`` (our ingress and prefix-affinity router)
   against ``routing="serve"`` (Serve's proxy and its power-of-two-choices router), each on a
   fresh deployment (empty caches): ``--system-prompts`` long system prompts (600-1,000
   tokens, seeded) times ``--turns`` user messages, one chat request each, sent in a seeded
   shuffled order with ``--in-flight`` requests at a time. Per routing: the prefix-cache
   hit rate over both replicas (hit over queried tokens, deltas of each replica's
   ``record_routing_stats()``, read from its Serve actor), TTFT mean/p50/p99, tokens/s, and
   the requests each replica finished (the stats' ``finished`` deltas; prefix-routed
   responses also name their replica in ``x-inlinelm-replica``, which is cross-checked).

   Each runs twice: with the echo's default KV cache (16,384 blocks at 128 sequences, so a
   replica keeps every system prompt and a miss happens only the first time a prompt
   reaches a replica), and with ``--kv-blocks`` per replica (320 of 16 tokens: about six of
   the eight ~50-block system prompts beside the requests in flight), as a replica serving
   many tenants does: enough for the prompts a prefix-routed replica sees, not for all of
   them, which every replica sees under Serve's routing and evicts in turn. The echo step
   costs the same whatever its token count, so a miss costs time only through the token
   budget: ``max_num_batched_tokens=512`` makes a 600-1,000-token prefill take two or more
   steps (more while other requests' prefills and decodes share the budget), where the
   default 2,048 would prefill several misses in one 4.5 ms step and hide them.

Where the cores go: after each table, the cores each role kept busy during the loads (CPU
seconds from ``/proc`` over wall seconds): this client, Serve's proxy and controller, the
ingress (prefix routing only), the engine replicas, and "other", the rest of the machine
(Ray's own daemons, and anything else running: a busy "other" means a disturbed run).
These machines are shared and noisy: quote medians and ratios, check the load (printed).

    python benchmarks/ray_scale.py            # about 2 minutes on this machine, 4 at most
    python benchmarks/ray_scale.py --quick    # about 1 minute: 1 round, 20 turns, tight cache
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    QUESTIONS,
    RESULTS,
    load_average,
    median,
    percentile,
    pyplot,
    save_plot,
    write_json,
)
from inlinelm.config import EngineConfig
from inlinelm.serve.ray import DEFAULT_STREAM_BATCH_S, build_app

STEP_S = 0.0045
REPLICA_DEPLOYMENTS = ("InlineLMReplica", "InlineLMServer")
DEPLOY_TIMEOUT_S = 120.0
STATS_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 180.0
ROUTING_MAX_MODEL_LEN = 2048  # the tight cache must hold one whole context
CHARS_PER_TOKEN = 4.7  # the default model's tokenizer on the English sentences below

SENTENCES = [
    "Always answer in the customer's language and keep a friendly, professional tone.",
    "Quote the section of the policy you rely on, and never promise what it does not allow.",
    "If an order number is missing, ask for it before looking anything up.",
    "Refunds over two hundred euros need a supervisor's approval; say so plainly.",
    "Do not reveal internal tooling, ticket identifiers or the names of colleagues.",
    "When a question is ambiguous, restate it in one sentence and ask which reading is meant.",
    "Prefer short paragraphs and numbered steps for anything the customer must do.",
    "Shipping to islands and overseas territories takes five to nine working days.",
    "A damaged parcel must be photographed before it is opened, if at all possible.",
    "Warranty claims need the serial number, the date of purchase and a short description.",
    "Escalate threats, legal questions and press enquiries to a human without delay.",
    "Never guess a delivery date: read it from the carrier's tracking page or say you cannot.",
    "Summarise long threads before answering, so the customer sees what was understood.",
    "Discount codes cannot be combined, and expired codes are not reissued.",
    "Accessibility requests are always granted; offer large print and audio formats.",
    "Close every answer by asking whether anything else is needed.",
]
DESKS = ["billing", "returns", "shipping", "warranty", "accounts", "retail", "b2b", "press"]


# -- workloads ----------------------------------------------------------------------------


def system_prompts(count: int, rng: random.Random) -> list[str]:
    """``count`` distinct system prompts of 600-1,000 tokens each, from ``rng``."""
    prompts = []
    for k in range(count):
        target_chars = rng.randint(600, 1000) * CHARS_PER_TOKEN
        parts = [f"You are support agent {k} of the {DESKS[k % len(DESKS)]} desk (team {k})."]
        while sum(len(p) + 1 for p in parts) < target_chars:
            parts.append(rng.choice(SENTENCES))
        prompts.append(" ".join(parts))
    return prompts


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": "default",
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


def scaling_bodies(count: int, max_tokens: int, salt: str) -> list[bytes]:
    """Distinct short chats (no shared system prompt: the key is the user turn)."""
    return [
        chat_body(
            [{"role": "user", "content": f"Request {salt}-{i}. {QUESTIONS[i % len(QUESTIONS)]}"}],
            max_tokens,
        )
        for i in range(count)
    ]


def routing_bodies(
    prompts: list[str], turns: int, max_tokens: int, rng: random.Random
) -> list[bytes]:
    """One chat per (system prompt, turn), in a shuffled order from ``rng``."""
    pairs = [(k, t) for k in range(len(prompts)) for t in range(turns)]
    rng.shuffle(pairs)
    return [
        chat_body(
            [
                {"role": "system", "content": prompts[k]},
                {"role": "user", "content": f"Turn {t}: {QUESTIONS[t % len(QUESTIONS)]}"},
            ],
            max_tokens,
        )
        for k, t in pairs
    ]


# -- the client ---------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Outcome:
    status: int
    ttft_s: float | None = None
    tokens: int = 0
    replica: str | None = None
    error: str | None = None


@dataclasses.dataclass(slots=True)
class Load:
    """What one load run measured."""

    wall_s: float
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200 and o.error is None]

    @property
    def tokens(self) -> int:
        return sum(o.tokens for o in self.ok)

    @property
    def ttfts_ms(self) -> list[float]:
        return [o.ttft_s * 1000 for o in self.ok if o.ttft_s is not None]

    @property
    def num_failed(self) -> int:
        return len(self.outcomes) - len(self.ok)


async def stream_chat(client: httpx.AsyncClient, body: bytes) -> Outcome:
    """POST one streamed chat; its status, TTFT (first content frame) and usage tokens."""
    start = time.perf_counter()
    headers = {"content-type": "application/json"}
    try:
        async with client.stream(
            "POST", "/v1/chat/completions", content=body, headers=headers
        ) as r:
            outcome = Outcome(r.status_code, replica=r.headers.get("x-inlinelm-replica"))
            if r.status_code != 200:
                outcome.error = (await r.aread())[:200].decode(errors="replace")
                return outcome
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if outcome.ttft_s is None and '"content":"' in line and '"content":""' not in line:
                    outcome.ttft_s = time.perf_counter() - start
                elif '"usage":{' in line:
                    outcome.tokens = orjson.loads(line[6:])["usage"]["completion_tokens"]
                elif '"error":' in line:
                    outcome.error = line[6:206]
            return outcome
    except httpx.HTTPError as exc:
        return Outcome(0, error=repr(exc)[:200])


async def _run_load(port: int, bodies: list[bytes], in_flight: int) -> Load:
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    timeout = httpx.Timeout(60.0)
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=timeout
    ) as client:

        async def one(body: bytes) -> Outcome:
            async with gate:
                return await stream_chat(client, body)

        start = time.perf_counter()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(one(b) for b in bodies)), timeout=LOAD_TIMEOUT_S
        )
        return Load(time.perf_counter() - start, list(outcomes))


def run_load(
    port: int, bodies: list[bytes], in_flight: int, pids: dict[str, list[int]] | None = None
) -> Load:
    """Send ``bodies`` with at most ``in_flight`` streams open; wait for all of them.

    With ``pids`` (by role), the load's ``cpu_s`` holds each role's CPU seconds over it.
    """
    before = cpu_snapshot(pids or {})
    load = asyncio.run(_run_load(port, bodies, in_flight))
    after = cpu_snapshot(pids or {})
    load.cpu_s = {role: after[role] - before[role] for role in after}
    return load


# -- where the cores go ---------------------------------------------------------------------

CPU_ROLES = ("client", "proxy", "ingress", "replicas", "controller", "other")


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (not idle, not waiting for I/O) since boot."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far by role; ``other`` is the rest of the machine (Ray's own daemons,
    and anything else that runs)."""
    snapshot = {role: sum(process_cpu_s(p) for p in ps) for role, ps in pids.items()}
    snapshot["other"] = machine_busy_s() - sum(snapshot.values())
    return snapshot


def cores(loads: list[Load]) -> dict[str, float]:
    """Cores each role kept busy over ``loads``: CPU seconds over wall seconds."""
    wall = sum(load.wall_s for load in loads)
    return {role: sum(load.cpu_s.get(role, 0.0) for load in loads) / wall for role in CPU_ROLES}


# -- Ray and Serve --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ray() -> int:
    """A local Ray instance and Serve's proxy on a free loopback port; returns the port."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # no line per deploy and delete
    return port


def deploy(
    name: str, config: EngineConfig, num_replicas: int, routing: str, stream_batch_s: float
) -> None:
    """Run the app and wait (bounded) until it is ready and all its replicas are named."""
    app = build_app(
        config,
        num_replicas=num_replicas,
        routing=routing,
        ray_actor_options={"num_cpus": 1},
        stream_batch_s=stream_batch_s,
    )
    errors: list[BaseException] = []

    def target() -> None:
        try:
            serve.run(app, name=name, route_prefix="/")
        except BaseException as exc:  # NOTE: re-raised in the caller's thread
            errors.append(exc)

    # NOTE: serve.run has no timeout (a replica Ray cannot place waits forever)
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEPLOY_TIMEOUT_S)
    if thread.is_alive():
        raise TimeoutError(f"app {name} not ready after {DEPLOY_TIMEOUT_S:.0f} s")
    if errors:
        raise errors[0]
    deadline = time.monotonic() + 30
    while len(replica_actors(name)) < num_replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"app {name}: replicas not listed")
        time.sleep(0.2)


def replica_actors(app: str) -> list[str]:
    """The Serve actor names of ``app``'s engine replicas."""
    prefixes = tuple(f"SERVE_REPLICA::{app}#{d}#" for d in REPLICA_DEPLOYMENTS)
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefixes)
    )


def role_pids(app: str) -> dict[str, list[int]]:
    """The process ids of this client, Serve's proxy and controller, and ``app``'s ingress
    and engine replicas."""
    pids: dict[str, list[int]] = {role: [] for role in CPU_ROLES[:-1]}
    pids["client"].append(os.getpid())
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if actor["namespace"] != "serve":
            continue
        if name.startswith("SERVE_PROXY_ACTOR"):
            role = "proxy"
        elif name == "SERVE_CONTROLLER_ACTOR":
            role = "controller"
        elif name.startswith(f"SERVE_REPLICA::{app}#InlineLMIngress#"):
            role = "ingress"
        elif name.startswith(tuple(f"SERVE_REPLICA::{app}#{d}#" for d in REPLICA_DEPLOYMENTS)):
            role = "replicas"
        else:
            continue
        handle = ray.get_actor(name, namespace="serve")
        # NOTE: a lambda travels by value (a module function of this script would not be
        # importable in the actor when the script is imported as a module)
        pid = handle.__ray_call__.remote(lambda _: os.getpid())
        pids[role].append(ray.get(pid, timeout=STATS_TIMEOUT_S))
    return pids


def replica_stats(app: str) -> dict[str, dict[str, Any]]:
    """Each engine replica's ``record_routing_stats()``, by replica id."""
    actors = [ray.get_actor(name, namespace="serve") for name in replica_actors(app)]
    stats = ray.get([a.record_routing_stats.remote() for a in actors], timeout=STATS_TIMEOUT_S)
    return {s["replica_id"]: s for s in stats}


def stats_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict:
    """Per replica: prefix-cache hit and queried tokens and finished requests since ``before``."""
    delta = {}
    for rid, now in after.items():
        then = before.get(rid, {})
        delta[rid] = {
            "hit_tokens": now["prefix_cache_hit_tokens"] - then.get("prefix_cache_hit_tokens", 0),
            "queried_tokens": now["prefix_cache_queried_tokens"]
            - then.get("prefix_cache_queried_tokens", 0),
            "finished": sum(now["finished"].values()) - sum(then.get("finished", {}).values()),
            "kv_blocks_total": now["kv_blocks_total"],
        }
    return delta


# -- part 1: scaling ----------------------------------------------------------------------


def scaling(port: int, args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """By routing: the 1- and 2-replica runs and the ratio of their tokens/s."""
    results: dict[str, Any] = {}
    for routing in args.scaling_routing:
        runs = {str(n): scaling_run(port, args, config, n, routing) for n in (1, 2)}
        runs["ratio_2_over_1"] = runs["2"]["tokens_per_s"] / runs["1"]["tokens_per_s"]
        results[routing] = runs
    return results


def scaling_run(
    port: int, args: argparse.Namespace, config: EngineConfig, num_replicas: int, routing: str
) -> dict[str, Any]:
    name = f"scale-{routing}-{num_replicas}"
    # NOTE: "prefix-each-step" is prefix routing with stream_batch_s=0: a Ray item per step
    batch_s = 0.0 if routing == "prefix-each-step" else args.stream_batch_s
    deploy(name, config, num_replicas, routing.removesuffix("-each-step"), batch_s)
    try:
        run_load(port, scaling_bodies(16, 8, f"warm-{name}"), 16)
        pids = role_pids(name)
        loads = [
            run_load(
                port,
                scaling_bodies(args.requests, args.max_tokens, f"{name}.{r}"),
                args.streams,
                pids,
            )
            for r in range(args.rounds)
        ]
        finished = [d["finished"] for d in stats_delta({}, replica_stats(name)).values()]
    finally:
        serve.delete(name)
    ttfts = [t for load in loads for t in load.ttfts_ms]
    return {
        "tokens_per_s": median([load.tokens / load.wall_s for load in loads]),
        "tokens_per_s_rounds": [load.tokens / load.wall_s for load in loads],
        "wall_s_rounds": [load.wall_s for load in loads],
        "tokens_per_s_all": sum(load.tokens for load in loads) / sum(load.wall_s for load in loads),
        "tokens": sum(load.tokens for load in loads),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "failed": sum(load.num_failed for load in loads),
        "errors": [o.error for load in loads for o in load.outcomes if o.error][:5],
        "finished_per_replica": sorted(finished, reverse=True),
        "cores": cores(loads),
    }


def print_scaling(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n1. scaling: {args.streams} streams, {args.requests} requests x {args.max_tokens} "
        f"tokens, {args.rounds} rounds (tokens/s: their median)"
    )
    print(
        f"{'routing':>7} {'replicas':>8} {'tokens/s':>9} {'rounds':>20} {'TTFT p50':>9} "
        f"{'p99 ms':>8} {'failed':>6}  finished per replica (with warm-up)"
    )
    for routing, runs in results.items():
        for n in ("1", "2"):
            r = runs[n]
            rounds = ", ".join(f"{v:.0f}" for v in r["tokens_per_s_rounds"])
            print(
                f"{routing:>7} {n:>8} {r['tokens_per_s']:>9.0f} {rounds:>20} "
                f"{r['ttft_ms_p50']:>9.1f} {r['ttft_ms_p99']:>8.1f} {r['failed']:>6}  "
                f"{r['finished_per_replica']}"
            )
    for routing, runs in results.items():
        print(f"{routing}: 2 replicas / 1 replica, tokens/s: {runs['ratio_2_over_1']:.2f}x")
    print_cores(
        [
            (f"{routing} {n} repl.", runs[n]["cores"], runs[n]["tokens_per_s_all"])
            for routing, runs in results.items()
            for n in ("1", "2")
        ]
    )


def print_cores(rows: list[tuple[str, dict[str, float], float]]) -> None:
    """Cores each role kept busy during the loads (of the machine's ``os.cpu_count()``), and
    the CPU all of them but "other" spent per streamed token, given each row's tokens/s."""
    print(f"cores busy during the load (of {os.cpu_count()}); other: Ray's daemons and the rest")
    header = "".join(f"{role:>11}" for role in CPU_ROLES)
    print(f"{'':>19}{header}{'total':>8}{'µs/token':>10}")
    for label, use, tokens_per_s in rows:
        cells = "".join(f"{use[role]:>11.2f}" for role in CPU_ROLES)
        per_token = (sum(use.values()) - use["other"]) / tokens_per_s * 1e6
        print(f"{label:>19}{cells}{sum(use.values()):>8.2f}{per_token:>10.0f}")


# -- part 2: routing ----------------------------------------------------------------------


def routing_run(
    port: int, args: argparse.Namespace, config: EngineConfig, routing: str, tag: str
) -> dict[str, Any]:
    name = f"route-{routing}-{tag}"
    deploy(name, config, 2, routing, args.stream_batch_s)
    try:
        run_load(port, scaling_bodies(8, 4, f"warm-{name}"), 8)
        pids = role_pids(name)
        before = replica_stats(name)
        rng = random.Random(args.seed)
        prompts = system_prompts(args.system_prompts, rng)
        bodies = routing_bodies(prompts, args.turns, args.routing_max_tokens, rng)
        load = run_load(port, bodies, args.in_flight, pids)
        after = replica_stats(name)
    finally:
        serve.delete(name)
    delta = stats_delta(before, after)
    hit = sum(d["hit_tokens"] for d in delta.values())
    queried = sum(d["queried_tokens"] for d in delta.values())
    by_header: dict[str, int] = {}
    for o in load.ok:
        if o.replica is not None:
            by_header[o.replica] = by_header.get(o.replica, 0) + 1
    ttfts = load.ttfts_ms
    return {
        "routing": routing,
        "kv_blocks_per_replica": next(iter(delta.values()))["kv_blocks_total"],
        "requests": len(load.outcomes),
        "failed": load.num_failed,
        "errors": [o.error for o in load.outcomes if o.error][:5],
        "hit_rate": hit / queried if queried else float("nan"),
        "hit_tokens": hit,
        "queried_tokens": queried,
        "prompt_tokens_mean": queried / len(load.outcomes) if load.outcomes else float("nan"),
        "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "ttfts_ms": ttfts,
        "tokens_per_s": load.tokens / load.wall_s,
        "wall_s": load.wall_s,
        "finished_per_replica": sorted((d["finished"] for d in delta.values()), reverse=True),
        "header_per_replica": sorted(by_header.values(), reverse=True),
        "per_replica": delta,
        "cores": cores([load]),
    }


def routing_comparison(port: int, args: argparse.Namespace, config: EngineConfig) -> list[dict]:
    """Prefix against Serve routing, with each KV cache in ``args.caches``."""
    sizes = {"ample": None, "tight": args.kv_blocks}
    rows = []
    for cache in args.caches:
        for routing in ("prefix", "serve"):
            sized = config.with_options(num_kv_blocks=sizes[cache])
            row = routing_run(port, args, sized, routing, cache)
            row["cache"] = cache
            rows.append(row)
    return rows


def print_routing(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\n2. routing: 2 replicas, {args.system_prompts} system prompts x {args.turns} turns "
        f"({args.system_prompts * args.turns} requests), {args.in_flight} in flight, "
        f"{args.routing_max_tokens} tokens each, max_num_batched_tokens {args.batched_tokens}"
    )
    print(
        f"{'KV cache':>13} {'routing':>7} {'hit rate':>8} {'TTFT mean':>9} {'p50':>7} "
        f"{'p99 ms':>7} {'tokens/s':>8} {'failed':>6}  finished per replica (header)"
    )
    for r in rows:
        cache = f"{r['cache']} {r['kv_blocks_per_replica']}"
        header = f" ({r['header_per_replica']})" if r["header_per_replica"] else ""
        print(
            f"{cache:>13} {r['routing']:>7} {r['hit_rate']:>8.1%} {r['ttft_ms_mean']:>9.1f} "
            f"{r['ttft_ms_p50']:>7.1f} {r['ttft_ms_p99']:>7.1f} {r['tokens_per_s']:>8.0f} "
            f"{r['failed']:>6}  {r['finished_per_replica']}{header}"
        )
    print(f"mean prompt tokens (queried / requests): {rows[0]['prompt_tokens_mean']:.0f}")
    print_cores([(f"{r['cache']} {r['routing']}", r["cores"], r["tokens_per_s"]) for r in rows])


def plot(rows: list[dict]) -> None:
    """TTFT distributions, prefix against Serve routing, one panel per KV cache."""
    plt = pyplot()
    if plt is None:
        return
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    fig, axes = plt.subplots(1, len(caches), figsize=(5 * len(caches), 4), squeeze=False)
    for ax, cache in zip(axes[0], caches, strict=True):
        picked = [r for r in rows if r["cache"] == cache]
        for r in picked:
            values = sorted(r["ttfts_ms"])
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot(values, ys, label=f"{r['routing']} routing (hit rate {r['hit_rate']:.0%})")
        ax.set_xscale("log")
        ax.set_xlabel("TTFT ms")
        ax.set_title(f"{cache} KV cache ({picked[0]['kv_blocks_per_replica']} blocks per replica)")
        ax.legend()
    axes[0][0].set_ylabel("fraction of requests")
    save_plot(fig, "ray_scale.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json", default=str(RESULTS / "ray_scale.json"), help="write results here"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run of about 1 minute")
    parser.add_argument("--streams", type=int, default=128, help="part 1: streams in flight")
    parser.add_argument("--requests", type=int, default=256, help="part 1: requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="part 1: tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="part 1: rounds per replica count")
    parser.add_argument(
        "--scaling-routing",
        nargs="+",
        choices=["prefix", "prefix-each-step", "serve"],
        default=["prefix"],
        help="part 1: the routings to scale (serve: Serve's proxy straight to the replicas; "
        "prefix-each-step: prefix with --stream-batch-s 0, side by side)",
    )
    parser.add_argument("--system-prompts", type=int, default=8, help="part 2")
    parser.add_argument("--turns", type=int, default=50, help="part 2: requests per prompt")
    parser.add_argument("--in-flight", type=int, default=32, help="part 2: requests in flight")
    parser.add_argument("--routing-max-tokens", type=int, default=32, help="part 2")
    parser.add_argument("--batched-tokens", type=int, default=512, help="part 2: token budget")
    parser.add_argument("--kv-blocks", type=int, default=320, help="part 2: the tight cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stream-batch-s",
        type=float,
        default=DEFAULT_STREAM_BATCH_S,
        help="build_app's stream_batch_s: a stream's frames gathered per Ray item (0: each step)",
    )
    parser.add_argument("--parts", nargs="+", choices=["1", "2"], default=["1", "2"])
    parser.add_argument(
        "--caches", nargs="+", choices=["ample", "tight"], default=["ample", "tight"], help="part 2"
    )
    args = parser.parse_args()
    if args.quick:
        args.streams, args.requests, args.rounds, args.turns = 64, 128, 1, 20
        args.caches = ["tight"]
    base = EngineConfig(
        model="default",
        runner="echo",
        echo_step_s=STEP_S,
        num_threads=1,
        max_num_seqs=max(args.streams, args.in_flight),
    )
    routing_config = base.with_options(
        max_num_batched_tokens=args.batched_tokens, max_model_len=ROUTING_MAX_MODEL_LEN
    )
    load_before = load_average()
    print(f"load average {load_before}; echo step {STEP_S * 1000} ms; {os.cpu_count()} CPUs")
    port = start_ray()
    scale: dict[str, Any] = {}
    routed: list[dict[str, Any]] = []
    try:
        if "1" in args.parts:
            scale = scaling(port, args, base)
            print_scaling(scale, args)
        if "2" in args.parts:
            routed = routing_comparison(port, args, routing_config)
            print_routing(routed, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"load average after: {load_average()}")
    if routed:
        plot(routed)
    write_json(
        args.json,
        {
            "args": vars(args),
            "engine_scaling": dataclasses.asdict(base),
            "engine_routing": dataclasses.asdict(routing_config),
            "cpus": os.cpu_count(),
            "scaling": scale,
            "routing": routed,
            "load_average_before": load_before,
            "load_average": load_average(),
        },
    )


if __name__ == "__main__":
    main()
