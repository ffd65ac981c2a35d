"""sdk.routes: the route cache, its TTL, and what it does when the MetaServer is down."""

from __future__ import annotations

import logging

import pytest

from wire.errors import BadRequest, NoRoute
from sdk.routes import MetaUnavailable, RouteCache, parse_route
from tests.unit.test_sdk_fakes import broker_a, broker_b, meta  # noqa: F401  (fixtures)


class FakeClock:
    def __init__(self) -> None:
        self.now_ms = 0

    def __call__(self) -> int:
        return self.now_ms


async def test_a_route_is_fetched_once_and_reused_until_its_ttl_ends(meta, broker_a):
    meta.set_route("orders", [broker_a])
    clock = FakeClock()
    cache = RouteCache(meta.url, ttl_ms=30_000, clock_ms=clock)
    first = await cache.get("orders", "producer")
    clock.now_ms = 29_999
    assert await cache.get("orders", "producer") is first
    assert len(meta.route_requests) == 1
    clock.now_ms = 30_000
    await cache.get("orders", "producer")
    await cache.close()
    assert len(meta.route_requests) == 2
    assert meta.route_requests[0] == {"subject": "orders", "role": "producer", "kind": "realtime"}
    assert [g.addresses for g in first.groups] == [(broker_a.address,)]


async def test_refresh_sees_a_changed_route_at_once(meta, broker_a, broker_b):
    meta.set_route("orders", [broker_a])
    cache = RouteCache(meta.url)
    assert [g.group for g in (await cache.get("orders", "consumer")).groups] == ["group-a"]
    meta.set_route("orders", [broker_a, broker_b])
    route = await cache.refresh("orders", "consumer")
    await cache.close()
    assert [g.group for g in route.groups] == ["group-a", "group-b"]
    assert route.version == meta.version


async def test_a_refresh_with_a_max_age_takes_an_answer_younger_than_it(meta, broker_a):
    meta.set_route("orders", [broker_a])
    clock = FakeClock()
    cache = RouteCache(meta.url, ttl_ms=30_000, clock_ms=clock)
    first = await cache.get("orders", "consumer")
    clock.now_ms = 14_999
    assert await cache.refresh("orders", "consumer", max_age_ms=15_000) is first
    assert len(meta.route_requests) == 1
    clock.now_ms = 15_000
    await cache.refresh("orders", "consumer", max_age_ms=15_000)
    assert len(meta.route_requests) == 2
    await cache.refresh("orders", "consumer")  # no max age: asked at once
    assert len(meta.route_requests) == 3
    await cache.close()


async def test_the_consumers_of_a_loop_share_one_route_cache_per_metaserver_and_token(meta):
    made = []

    def make() -> RouteCache:
        made.append(RouteCache(meta.url))
        return made[-1]

    first = RouteCache.shared((meta.url, None, None), make)
    assert RouteCache.shared((meta.url, None, None), make) is first
    assert RouteCache.shared((meta.url, "token", None), make) is not first
    assert len(made) == 2


async def test_the_cached_route_is_served_with_a_warning_when_the_metaserver_is_down(
    meta, broker_a, caplog
):
    meta.set_route("orders", [broker_a])
    clock = FakeClock()
    cache = RouteCache(meta.url, ttl_ms=1_000, stale_retry_ms=500, clock_ms=clock)
    cached = await cache.get("orders", "producer")
    await meta.stop()
    clock.now_ms = 5_000
    with caplog.at_level(logging.WARNING, logger="sdk.routes"):
        assert await cache.get("orders", "producer") is cached
    assert "unreachable" in caplog.text and "cached" in caplog.text
    # The stale route is reused for stale_retry_ms without asking again.
    caplog.clear()
    clock.now_ms = 5_499
    assert await cache.get("orders", "producer") is cached
    assert caplog.text == ""
    await cache.close()


async def test_with_the_metaserver_down_and_nothing_cached_the_caller_gets_no_route(meta):
    url = meta.url
    await meta.stop()
    cache = RouteCache(url)
    with pytest.raises(NoRoute) as caught:
        await cache.get("orders", "producer")
    await cache.close()
    assert "unreachable" in str(caught.value)


async def test_an_explicit_no_route_answer_drops_the_cached_route(meta, broker_a):
    meta.set_route("orders", [broker_a])
    cache = RouteCache(meta.url)
    await cache.get("orders", "consumer")
    meta.set_route("orders", [])
    with pytest.raises(NoRoute):
        await cache.refresh("orders", "consumer")
    assert cache.cached("orders", "consumer") is None
    await cache.close()


async def test_the_metaserver_heartbeat_carries_the_client_and_its_subjects(meta):
    cache = RouteCache(meta.url)
    await cache.client_heartbeat(client_id="c1", app="shop", group="billing",
                                 subjects=["orders"], role="consumer")
    await cache.close()
    assert meta.heartbeats == [{"client_id": "c1", "app": "shop", "group": "billing",
                                "subjects": ["orders"], "role": "consumer"}]


def test_a_route_answer_of_the_wrong_shape_is_treated_as_an_unavailable_metaserver():
    with pytest.raises(MetaUnavailable):
        parse_route({"version": 1, "groups": [{"group": "g", "addresses": "h:1"}]}, "s", "producer")
    with pytest.raises(MetaUnavailable):
        parse_route({"version": "1", "groups": []}, "s", "producer")
    with pytest.raises(MetaUnavailable):
        parse_route([], "s", "producer")


def test_groups_without_addresses_are_left_out_of_a_route():
    route = parse_route(
        {"version": 3, "groups": [
            {"group": "a", "kind": "realtime", "state": "rw", "addresses": []},
            {"group": "b", "kind": "realtime", "state": "readonly", "addresses": ["h:1"]},
        ]},
        "s", "consumer",
    )
    assert [(g.group, g.state) for g in route.groups] == [("b", "readonly")]
    assert route.group("b") is not None and route.group("a") is None


async def test_a_4xx_answer_with_a_code_raises_that_error_and_is_not_served_from_cache(meta):
    cache = RouteCache(meta.url)
    with pytest.raises(BadRequest) as caught:
        await cache.get("bad subject", "producer")
    await cache.close()
    assert caught.value.code == "bad_request"
    assert "bad subject" in str(caught.value)


async def test_an_answer_that_is_not_json_counts_as_an_unavailable_metaserver(meta):
    cache = RouteCache(meta.url)
    with pytest.raises(MetaUnavailable):
        await cache._call("GET", "/api/nothing-here")
    await cache.close()


# -- several MetaServers ---------------------------------------------------------------------------


async def test_a_route_comes_from_the_next_metaserver_when_the_first_is_gone(meta, broker_a):
    from tests.harness import free_port

    meta.set_route("orders", [broker_a])
    dead = f"http://127.0.0.1:{free_port()}"
    cache = RouteCache([dead, meta.url])
    try:
        route = await cache.get("orders", "producer")
        assert [g.group for g in route.groups] == ["group-a"]
        assert cache.meta.url == meta.url, "the one that answered is asked first from now on"
        await cache.refresh("orders", "producer")
        assert len(meta.route_requests) == 2
    finally:
        await cache.close()


async def test_a_no_route_answer_is_the_services_word_and_not_asked_elsewhere(meta):
    from tests.unit.test_sdk_fakes import FakeMeta

    other = await FakeMeta().start()
    cache = RouteCache(f"{meta.url},{other.url}")
    try:
        with pytest.raises(NoRoute):
            await cache.get("orders", "producer")
        assert other.route_requests == []
    finally:
        await cache.close()
        await other.stop()


async def test_with_every_metaserver_down_the_error_names_each_one(meta, broker_a):
    from tests.harness import free_port

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    cache = RouteCache(",".join(urls))
    try:
        with pytest.raises(NoRoute) as failed:
            await cache.get("orders", "producer")
        assert "any of 2 MetaServers" in failed.value.message
        assert all(url in failed.value.message for url in urls)
    finally:
        await cache.close()


@pytest.mark.parametrize(("value", "urls"), [
    ("http://a:1", ("http://a:1",)),
    ("http://a:1/, https://b:2", ("http://a:1", "https://b:2")),
    (["http://a:1", "http://b:2,http://a:1"], ("http://a:1", "http://b:2")),
])
def test_metaserver_urls_are_a_list_or_comma_separated_in_order_without_repeats(value, urls):
    from wire.http import parse_meta_urls

    assert parse_meta_urls(value) == urls


@pytest.mark.parametrize("value", ["", ",", "a:1", "ftp://x", ["http://a", 5]])
def test_a_metaserver_url_list_without_urls_or_with_a_bad_one_is_refused(value):
    from wire.http import parse_meta_urls

    with pytest.raises(ValueError):
        parse_meta_urls(value)


def test_up_to_sixteen_metaserver_urls_are_accepted_and_seventeen_are_refused():
    from wire.http import META_URLS_MAX, parse_meta_urls

    urls = [f"http://h{i}:1" for i in range(META_URLS_MAX + 1)]
    assert len(parse_meta_urls(urls[:META_URLS_MAX])) == META_URLS_MAX
    with pytest.raises(ValueError, match="17 MetaServer URLs exceed META_URLS_MAX 16"):
        parse_meta_urls(urls)
