"""The peers benchmark: pyqmq against NATS JetStream and Redis Streams in one harness
(``python -m bench.peers``; see bench/peers/run.py and docs/BENCHMARKS.md)."""
