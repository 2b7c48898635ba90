"""Which switches a job, a builder and a builder's child get for the per-key tier."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from cachekeeper import remote_tier as rt

ON = rt.site_switches(tier=True)


def test_a_site_with_the_tier_switches_the_four_remote_caches_and_never_bundled_autotune() -> None:
    assert ON == {rt.FX_GRAPH: "1", rt.AOTAUTOGRAD: "1", rt.AUTOTUNE: "1", rt.PGO: "1"}
    assert rt.BUNDLED_AUTOTUNE not in ON
    assert rt.site_switches(tier=False) == {}
    assert rt.key_switches(ON) == {rt.AOTAUTOGRAD: "1"}


def test_a_job_on_the_tier_exports_every_switch_and_the_url() -> None:
    assert rt.job_environ(ON, url="redis://h:1/0") == {**ON, rt.URL: "redis://h:1/0"}


def test_a_job_off_the_tier_keeps_the_keyed_switch_and_a_url_that_connects_nowhere() -> None:
    # Keys stay those of the snapshots built with the switch; torch never reaches localhost:6379.
    assert rt.job_environ(ON, url=None) == {rt.AOTAUTOGRAD: "1", rt.URL: rt.OFF_URL}
    assert rt.job_environ({}, url=None) == {}


def test_children_keep_the_switches_but_lose_every_way_to_the_tier() -> None:
    env = {**ON, rt.URL: "redis://:tok@h:1/0", "TORCHINDUCTOR_REDIS_HOST": "h", "PATH": "/bin"}
    child = rt.isolated(env)
    assert child == {**ON, rt.URL: rt.OFF_URL, "PATH": "/bin"}
    # No switch on: still no way to the tier, in case the builder's code turns one on itself.
    plain = {"PATH": "/bin", "TORCHINDUCTOR_REDIS_HOST": "h"}
    assert rt.isolated(plain) == {"PATH": "/bin", rt.URL: rt.OFF_URL}


def test_the_agent_carries_exactly_the_site_switches() -> None:
    env = {
        "PATH": "/bin",
        rt.FX_GRAPH: "0",
        rt.URL: "redis://x:1/0",
        "TORCHINDUCTOR_REDIS_PORT": "1",
    }
    rt.set_builder_switches(env, ON)
    assert env == {"PATH": "/bin", **ON, rt.URL: rt.OFF_URL}
    rt.set_builder_switches(env, {})
    assert env == {"PATH": "/bin"}


def test_the_server_ranks_for_the_env_the_job_will_run_in() -> None:
    fp = {"torch": "2.13", "env": {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", rt.AOTAUTOGRAD: "0"}}
    assert rt.with_key_switches(fp, ON)["env"] == {
        rt.AOTAUTOGRAD: "1",
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
    }
    assert rt.with_key_switches(fp, {})["env"] == {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    user_set = {"env": {rt.BUNDLED_AUTOTUNE: "1"}}  # the user's own: kept, it is in the key
    assert rt.with_key_switches(user_set, ON)["env"] == {
        rt.AOTAUTOGRAD: "1",
        rt.BUNDLED_AUTOTUNE: "1",
    }


def test_the_url_carries_the_token_timeouts_and_name_quoted() -> None:
    url = rt.tier_url(
        "https://cache.example:8750/",
        port=6380,
        token="a/b:c@d",
        name=rt.client_name("n 1", "f" * 64),
    )
    parts = urlsplit(url)
    assert parts.scheme == "redis" and parts.hostname == "cache.example" and parts.port == 6380
    assert parts.password == "a%2Fb%3Ac%40d"  # redis-py unquotes it
    query = parse_qs(parts.query)
    assert query["socket_timeout"] == ["2"] and query["socket_connect_timeout"] == ["1"]
    assert query["client_name"] == ["ck:n_1:ffffffffffff"]
    assert rt.tier_url("http://[::1]:8750", port=1, token=None).startswith("redis://[::1]:1/0?")


def test_children_never_load_cachekeepers_own_backend() -> None:
    """verify proves the local dir alone: a job's CACHEKEEPER_TIER_* (without which the
    backend's hook installs nothing) never reach a prewarm or verify child."""
    env = {
        **rt.site_switches(tier=True),
        rt.URL: rt.OFF_URL,
        "CACHEKEEPER_TIER_MODE": "cachekeeper",
        "CACHEKEEPER_TIER_URL": "https://cache:8750",
        "CACHEKEEPER_HOME": "/h",
    }
    child = rt.isolated(env)
    assert not [k for k in child if k.startswith("CACHEKEEPER_TIER_")]
    assert child["CACHEKEEPER_HOME"] == "/h" and child[rt.FX_GRAPH] == "1"
    builder = dict(env)
    rt.set_builder_switches(builder, rt.site_switches(tier=True))
    assert not [k for k in builder if k.startswith("CACHEKEEPER_TIER_")]
