"""Routing policies and the prefix index, on in-memory workers (no model, no network)."""

from __future__ import annotations

from deepserve.disagg.protocol import BlockEvent, WorkerLoad
from deepserve.router.policies import (
    CacheAware,
    CacheAwareConfig,
    LeastLoad,
    PowerOfTwo,
    RoundRobin,
)
from deepserve.router.pool import Worker
from deepserve.router.prefix_index import PrefixIndex

BS = 4


def worker(name: str, inflight: int = 0, kv: float = 0.0) -> Worker:
    w = Worker(url=f"http://{name}", role="mixed", client=None, worker_id=name, block_size=BS)
    w.inflight = inflight
    w.load = WorkerLoad(role="mixed", running=0, waiting=0, kv_usage=kv)
    return w


def stored(tokens: list[int], bs: int = BS) -> list[BlockEvent]:
    """Events for every full block of `tokens`, keyed by the token prefix itself."""
    events, parent = [], None
    for start in range(0, len(tokens) - bs + 1, bs):
        key = "k" + ",".join(map(str, tokens[: start + bs]))
        events.append(BlockEvent("stored", key, parent, tokens[start : start + bs]))
        parent = key
    return events


def test_round_robin_cycles_through_workers():
    ws = [worker("a"), worker("b"), worker("c")]
    rr = RoundRobin()
    assert [rr.choose(ws, []).url for _ in range(6)] == [w.url for w in ws] * 2


def test_least_load_prefers_shorter_queue_then_lower_kv_usage():
    a, b, c = worker("a", inflight=3), worker("b", inflight=1, kv=0.9), worker("c", inflight=1)
    assert LeastLoad().choose([a, b, c], []) is c


def test_least_load_spreads_ties():
    ws = [worker("a"), worker("b")]
    policy = LeastLoad()
    assert {policy.choose(ws, []).url for _ in range(2)} == {"http://a", "http://b"}


def test_power_of_two_never_picks_the_busier_of_two():
    idle, busy = worker("idle"), worker("busy", inflight=10)
    policy = PowerOfTwo(seed=1)
    assert all(policy.choose([idle, busy], []) is idle for _ in range(20))


def test_prefix_index_matches_longest_prefix_per_worker():
    index = PrefixIndex()
    tokens = list(range(12))
    index.apply("a", stored(tokens))
    index.apply("b", stored(tokens[:4]))
    assert index.match(tokens + [99], BS) == {"a": 12, "b": 4}
    assert index.match([7] + tokens, BS) == {}


def test_prefix_index_forgets_removed_blocks_and_cleared_workers():
    index = PrefixIndex()
    events = stored(list(range(8)))
    index.apply("a", events)
    index.apply("a", [BlockEvent("removed", events[1].key)])
    assert index.match(list(range(8)), BS) == {"a": 4}
    index.apply("a", [BlockEvent("cleared")])
    assert index.match(list(range(8)), BS) == {} and len(index) == 0


def test_prefix_index_stays_bounded():
    index = PrefixIndex(max_blocks=3)
    index.apply("a", stored(list(range(40))))
    assert len(index) == 3


def test_cache_aware_sends_prefix_to_its_holder():
    index = PrefixIndex()
    a, b = worker("a", inflight=2), worker("b")
    conversation = list(range(100, 120))
    index.apply("a", stored(conversation))
    policy = CacheAware(index, CacheAwareConfig(block_size=BS))
    assert policy.choose([a, b], conversation + [1, 2, 3]) is a


def test_cache_aware_falls_back_to_least_load_when_holder_is_overloaded():
    index = PrefixIndex()
    a, b = worker("a", inflight=20), worker("b", inflight=1)
    conversation = list(range(100, 120))
    index.apply("a", stored(conversation))
    policy = CacheAware(index, CacheAwareConfig(block_size=BS, balance_abs=4, balance_rel=1.5))
    assert policy.choose([a, b], conversation) is b


def test_cache_aware_keeps_a_prefix_on_its_holder_a_few_requests_busier():
    index = PrefixIndex()
    a, b = worker("a", inflight=4, kv=0.9), worker("b", inflight=0, kv=0.1)
    conversation = list(range(100, 120))
    index.apply("a", stored(conversation))
    policy = CacheAware(index, CacheAwareConfig(block_size=BS))
    assert policy.choose([a, b], conversation) is a


def test_cache_aware_spreads_unrelated_requests():
    policy = CacheAware(PrefixIndex(), CacheAwareConfig(block_size=BS))
    ws = [worker("a"), worker("b")]
    picks = {policy.choose(ws, [i] * 8).url for i in range(4)}
    assert picks == {"http://a", "http://b"}


def test_round_robin_counts_each_role_separately():
    from deepserve.router.router import Router, RouterConfig

    urls = {"prefill": ("http://p1", "http://p2"), "decode": ("http://d1", "http://d2")}
    router = Router(RouterConfig(workers=urls, policy="round_robin"))
    decodes = []
    for _ in range(4):  # one request = one prefill pick, then one decode pick
        router.pick("prefill", [], set())
        decodes.append(router.pick("decode", [], set()).url)
    assert decodes == ["http://d1", "http://d2"] * 2


def test_cache_aware_keeps_a_burst_sharing_a_new_prefix_on_one_worker():
    # No block events yet (the first request's prefill is still running): the router's own
    # recent routing decision must keep the burst together.
    policy = CacheAware(PrefixIndex(), CacheAwareConfig(block_size=BS))
    ws = [worker("a"), worker("b")]
    system = list(range(500, 520))
    picks = {policy.choose(ws, system + [i]).url for i in range(6)}
    assert len(picks) == 1


def test_recent_routes_expire():
    from deepserve.router.recent_routes import RecentRoutes

    now = [0.0]
    recent = RecentRoutes(ttl_s=5, clock=lambda: now[0])
    recent.record(list(range(8)), BS, "a")
    assert recent.match(list(range(9)), BS) == {"a": 8}
    now[0] = 6.0
    assert recent.match(list(range(9)), BS) == {}


def test_cache_aware_sends_a_new_prefix_to_the_worker_caching_least():
    index = PrefixIndex()
    index.apply("a", stored(list(range(100, 140))))
    policy = CacheAware(index, CacheAwareConfig(block_size=BS))
    assert policy.choose([worker("a"), worker("b")], list(range(900, 940))).url == "http://b"


def test_cache_aware_spreads_chats_that_share_only_the_template():
    """Every chat starts with the template's system prompt; distinct user prompts after it must
    not all follow that one shared block to the first worker that cached it."""
    bs, index = 16, PrefixIndex()
    ws = [worker("a"), worker("b")]
    for w in ws:
        w.block_size = bs
    template = list(range(7000, 7024))  # one full block and a bit
    policy = CacheAware(index, CacheAwareConfig(block_size=bs))
    served = {"a": 0, "b": 0}
    for i in range(40):
        prompt = template + [100 + i * 50 + j for j in range(24)]
        chosen = policy.choose(ws, prompt)
        served[chosen.worker_id] += 1
        index.apply(chosen.worker_id, stored(prompt, bs))  # what the worker publishes
    assert max(served.values()) <= 2 * min(served.values()), served


def test_cache_aware_keeps_a_long_shared_prefix_on_its_holder_among_others():
    bs, index = 16, PrefixIndex()
    a, b = worker("a"), worker("b")
    for w in (a, b):
        w.block_size = bs
    tenant = list(range(3000, 3000 + 20 * bs))  # a tenant's long system prompt
    index.apply("a", stored(tenant + [1, 2, 3], bs))
    index.apply("b", stored(list(range(9000, 9000 + 40 * bs)), bs))  # b caches more
    policy = CacheAware(index, CacheAwareConfig(block_size=bs))
    assert all(policy.choose([a, b], tenant + [50 + i] * 12) is a for i in range(5))


def test_cache_aware_alternates_new_prefixes_between_footprints_small_beside_the_pool():
    """Thirty blocks more in a 50,000-block pool evict nothing: new chats take turns."""
    index = PrefixIndex()
    index.apply("a", stored(list(range(100, 100 + 30 * BS))))
    ws = [worker("a"), worker("b")]
    for w in ws:
        w.load.num_blocks = 50_000
    policy = CacheAware(index, CacheAwareConfig(block_size=BS))
    served = [policy.choose(ws, list(range(900 + 40 * i, 940 + 40 * i))).url for i in range(6)]
    assert served.count("http://a") == served.count("http://b") == 3


def test_a_request_ended_since_the_last_probe_does_not_count_as_load():
    w = worker("a")
    began = w.begin_request()
    w.observe_load(WorkerLoad(role="mixed", running=1, waiting=0, kv_usage=0.0))
    w.end_request(began)
    assert w.load_score() == 0


def test_a_request_opened_after_the_last_probe_counts_once():
    w = worker("a")
    w.observe_load(WorkerLoad(role="mixed", running=1, waiting=0, kv_usage=0.0))  # another router's
    w.end_request(w.begin_request())
    assert w.load_score() == 1
