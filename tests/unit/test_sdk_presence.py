"""sdk.presence: how a process's batched heartbeat is cut into requests."""

from __future__ import annotations

import pytest

from sdk.presence import CLIENTS_PER_HEARTBEAT_MAX, HEARTBEAT_BODY_BYTES_MAX, chunks


def clients(count: int, subjects: int = 1) -> list[dict[str, object]]:
    return [{"client_id": f"c{i}", "app": "a", "group": "g", "role": "consumer",
             "subjects": [f"s{j}" for j in range(subjects)]} for i in range(count)]


@pytest.mark.parametrize("count, requests", [
    (CLIENTS_PER_HEARTBEAT_MAX - 1, 1),
    (CLIENTS_PER_HEARTBEAT_MAX, 1),
    (CLIENTS_PER_HEARTBEAT_MAX + 1, 2),
])
def test_a_batch_names_at_most_its_client_limit_per_request(count: int, requests: int) -> None:
    cut = chunks(clients(count), [])
    assert len(cut) == requests
    assert [len(alive) for alive, _ in cut][0] == min(count, CLIENTS_PER_HEARTBEAT_MAX)
    assert sum(len(alive) for alive, _ in cut) == count


def test_leaves_ride_with_the_last_request_while_it_has_room() -> None:
    assert chunks(clients(2), ["x"]) == [(clients(2), ["x"])]
    many = [f"x{i}" for i in range(CLIENTS_PER_HEARTBEAT_MAX)]
    cut = chunks(clients(1), many)
    assert cut == [(clients(1), []), ([], many)]
    assert chunks([], []) == [([], [])]


def test_a_batch_is_cut_before_its_body_passes_the_byte_limit() -> None:
    # About 1,000 subjects of ~7 characters each: ~10 KB per client.
    wide = clients(300, subjects=1000)
    cut = chunks(wide, [])
    assert len(cut) > 1 and sum(len(alive) for alive, _ in cut) == 300
    for alive, _ in cut:
        assert len(str(alive)) < 1.2 * HEARTBEAT_BODY_BYTES_MAX
