"""Counting a server's requests by op and its error answers by code, as plain ints on the event
loop (a prometheus_client Counter's ``inc()`` was four Python calls and a lock per request):
the server's metrics class turns them into metric families at scrape time. The same for
realtime and delay servers."""

from __future__ import annotations


class RequestCounts:
    """``count_request`` and ``count_error`` over ``request_counts`` (op -> requests; an op not
    among its keys counts as "other", which must be a key) and ``request_errors`` (code ->
    error answers), which the metrics class mixing this in sets. Event loop only."""

    request_counts: dict[str, int]
    request_errors: dict[str, int]

    def count_request(self, op: str) -> None:
        """Count one request of ``op`` (an op not among the keys as "other")."""
        counts = self.request_counts
        if op in counts:
            counts[op] += 1
        else:
            counts["other"] += 1

    def count_error(self, code: str) -> None:
        """Count one error answer to a whole request (``FrameServer``'s ``on_error``)."""
        self.request_errors[code] = self.request_errors.get(code, 0) + 1
