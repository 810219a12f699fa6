"""server/residency.py without a model: which models leave under a memory budget and idle times, and the keep-alive
and memory sizes as people write them."""

import pytest

from minimlx.errors import InvalidSettingError
from minimlx.server.residency import FOREVER, Residency, byte_size, seconds

MB = 1 << 20


def resident(policy: Residency, *models: tuple[str, int, float]) -> Residency:
    for name, size, at in models:
        policy.loaded(name, size * MB, at)
    return policy


def test_without_a_budget_nothing_leaves_for_room():
    policy = resident(Residency(), ("a", 500, 0), ("b", 500, 1))
    assert policy.room_for(10_000 * MB) == []


def test_the_least_recently_used_idle_models_leave_until_the_new_one_fits():
    policy = resident(Residency(budget=100 * MB), ("a", 40, 0), ("b", 40, 1), ("c", 10, 2))
    assert policy.room_for(10 * MB) == []  # 90 + 10 fits
    assert policy.room_for(30 * MB) == ["a"]  # 90 + 30 - 40 = 80
    assert policy.room_for(60 * MB) == ["a", "b"]
    policy.began("a")
    policy.finished("a", now=5)  # a used last now: b goes first
    assert policy.room_for(30 * MB) == ["b"]


def test_a_model_with_requests_in_flight_never_leaves_and_the_newcomer_waits():
    policy = resident(Residency(budget=100 * MB), ("a", 60, 0), ("b", 30, 1))
    policy.began("a")
    assert policy.room_for(50 * MB) is None  # b leaving is not enough while a answers: wait
    assert policy.room_for(40 * MB) == ["b"] and policy.room_for(10 * MB) == []
    policy.began("a")
    policy.finished("a", now=2)
    assert policy.room_for(50 * MB) is None  # one of a's two requests still runs
    policy.finished("a", now=3)
    assert policy.room_for(50 * MB) == ["b", "a"]


def test_a_model_larger_than_the_budget_comes_in_alone():
    policy = resident(Residency(budget=100 * MB), ("a", 60, 0))
    assert policy.room_for(150 * MB) == ["a"]
    assert Residency(budget=100 * MB).room_for(150 * MB) == []


def test_idle_models_expire_after_their_keep_alive_and_a_request_may_set_its_own():
    policy = resident(Residency(keep_alive=5), ("a", 1, 0), ("b", 1, 2))
    assert policy.expired(4.9) == [] and policy.next_expiry() == 5
    assert policy.expired(5.0) == ["a"] and policy.expired(7) == ["a", "b"]
    policy.began("a", keep_alive=0)  # Ollama's keep_alive 0: leave right after this request
    assert policy.expires_at("a") == FOREVER and policy.expired(100) == ["b"]  # not while it answers
    policy.began("b", keep_alive=FOREVER)
    policy.finished("b", now=10)
    policy.finished("a", now=10)
    assert policy.expired(10) == ["a"] and policy.expired(1e9) == ["a"]
    assert Residency().next_expiry() == FOREVER


@pytest.mark.parametrize(
    "given, expected",
    [(5, 5.0), (0, 0.0), (-1, FOREVER), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25),
     ("-1m", FOREVER), ("1.5s", 1.5)],
)  # fmt: skip
def test_keep_alive_durations_as_ollama_writes_them(given, expected):
    assert seconds(given, "keep_alive") == expected


@pytest.mark.parametrize("given", ["soon", "5 minutes", "5mm", "", True, None, [5]])
def test_a_keep_alive_that_is_no_duration_is_refused_by_name(given):
    with pytest.raises(InvalidSettingError, match="keep_alive"):
        seconds(given, "keep_alive")


@pytest.mark.parametrize(
    "given, expected", [("8GB", 8 << 30), ("512MB", 512 << 20), ("1.5G", 3 << 29), ("4GiB", 4 << 30), ("1000", 1000)]
)
def test_memory_sizes(given, expected):
    assert byte_size(given) == expected


@pytest.mark.parametrize("given", ["8 parsecs", "GB", "-1GB", "8XB"])
def test_a_memory_size_that_is_none_is_refused(given):
    with pytest.raises(InvalidSettingError, match="memory size"):
        byte_size(given)


def test_while_a_newcomer_waits_the_busy_models_it_needs_gone_are_named():
    policy = resident(Residency(budget=100 * MB), ("a", 40, 0), ("b", 40, 1), ("c", 10, 2))
    for name in ("a", "b"):
        policy.began(name)
    assert policy.room_for(50 * MB) is None
    assert policy.held_back(50 * MB) == ["a"]  # c (idle) and a make room; b may keep answering
    assert policy.held_back(90 * MB) == ["a", "b"]
    assert Residency().held_back(10**12) == []
