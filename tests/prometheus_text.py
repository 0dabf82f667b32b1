"""Read Prometheus text exposition as written, without prometheus_client's parser (which renames counters)."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Family:
    name: str
    type: str = ""
    help: str = ""
    samples: list[Sample] = field(default_factory=list)

    def label_names(self) -> set[tuple[str, ...]]:
        """The label-name sets its samples carry, each sorted."""
        return {tuple(sorted(sample.labels)) for sample in self.samples}

    def value(self, **labels: str) -> float:
        """The one sample whose labels include ``labels``."""
        found = [s.value for s in self.samples if labels.items() <= s.labels.items()]
        assert len(found) == 1, f"{self.name}{labels}: {len(found)} samples"
        return found[0]


def parse(text: str) -> dict[str, Family]:
    """Families by name, in order; a sample belongs to the family whose TYPE line came last."""
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            _, keyword, name, *rest = line.split(" ", 3)
            family = families.setdefault(name, Family(name))
            if keyword == "HELP":
                family.help = rest[0] if rest else ""
            else:
                family.type = rest[0]
                current = family
        elif line and not line.startswith("#"):
            match = _SAMPLE.match(line)
            assert match and current is not None, f"not a sample line: {line!r}"
            labels = dict(_LABEL.findall(match.group(2) or ""))
            current.samples.append(Sample(match.group(1), labels, float(match.group(3))))
    return families


def scrape(metrics_port: int) -> str:
    body: bytes = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return body.decode()
