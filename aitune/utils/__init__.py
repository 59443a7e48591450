"""Utilities shared by aitune's APIs: :mod:`.logging` (``setup_logging`` and output control) and
:mod:`.monitoring` (NVTX ranges, hardware metrics, ``annotate``)."""

from aitune.utils.logging import setup_logging

__all__ = ["setup_logging"]
