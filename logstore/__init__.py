"""Storage primitives: segmented append-only logs with CRC-framed records, checkpoints, retention.

Synchronous plain classes over files: no asyncio, no network, and nothing of ours is imported.
"""
