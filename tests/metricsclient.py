"""Scraping a server's ``/metrics`` in tests: the text format parsed into samples by name and
labels."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 30  # generous: the test machine is loaded


class Scrape:
    """One scrape's samples: ``scrape["name", {"label": "value"}]`` is the sample's value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def __getitem__(self, key: str | tuple[str, dict[str, str]]) -> float:
        name, labels = (key, {}) if isinstance(key, str) else key
        return self.samples[(name, frozenset(labels.items()))]

    def get(self, name: str, labels: dict[str, str] | None = None, default: float | None = None
            ) -> float | None:
        """The sample's value, or ``default`` when the scrape has no such sample."""
        return self.samples.get((name, frozenset((labels or {}).items())), default)

    def labelled(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample of ``name``, by its label set."""
        return {labels: value for (n, labels), value in self.samples.items() if n == name}


async def scrape(url: str) -> Scrape:
    """GET ``url`` (a ``/metrics`` address) and parse it; fails on a non-200 answer."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(url) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/plain")
            return Scrape(await response.text())
