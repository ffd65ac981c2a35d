"""Every protocol and message limit, as a named constant with its unit in the name.

Both sides import these: the SDK checks them before sending so a producer learns of a bad message
without a round trip, and the servers check them again because a client may not be ours.
Each limit is tested at max-1, max and max+1 (tests/unit/test_message.py, test_protocol.py, and
against live servers in tests/integration/test_limits_server.py); docs/LIMITS.md lists them all.
"""

from __future__ import annotations

_KIB = 1024
_MIB = 1024 * _KIB

# Largest frame payload (the msgpack map after the u32 length prefix), in bytes. Twice the body
# limit so a full-size message plus its envelope and a batch of small messages both fit.
MAX_FRAME_BYTES = 8 * _MIB

# Largest message body, in bytes.
MAX_BODY_BYTES = 4 * _MIB

# Most messages in one `send` request.
MAX_SEND_BATCH_MESSAGES = 256

# Most tags on one message.
MAX_TAGS = 10

# Longest tag, in bytes of UTF-8.
MAX_TAG_BYTES = 64

# Most entries in a message's properties map.
MAX_PROPERTIES = 64

# Longest property key, in bytes of UTF-8.
MAX_PROPERTY_KEY_BYTES = 128

# Longest property value, in bytes of UTF-8.
MAX_PROPERTY_VALUE_BYTES = 4096

# Longest subject or consumer-group name, in characters. Names match
# `[A-Za-z0-9][A-Za-z0-9._-]{0,199}`; internal names (`%retry%<subject>%<group>`,
# `%dead%<subject>%<group>`) are built from two valid names and are not bound by this limit.
MAX_SUBJECT_CHARS = 200

# Most messages returned by one `pull`.
MAX_PULL_BATCH_MESSAGES = 1024

# Longest long-poll wait of one `pull`, in milliseconds.
MAX_PULL_WAIT_MS = 60_000

# Furthest a message may be scheduled ahead of now, in milliseconds (730 days, "2 years").
# Later is rejected with delay_out_of_range, never clamped.
MAX_DELAY_MS = 730 * 24 * 60 * 60 * 1000
# How far ahead of a realtime broker's now a held message (the ``hold`` op) may become visible:
# a delay server hands messages off a few seconds ahead (its handoff_lead_ms, at most this).
HOLD_AHEAD_MS_MAX = 60_000

# Longest message id, in characters.
MAX_MESSAGE_ID_CHARS = 128

# Most [first, last] ranges in one `ack` request.
MAX_ACK_RANGES = 1024

# Longest client id, app name or consumer id, in characters (`hello.client_id`, `hello.app`,
# `consumer_id` of pull, ack, nack and heartbeat). The MetaServer takes the same 200 in client
# heartbeats; a consumer id is written into every pull-log action, so it must stay small.
MAX_CLIENT_ID_CHARS = 200

# Longest app token a `hello` may carry, in characters. MetaServer-made tokens are about 50; the
# bound keeps a token check (an HTTP call to the MetaServer) far below its body limit.
MAX_TOKEN_CHARS = 512

# Most bytes of log one `fetch` answer carries (a single record larger than this goes whole), and
# most bytes of a checkpoint one `snapshot` answer carries. Half a frame: the answer's other
# fields and msgpack's framing of the bin field fit beside it.
MAX_FETCH_BYTES = 4 * _MIB

# Longest wait of one `fetch` at the end of a log (a follower's long poll), in milliseconds.
MAX_FETCH_WAIT_MS = 60_000

# Longest server id in a `fetch` or `snapshot` (16 hex digits today), and in the MetaServer's
# requests (its SERVER_ID_RE is built from it).
MAX_SERVER_ID_CHARS = 64

# Longest ``reason`` of a slave's ``replica.undecodable_at`` in a MetaServer heartbeat, in
# characters: a server cuts its own to this (serverkit.replication), the MetaServer refuses a
# longer one (metaserver.validation). One constant, so the two cannot drift apart.
UNDECODABLE_REASON_CHARS_MAX = 400

# Most logs a heartbeat's ``replica.positions`` names (a realtime group replicates two, a delay
# group two), most slaves in a master's ``replica.insync`` proposal, and the largest
# ``min_insync`` a group may ask for (a group has a handful of servers). A server cuts its report
# to the first two and refuses a larger min_insync at start; the MetaServer refuses more of any.
REPLICA_POSITIONS_MAX = 8
REPLICA_INSYNC_MAX = 16
MIN_INSYNC_MAX = 16

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_FETCH_BYTES",
    "MAX_FETCH_WAIT_MS",
    "MAX_SERVER_ID_CHARS",
    "MAX_BODY_BYTES",
    "MAX_SEND_BATCH_MESSAGES",
    "MAX_TAGS",
    "MAX_TAG_BYTES",
    "MAX_PROPERTIES",
    "MAX_PROPERTY_KEY_BYTES",
    "MAX_PROPERTY_VALUE_BYTES",
    "MAX_SUBJECT_CHARS",
    "MAX_PULL_BATCH_MESSAGES",
    "MAX_PULL_WAIT_MS",
    "MAX_DELAY_MS",
    "HOLD_AHEAD_MS_MAX",
    "MAX_MESSAGE_ID_CHARS",
    "MAX_ACK_RANGES",
    "MAX_CLIENT_ID_CHARS",
    "MAX_TOKEN_CHARS",
    "UNDECODABLE_REASON_CHARS_MAX",
    "REPLICA_POSITIONS_MAX",
    "REPLICA_INSYNC_MAX",
    "MIN_INSYNC_MAX",
]
