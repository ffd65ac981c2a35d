"""Red packets: refund a red packet 24 hours after it is sent, unless it was claimed.

    qmq up --clock-offset-ms 86395000 &        # in another terminal: see below
    python examples/red_packet.py              # --meta URL, --wait-s S

1. Two red packets are sent. Each gets a delayed ``redpacket.refund`` message due in 24 hours.
2. Packet 1 is claimed: its refund is cancelled at the delay server, so it never arrives.
3. A wallet consumer refunds what arrives: packet 2, unclaimed after 24 hours.

Waiting a day is no way to try it, so the servers' clocks run ahead: ``qmq up --clock-offset-ms
86395000`` (TEST ONLY, 24 h minus 5 s) makes the delay server see the 24-hour due time 5 seconds
after the send. The example uses the real 24-hour delay; only the servers' clock is shifted (the
test ``tests/e2e/test_examples.py`` runs it so). Against a ``qmq up`` without the offset it waits
``--wait-s`` (default 60) for the refund and then says what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from datetime import timedelta

import qmq

REFUND_AFTER = timedelta(hours=24)
IDLE_AFTER_REFUND_S = 3.0  # a refund that was not cancelled would come with the other: wait it out


async def main(meta: str, wait_s: float) -> int:
    subject = f"redpacket.refund.{uuid.uuid4().hex[:8]}"  # this run's own: reruns do not mix
    states = {1: "sent", 2: "sent"}
    async with qmq.Producer(meta) as producer:
        refunds = {packet: await producer.send(subject, str(packet).encode(), delay=REFUND_AFTER)
                   for packet in states}
        for packet, receipt in refunds.items():
            print(f"packet {packet}: sent, refund due at {receipt.deliver_at_ms} "
                  f"(delay group {receipt.broker_group})")
        outcome = await producer.cancel(refunds[1])  # packet 1 is claimed
        states[1] = "claimed"
        print(f"packet 1: claimed, its refund {outcome}")

    async with qmq.Consumer(meta, group="wallet", start="earliest") as consumer:
        messages = consumer.subscribe(subject).__aiter__()
        timeout_s = wait_s
        while True:
            try:
                msg = await asyncio.wait_for(messages.__anext__(), timeout_s)
            except asyncio.TimeoutError:
                break
            packet = int(msg.body)
            print(f"packet {packet}: unclaimed after 24 h, refunded" if states[packet] == "sent"
                  else f"packet {packet}: refund arrived although it was {states[packet]}!")
            states[packet] = "refunded" if states[packet] == "sent" else "refunded twice"
            await msg.ack()
            timeout_s = IDLE_AFTER_REFUND_S
    print(f"final states: {states}")
    if states != {1: "claimed", 2: "refunded"}:
        print("no refund in time: is qmq up running with --clock-offset-ms 86395000?",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta", default="http://127.0.0.1:8090", help="MetaServer URL")
    parser.add_argument("--wait-s", type=float, default=60.0,
                        help="how long to wait for the refund (default 60)")
    options = parser.parse_args()
    sys.exit(asyncio.run(main(options.meta, options.wait_s)))
