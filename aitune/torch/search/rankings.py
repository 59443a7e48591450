"""Earlier rankings: a re-tune of the same graph in the same environment builds the earlier winners only.

A second tune in the same environment should take seconds. The build cache (:mod:`.cache`) restores AOT artifacts,
but JIT candidates (Inductor, TorchAO) recompile on every tune, and every candidate is checked and measured again
(``benchmarks/gpu_search.py`` times a second tune). Speed rankings depend on the model's structure and weights, the
recorded shapes, the candidates, the strategy's settings and the environment — not on the day — so a search
remembers its ranking under a key over exactly those, and a later search with the same key builds, checks (by value,
as always) and measures only the earlier top candidate and those tied with it within its measured noise (the
strategy's tie rule). Every other candidate gets a ``skipped`` row naming the earlier winner and the record.

When none of the reused candidates passes this time, the full search runs after all (and its ranking replaces
the record). A time budget (``ait.tune(..., time_budget_s=...)``) asks for a search: rankings are neither
reused nor recorded then. ``strategy.enable_ranking_reuse(False)`` searches again; ``aitune env`` lists the
rankings and ``aitune env --clear-rankings`` (or deleting ``<cache dir>/rankings``) forgets them.

The key (sha256 of canonical JSON): the module fingerprint of the build cache (class, source of non-torch classes,
every parameter and buffer's bytes, training flags), the graph fingerprint without sample values (structure, tensor
specs, sample shapes), every candidate's class and config key, the versions of the candidates' packages
(:func:`~aitune.torch.common.requirements.package_versions`: installing ``onnxruntime-gpu`` beside ``onnxruntime``
gives a new key), the strategy's class and settings (tolerance, profiling, probes, quantization, performance
validation), the environment of :func:`aitune.torch.common.environment.environment_key` and the aitune version.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from pathlib import Path

from aitune import __version__
from aitune.torch.common.environment import environment_key
from aitune.torch.common.requirements import package_versions
from aitune.torch.common.jsonsafe import json_safe
from aitune.torch.search.cache import graph_fingerprint
from aitune.torch.search.crashes import CrashRegistry

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
RANKINGS_DIR = "rankings"  # under the cache directory


def candidate_key(blueprint) -> str:
    """A candidate's identity in a ranking: the crash registry's key (class, config key) and the description."""
    return f"{CrashRegistry.candidate_key(blueprint)}:{blueprint.describe()}"


class RankingStore:
    """Rankings of earlier searches, one JSON file per key under ``root`` (``<cache dir>/rankings``).

    Args:
        root: the folder. fingerprint: ``module -> str`` (the build cache's module fingerprint).
    """

    def __init__(self, root: str | os.PathLike, fingerprint):
        self.root = Path(root)
        self.fingerprint = fingerprint

    def key(self, context, blueprints: list, strategy_facts: dict) -> str | None:
        """The key of a search, or None when the module cannot be fingerprinted (e.g. ``meta`` weights)."""
        try:
            material = {"format": FORMAT_VERSION, "aitune": __version__,
                        "module": self.fingerprint(context.module),
                        "graph": graph_fingerprint(context.graph),
                        "candidates": [candidate_key(blueprint) for blueprint in blueprints],
                        "packages": sorted({(name, str(version)) for blueprint in blueprints
                                            for name, version in package_versions(blueprint).items()}),
                        "strategy": json_safe(strategy_facts),  # dataclasses: their repr
                        "environment": environment_key(context.device)}
        except Exception:  # noqa: BLE001 - no key: the search simply runs in full
            logger.debug("no ranking key for %s/%s", context.module_name, context.graph.name, exc_info=True)
            return None
        return hashlib.sha256(json.dumps(material, sort_keys=True, default=repr).encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def lookup(self, key: str) -> dict | None:
        """The record of ``key``: ``{"when", "module", "graph", "ranked": [{"candidate", "description", "score",
        "noise", "speedup"}, ...]}`` best first, or None (absent or unreadable: the search runs in full)."""
        try:
            record = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        ranked = record.get("ranked") if isinstance(record, dict) else None
        if not isinstance(ranked, list) or not ranked or not all(
                isinstance(item, dict) and isinstance(item.get("candidate"), str)
                and isinstance(item.get("score"), (int, float)) for item in ranked):
            return None
        return record

    def records(self) -> list[dict]:
        """Every readable record (for ``aitune env``), oldest first."""
        found = [self.lookup(path.stem) for path in sorted(self.root.glob("*.json"))] if self.root.is_dir() else []
        return sorted((record for record in found if record is not None), key=lambda record: str(record.get("when")))

    def clear(self) -> int:
        """Forget every ranking (later tunes search all candidates); returns how many there were."""
        paths = list(self.root.glob("*.json")) if self.root.is_dir() else []
        for path in paths:
            path.unlink(missing_ok=True)
        return len(paths)

    def record(self, key: str, context, ranked: list[dict], strategy: str = "") -> None:
        """Write the ranking of a full search (best first); ``strategy`` describes the strategy that made it (its
        settings are part of the key: ``aitune env`` shows it so that rankings of one graph can be told apart).
        Failures are logged, never raised."""
        record = {"format": FORMAT_VERSION, "when": datetime.datetime.now().isoformat(timespec="seconds"),
                  "module": context.module_name, "graph": context.graph.name, "strategy": strategy, "ranked": ranked}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            partial = self.path(key).with_name(f".{key}.{os.getpid()}")
            partial.write_text(json.dumps(record, indent=2))
            os.replace(partial, self.path(key))
        except OSError:
            logger.warning("could not record the ranking of %s/%s under %s", context.module_name, context.graph.name,
                           self.root, exc_info=True)


def reused(record: dict) -> list[str]:
    """The candidate keys a re-tune builds: the earlier top one and those within its measured noise (the tie
    rule of :meth:`aitune.torch.tune_strategy.TuneStrategy.pick`)."""
    ranked = record["ranked"]
    top = ranked[0]
    noise = float(top.get("noise") or 0.0)
    return [item["candidate"] for item in ranked if not top["score"] > item["score"] * (1 + noise)]
