"""server/resp/bounds.py: the tier listener's connection registry, failed-auth backoff and
output budget, each on its own (the listener on loopback: tests/hardening/test_tier_listener.py)."""

from __future__ import annotations

import threading

from cachekeeper.server.resp.bounds import (
    MAX_DELAY_S,
    MAX_PEERS,
    MAX_WAIT_S,
    AuthThrottle,
    ByteBudget,
    Clients,
    Held,
    peer_key,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_each_failure_makes_the_next_attempt_from_that_address_wait_longer() -> None:
    clock = Clock()
    throttle = AuthThrottle(clock=clock)
    assert throttle.wait_s("10.0.0.1", connection_failures=0) == 0.0
    waits = []
    for _ in range(6):
        throttle.failed("10.0.0.1")
        wait = throttle.wait_s("10.0.0.1", connection_failures=0)
        assert wait is not None
        waits.append(round(wait, 3))
        clock.now += wait  # the attempt is checked, and fails again
    assert waits == [0.05, 0.1, 0.2, 0.4, MAX_DELAY_S, MAX_DELAY_S]
    throttle.failed("10.0.0.1")
    first = throttle.wait_s("10.0.0.1", connection_failures=0)
    second = throttle.wait_s("10.0.0.1", connection_failures=0)
    assert first is not None and second is not None
    assert second - first == MAX_DELAY_S  # attempts at once are spaced, not run in parallel
    assert throttle.wait_s("10.0.0.2", connection_failures=0) == 0.0  # another address


def test_attempts_that_would_wait_past_the_bound_are_not_checked() -> None:
    """Spaced MAX_DELAY_S apart, only a few attempts from one address can wait; the next is
    refused at once (its connection closes), never left waiting past redis-py's timeout."""
    clock = Clock()
    throttle = AuthThrottle(clock=clock)
    for _ in range(10):
        throttle.failed("10.0.0.1")
    waits = [throttle.wait_s("10.0.0.1", connection_failures=0) for _ in range(10)]
    checked = [w for w in waits if w is not None]
    assert all(w <= MAX_WAIT_S for w in checked)
    assert len(checked) <= MAX_WAIT_S / MAX_DELAY_S + 1 and None in waits


def test_the_connections_own_failures_count_too() -> None:
    throttle = AuthThrottle(clock=Clock())
    assert throttle.wait_s("10.0.0.1", connection_failures=3) > 0


def test_an_address_is_forgotten_and_the_table_is_bounded() -> None:
    clock = Clock()
    throttle = AuthThrottle(clock=clock)
    throttle.failed("10.0.0.1")
    clock.now += 3600
    assert throttle.wait_s("10.0.0.1", connection_failures=0) == 0.0
    for i in range(MAX_PEERS + 500):
        throttle.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert len(throttle) == MAX_PEERS


def test_ipv6_peers_are_throttled_by_their_64() -> None:
    assert peer_key("2001:db8:1:2::5") == peer_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert peer_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert peer_key("10.0.0.1") == "10.0.0.1"


class Member:
    def __init__(self, name: str) -> None:
        self.name = name


def test_at_the_cap_the_oldest_unauthenticated_then_the_longest_idle_make_room() -> None:
    evicted: list[str] = []
    clients = Clients(3, evict=lambda m: evicted.append(m.name))
    a, b, c = Member("a"), Member("b"), Member("c")
    assert clients.admit(a, authenticated=True) and clients.admit(b, authenticated=True)
    assert clients.admit(c, authenticated=False)
    clients.idle(a)
    clients.idle(b)
    clients.busy(b)
    assert clients.admit(Member("d"), authenticated=True) and evicted == ["c"]
    assert clients.admit(Member("e"), authenticated=True) and evicted == ["c", "a"]
    assert len(clients) == 3
    # b, d and e are in the middle of commands: a new connection is refused
    assert not clients.admit(Member("f"), authenticated=True) and len(clients) == 3


def test_the_output_budget_lets_one_holder_through_and_gives_back_once() -> None:
    budget = ByteBudget(100)
    first, second, third = Held(budget), Held(budget), Held(budget)
    assert first.take(150)  # alone: a value over the budget is still served
    assert not second.take(1) and second.refused
    first.give_back()
    first.give_back()  # idempotent
    assert budget.used == 0
    assert second.take(60) and not third.take(60) and third.take(40)
    assert second.holds(60) and not second.holds(61)
    second.give_back()
    third.give_back()
    assert budget.used == 0


def test_the_output_budget_is_thread_safe() -> None:
    budget = ByteBudget(1 << 30)

    def churn() -> None:
        for _ in range(2000):
            held = Held(budget)
            held.take(10)
            held.give_back()

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert budget.used == 0
