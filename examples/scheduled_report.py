"""A scheduled report: the MetaServer fires a recurring schedule, a worker builds each report.

    qmq up &                                   # in another terminal
    python examples/scheduled_report.py        # --meta URL, --every-s S, --reports N

1. A schedule is created: "send report.daily every day at 06:00 Berlin time" is
   ``cron="0 6 * * *", tz="Europe/Berlin"``; its next occurrences are printed.
2. To see reports arrive without waiting for 06:00, a second schedule fires every ``--every-s``
   seconds (default 2). The MetaServer hands each occurrence to a delay server, which delivers it
   on time, once.
3. A worker of group ``reports`` builds a report per message until it has ``--reports`` (default
   3), then both schedules are deleted (a schedule outlives the program that created it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from datetime import timedelta

import qmq


async def main(meta: str, every_s: float, reports: int) -> int:
    run = uuid.uuid4().hex[:8]  # this run's own names: reruns do not mix
    subject, daily, quick = f"report.daily.{run}", f"daily-report-{run}", f"quick-report-{run}"
    async with qmq.Schedules(meta) as schedules:
        await schedules.create(daily, subject, b"daily", cron="0 6 * * *", tz="Europe/Berlin")
        for fire in await schedules.next(daily, 3):
            print(f"{daily} fires at {fire['local']} ({fire['utc']})")
        await schedules.create(quick, subject, b"quick", every=timedelta(seconds=every_s))
        print(f"{quick} fires every {every_s} s")
        built = 0
        try:
            async with qmq.Consumer(meta, group="reports", start="earliest") as consumer:
                messages = consumer.subscribe(subject).__aiter__()
                while built < reports:
                    msg = await asyncio.wait_for(messages.__anext__(), every_s * 10 + 30)
                    built += 1
                    print(f"report {built}: built for the {msg.body.decode()} schedule "
                          f"(message {msg.id})")
                    await msg.ack()
        except asyncio.TimeoutError:
            print("no report arrived in time: is a delay server running?", file=sys.stderr)
        finally:
            for name in (quick, daily):
                await schedules.delete(name)
            print("schedules deleted")
    print(f"built {built} report(s)")
    return 0 if built == reports else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta", default="http://127.0.0.1:8090", help="MetaServer URL")
    parser.add_argument("--every-s", type=float, default=2.0,
                        help="the quick schedule's interval in seconds (default 2)")
    parser.add_argument("--reports", type=int, default=3, help="reports to build (default 3)")
    options = parser.parse_args()
    sys.exit(asyncio.run(main(options.meta, options.every_s, options.reports)))
