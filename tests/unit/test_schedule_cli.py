"""``qmq schedule``'s own parsing: ``--every`` durations become milliseconds at the edge."""

from __future__ import annotations

import pytest

from qmq.cli import build_parser
from qmq.schedule_cli import ScheduleUsageError, parse_every


@pytest.mark.parametrize("text, ms", [("500ms", 500), ("90s", 90_000), ("15m", 900_000),
                                      ("1h30m", 5_400_000), ("1d", 86_400_000),
                                      ("1w", 604_800_000)])
def test_every_durations_are_read_as_milliseconds(text: str, ms: int) -> None:
    assert parse_every(text) == ms


@pytest.mark.parametrize("text", ["", "15", "m", "15 m", "1.5h", "15min", "-5s", "5x"])
def test_a_malformed_every_is_refused_quoting_it(text: str) -> None:
    with pytest.raises(ScheduleUsageError, match="--every"):
        parse_every(text)


def test_create_needs_exactly_one_of_cron_every_and_at() -> None:
    parser = build_parser()
    args = parser.parse_args(["schedule", "create", "s", "--subject", "x", "--body", "b",
                              "--cron", "0 9 * * MON-FRI", "--tz", "Europe/Berlin"])
    assert (args.cron, args.tz, args.misfire) == ("0 9 * * MON-FRI", "Europe/Berlin", "skip")
    for both in (["--cron", "* * * * *", "--every", "1m"], []):
        with pytest.raises(SystemExit):
            parser.parse_args(["schedule", "create", "s", "--subject", "x", "--body", "b", *both])
