"""The global configuration (``aitune.torch.config``, also ``ait.config``), as in the reference system.

``from aitune.torch.config import config`` (or ``import aitune.torch as ait; ait.config``) gives the one
:class:`AITuneConfig` instance of the process. Attributes are read when they are used (a setting changed
between two ``ait.tune`` calls applies to the second one); every assignment is validated.

Fields, their defaults, and where aitune's default differs from the reference system's (README, "Migrating
from NVIDIA AITune"):

=============================  ===========================================  ===========================================
attribute                      default                                      used by
=============================  ===========================================  ===========================================
``cache_dir``                  ``$AITUNE_CACHE_DIR``, else                  builds, reports (``ait.tune``)
                               ``$XDG_CACHE_HOME/aitune``, else
                               ``~/.cache/aitune`` — read at each use
``min_num_samples``            100                                          just-in-time tuning readiness only
``max_num_samples_stored``     8 (reference: 1)                             default ``max_samples`` of new
                                                                            ``ait.Module`` wrappers (distinct input
                                                                            shapes kept per graph)
``device_after_tuning``        None = the module stays where it is          after ``ait.tune``: modules whose every
                               (reference: ``"meta"``)                      graph runs an AOT artifact move there
``tuning_data_output_path``    ``$AITUNE_TUNING_DATA_PATH``, else           the last run's report (JSON), written at
                               ``<cache_dir>/tuning_data/report.json``      the end of ``ait.tune`` and by
                                                                            ``snapshot_tuning_data()``
``strict_mode``                True                                         see NOTE [strict mode]
``copy_cuda_graph_outputs``    True                                         served calls of Inductor/TorchAO CUDA-graph
                                                                            variants; see NOTE [output copies]
``enable_transformers_...``    ``$AITUNE_TRANSFORMERS_INTEGRATION`` (True)  recorded; see NOTE [integrations]
``enable_diffusers_...``       ``$AITUNE_DIFFUSERS_INTEGRATION`` (False)    recorded; see NOTE [integrations]
=============================  ===========================================  ===========================================

NOTE [strict mode]: in the reference, ``strict_mode=False`` drops non-tensor argument values from a graph's
identity, so calls that differ only in a flag or a size share one backend. aitune always keeps them in the
identity: its artifacts (Inductor AOT, ONNX, TensorRT) are specialised for the constant values they were
built with, so sharing one across values would return results computed for another value. ``False`` is
accepted (scripts run) and logged once as ignored.

NOTE [output copies]: a CUDA-graph replay writes its outputs into the graph's own buffers, so a served call of an
Inductor or TorchAO ``reduce-overhead`` variant returns a copy (one device-to-device copy per output tensor, ~50 µs
of host time per call for a decoder's output on the GPU machine: ``benchmarks/llm_decode_host.py --stages``;
a key/value cache in the output is the caller's own and is never copied).
``copy_cuda_graph_outputs = False`` returns the graph's own outputs instead, as a hand-picked ``torch.compile(...,
mode="reduce-overhead")`` does: valid until the next CUDA-graph replay on that device (aitune's, or a
``reduce-overhead`` compile of the user's own). PyTorch raises
"accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run" on some later reads, not
on all (another graph's replay shares the memory pool): use each output, or copy it, before the next call
(``generate`` does, unless it returns hidden states or attentions). Inductor's ``capture_cuda_graphs`` variant
follows this setting too: without copies its outputs are the graph's own buffers, overwritten by the next replay of
that graph without any error. Tuning's own runs always copy. The other CUDA-graph backends (eager and TensorRT with
``use_cuda_graphs``, ONNX Runtime with ``cuda_graph``) copy whatever this says.

NOTE [integrations]: the reference patches ``transformers``/``diffusers`` when these flags are on (cache
classes for graph identity, a ``RMSNorm`` export workaround). aitune needs neither: transformers' caches are
registered pytree nodes it opens natively, and its exporters do not need the patch. The flags are kept so
scripts that set them run, and reported in ``to_dict()``.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from aitune.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["AITuneConfig", "config", "default_cache_dir"]


def default_cache_dir() -> Path:
    """``$AITUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/aitune``, else ``~/.cache/aitune`` (read now)."""
    if os.environ.get("AITUNE_CACHE_DIR"):
        return Path(os.environ["AITUNE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "aitune"


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


_UNSET = object()


class AITuneConfig:
    """Process-wide settings; see the module docstring for every field and its default.

    Path-valued fields (``cache_dir``, ``tuning_data_output_path``) follow their environment variables until
    they are assigned; ``reset()`` returns every field to that state.
    """

    _FIELDS = ("cache_dir", "min_num_samples", "max_num_samples_stored", "device_after_tuning",
               "tuning_data_output_path", "strict_mode", "copy_cuda_graph_outputs",
               "enable_transformers_integration", "enable_diffusers_integration")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Every field back to its default (path fields follow the environment again)."""
        object.__setattr__(self, "_cache_dir", _UNSET)
        object.__setattr__(self, "_tuning_data_output_path", _UNSET)
        object.__setattr__(self, "_min_num_samples", 100)
        object.__setattr__(self, "_max_num_samples_stored", 8)
        object.__setattr__(self, "_device_after_tuning", None)
        object.__setattr__(self, "_strict_mode", True)
        object.__setattr__(self, "_copy_cuda_graph_outputs", True)
        object.__setattr__(self, "_enable_transformers_integration", _UNSET)
        object.__setattr__(self, "_enable_diffusers_integration", _UNSET)
        object.__setattr__(self, "_warned_strict", False)

    # ---- paths
    @property
    def cache_dir(self) -> Path:
        """Root of builds, reports and tuning data (see :func:`default_cache_dir`)."""
        return default_cache_dir() if self._cache_dir is _UNSET else self._cache_dir

    @cache_dir.setter
    def cache_dir(self, value: str | os.PathLike | None) -> None:
        object.__setattr__(self, "_cache_dir", _UNSET if value is None else _path(value, "cache_dir"))

    @property
    def tuning_data_output_path(self) -> Path:
        """Where the last ``ait.tune`` run's report is written (``$AITUNE_TUNING_DATA_PATH``, else
        ``<cache_dir>/tuning_data/report.json``)."""
        if self._tuning_data_output_path is not _UNSET:
            return self._tuning_data_output_path
        if os.environ.get("AITUNE_TUNING_DATA_PATH"):
            return Path(os.environ["AITUNE_TUNING_DATA_PATH"]).expanduser()
        return self.cache_dir / "tuning_data" / "report.json"

    @tuning_data_output_path.setter
    def tuning_data_output_path(self, value: str | os.PathLike | None) -> None:
        object.__setattr__(self, "_tuning_data_output_path",
                           _UNSET if value is None else _path(value, "tuning_data_output_path"))

    # ---- counts
    @property
    def min_num_samples(self) -> int:
        return self._min_num_samples

    @min_num_samples.setter
    def min_num_samples(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"config.min_num_samples must be an int >= 1, got {value!r}")
        object.__setattr__(self, "_min_num_samples", value)

    @property
    def max_num_samples_stored(self) -> int | float:
        return self._max_num_samples_stored

    @max_num_samples_stored.setter
    def max_num_samples_stored(self, value: int | float) -> None:
        valid = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or value == math.inf
        if not valid:
            raise ConfigError(f"config.max_num_samples_stored must be an int >= 1 or math.inf, got {value!r}")
        object.__setattr__(self, "_max_num_samples_stored", value)

    def samples_per_graph(self) -> int:
        """``max_num_samples_stored`` as the int a wrapper takes (``inf`` -> a large bound, 1 << 20)."""
        value = self._max_num_samples_stored
        return 1 << 20 if value == math.inf else int(value)

    # ---- devices and modes
    @property
    def device_after_tuning(self) -> str | None:
        return self._device_after_tuning

    @device_after_tuning.setter
    def device_after_tuning(self, value: str | torch.device | None) -> None:
        if value is not None:
            try:
                value = str(torch.device(value))
            except (RuntimeError, TypeError) as exc:
                raise ConfigError(f"config.device_after_tuning must be a torch device such as 'cpu' or 'meta', "
                                  f"got {value!r}") from exc
        object.__setattr__(self, "_device_after_tuning", value)

    @property
    def strict_mode(self) -> bool:
        return self._strict_mode

    @strict_mode.setter
    def strict_mode(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"config.strict_mode must be a bool, got {value!r}")
        object.__setattr__(self, "_strict_mode", value)
        if not value and not self._warned_strict:
            object.__setattr__(self, "_warned_strict", True)
            logger.warning("aitune: config.strict_mode=False is accepted but ignored: non-tensor arguments always "
                           "take part in a graph's identity, because artifacts are specialised for their values "
                           "(NOTE [strict mode] in aitune/torch/config.py)")

    @property
    def copy_cuda_graph_outputs(self) -> bool:
        """Served calls of Inductor/TorchAO CUDA-graph variants return copies (NOTE [output copies])."""
        return self._copy_cuda_graph_outputs

    @copy_cuda_graph_outputs.setter
    def copy_cuda_graph_outputs(self, value: bool) -> None:
        object.__setattr__(self, "_copy_cuda_graph_outputs", _bool(value, "copy_cuda_graph_outputs"))

    @property
    def enable_transformers_integration(self) -> bool:
        value = self._enable_transformers_integration
        return _env_flag("AITUNE_TRANSFORMERS_INTEGRATION", True) if value is _UNSET else value

    @enable_transformers_integration.setter
    def enable_transformers_integration(self, value: bool) -> None:
        object.__setattr__(self, "_enable_transformers_integration", _bool(value, "enable_transformers_integration"))

    @property
    def enable_diffusers_integration(self) -> bool:
        value = self._enable_diffusers_integration
        return _env_flag("AITUNE_DIFFUSERS_INTEGRATION", False) if value is _UNSET else value

    @enable_diffusers_integration.setter
    def enable_diffusers_integration(self, value: bool) -> None:
        object.__setattr__(self, "_enable_diffusers_integration", _bool(value, "enable_diffusers_integration"))

    # ---- misc
    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._FIELDS:
            raise ConfigError(f"aitune.torch.config has no setting {name!r}; settings: {', '.join(self._FIELDS)}")
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name (paths as strings): JSON-able."""
        values = {name: getattr(self, name) for name in self._FIELDS}
        return {name: str(value) if isinstance(value, Path) else value for name, value in values.items()}

    def __repr__(self) -> str:
        return "AITuneConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"


def _path(value: Any, name: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"config.{name} must be a path, got {value!r}")
    return Path(value).expanduser()


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"config.{name} must be a bool, got {value!r}")
    return value


#: The process-wide configuration.
config = AITuneConfig()
