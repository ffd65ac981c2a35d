"""bench.call_count counts the event loop's calls per message of a real ``qmq up``: a
message's socket reads and writes are seen per message, and start-up is taken out."""

from __future__ import annotations

import pytest

from bench import call_count


@pytest.mark.slow  # two qmq up under cProfile: 10-40 s by the machine's load
def test_each_message_costs_the_loop_its_socket_reads_and_writes_and_not_its_start_up():
    # 300 messages apart: the idle work of the seconds they took (the MetaServer's heartbeat
    # reads, ~60 socket reads a second idle) spreads thin enough not to pass for a message's own,
    # even when a loaded machine slows cProfile's qmq up to ~100 messages a second.
    # On asyncio's own loop, whose socket calls are Python's (uvloop's are libuv's, unseen).
    few = call_count.count_calls(20, event_loop="asyncio")
    many = call_count.count_calls(320, event_loop="asyncio")
    rows = {call_count.describe(key): calls
            for key, calls, _us in call_count.per_message(few, many, 300)}
    # Alone, a message is a send request and a pull request read, and their two answers
    # written (an ack now and then): each costs the loop a socket call or two.
    assert 1.5 <= rows["<method 'recv' of '_socket.socket' objects>"] <= 4, rows
    assert 1.5 <= rows["<method 'send' of '_socket.socket' objects>"] <= 4, rows
    assert sum(rows.values()) > 100
    # Start-up (imports, the MetaServer's schema) is in both runs, so it cancels out.
    assert all(calls < 0.5 for name, calls in rows.items() if name.startswith("_find_and_load "))


def test_a_function_is_named_by_its_path_inside_the_repository_and_builtins_by_name():
    here = call_count.__file__
    assert call_count.describe((here, 12, "main")) == "main bench/call_count.py:12"
    assert call_count.describe(("~", 0, "<built-in method builtins.len>")) == \
        "<built-in method builtins.len>"
    assert not call_count.is_python(("~", 0, "<built-in method builtins.len>"))
