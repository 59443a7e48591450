"""``ServeConfig``: everything ``aitune serve`` needs, as plain JSON-able data (it travels to every replica)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from aitune.errors import ConfigError

ON_MISMATCH = ("refuse", "eager")
OUT_OF_RANGE = ("reject", "eager")


@dataclasses.dataclass(kw_only=True)
class ServeConfig:
    """How to serve a tuned checkpoint on Ray Serve.

    What each replica runs:
        builder: ``"package.module:function"`` returning the model (or pipeline) in the structure that was
            saved — e.g. ``aitune.serve.examples:minilm_encoder``. A builder with a ``device`` parameter gets
            the replica's device (``"cpu"``, ``"cuda:0"``) and must put the model there. It must be importable
            on every node.
        checkpoint: path of the ``.ait`` file, as the replicas read it: on every node (a shared disk), or
            shipped in the Ray job's ``runtime_env`` (``aitune serve --ship-checkpoint``; :func:`aitune.serve.app.build_app`).
        module: name of the tuned module whose inputs requests carry, when the builder's object is not the
            tuned module itself (default: the tuned module at the root of the saved object).
        device: ``"auto"`` (the GPU Ray assigned to the replica when it has one and torch sees CUDA, else the
            CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        on_mismatch: the checkpoint does not fit this replica's machine (another device type or GPU
            architecture, a backend package missing): ``"refuse"`` (default: the replica fails to start and
            says why) or ``"eager"`` (serve the builder's model eagerly, with a warning and ``mode: eager`` in
            :meth:`stats`). A corrupted checkpoint (digest mismatch) is always refused.
        warmup: run every recorded (tuned) input shape through the replica before it reports ready.

    Requests and batching:
        max_batch_size: rows per model call (Ray Serve's ``max_batch_size``, counted in rows by its
            ``batch_size_fn``). Default: the largest batch the module was tuned for.
        batch_wait_timeout_ms: how long a replica waits to fill a batch (Ray Serve's ``batch_wait_timeout_s``).
            Default: the p50 latency of the smallest tuned batch, from the checkpoint, clamped to [1, 50] ms.
        pad_values: ``{input path: value}`` — requests whose dynamic (non-batch) sizes differ are padded with
            this value to the largest in the batch (and short ones up to the tuned minimum) so that they run
            as one call. Only for inputs where padding does not change the answer (token ids and attention
            masks of a masked-pooling encoder); outputs are split back along axis 0 only.
        out_of_range: a request whose sizes lie outside the tuned range: ``"reject"`` (422, default) or
            ``"eager"`` (run it; the tuned module runs such calls eagerly).
        preprocessor: optional ``"module:function"`` turning a JSON body without ``"inputs"`` (e.g.
            ``{"texts": [...]}``) into ``{input path: tensor}``.

    Ray Serve options (passed through):
        name: application and deployment name. route_prefix: HTTP route (``"/"``).
        num_replicas: fixed replica count (default 1); exclusive with ``autoscaling``.
        autoscaling: Ray Serve ``autoscaling_config`` (``min_replicas``, ``max_replicas``,
            ``target_ongoing_requests``, ...), passed as is.
        num_cpus / num_gpus: logical CPUs / GPUs per replica (``ray_actor_options``; fractions allowed).
        resources: custom Ray resources per replica. max_ongoing_requests: per replica (default: twice the
            batch size, at least 8). health_check_period_s / health_check_timeout_s: Ray Serve's (None: its
            defaults). health_min_calls: a replica fails its health check when at least this many calls since
            the previous check should have run on the tuned backend and every one ran eagerly.

    Raises:
        ConfigError: a field of the wrong type or out of range (the message names it).
    """

    builder: str
    checkpoint: str
    module: str | None = None
    device: str = "auto"
    on_mismatch: str = "refuse"
    warmup: bool = True
    max_batch_size: int | None = None
    batch_wait_timeout_ms: float | None = None
    pad_values: dict[str, float] = dataclasses.field(default_factory=dict)
    out_of_range: str = "reject"
    preprocessor: str | None = None
    name: str = "aitune"
    route_prefix: str = "/"
    num_replicas: int | None = None
    autoscaling: dict[str, Any] | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    max_ongoing_requests: int | None = None
    health_check_period_s: float | None = None
    health_check_timeout_s: float | None = None
    health_min_calls: int = 3

    def __post_init__(self):
        for field in ("builder", "preprocessor"):
            value = getattr(self, field)
            if value is None and field == "preprocessor":
                continue
            if not isinstance(value, str) or ":" not in value or value.startswith(":") or value.endswith(":"):
                raise ConfigError(f"ServeConfig.{field} must be 'package.module:function', got {value!r}")
        _string(self, "checkpoint")
        _string(self, "name")
        if self.module is not None:
            _string(self, "module")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda")
                                                    or self.device.startswith("cuda:")):
            raise ConfigError(f"ServeConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _choice(self, "on_mismatch", ON_MISMATCH)
        _choice(self, "out_of_range", OUT_OF_RANGE)
        if not isinstance(self.warmup, bool):
            raise ConfigError(f"ServeConfig.warmup must be a bool, got {self.warmup!r}")
        if not isinstance(self.route_prefix, str) or not self.route_prefix.startswith("/"):
            raise ConfigError(f"ServeConfig.route_prefix must start with '/', got {self.route_prefix!r}")
        for field in ("max_batch_size", "num_replicas", "max_ongoing_requests"):
            _positive_int(self, field, optional=True)
        _positive_int(self, "health_min_calls")
        for field in ("batch_wait_timeout_ms", "health_check_period_s", "health_check_timeout_s"):
            _number(self, field, optional=True, positive=field != "batch_wait_timeout_ms")
        for field in ("num_cpus", "num_gpus"):
            _number(self, field)
        if not isinstance(self.pad_values, dict) or not all(
                isinstance(k, str) and _is_number(v) for k, v in self.pad_values.items()):
            raise ConfigError(f"ServeConfig.pad_values must map input paths to numbers, got {self.pad_values!r}")
        if not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and _is_number(v) and v >= 0 for k, v in self.resources.items()):
            raise ConfigError(f"ServeConfig.resources must map Ray resource names to amounts >= 0, got {self.resources!r}")
        if self.autoscaling is not None:
            if not isinstance(self.autoscaling, dict):
                raise ConfigError("ServeConfig.autoscaling must be a dict (Ray Serve's autoscaling_config), "
                                  f"got {self.autoscaling!r}")
            if self.num_replicas is not None:
                raise ConfigError("ServeConfig: give num_replicas or autoscaling (min_replicas/max_replicas), not both")

    def ray_options(self, max_batch_rows: int, runtime_env: dict | None = None) -> dict:
        """The options passed to Ray Serve's ``Deployment.options`` (pure data; no Ray needed).

        Args:
            max_batch_rows: the rows one batch holds (the tuned batch, or ``max_batch_size``).
            runtime_env: Ray's ``runtime_env`` for the replicas, if any.

        Returns:
            ``{"name", "ray_actor_options": {"num_cpus", "num_gpus"[, "resources", "runtime_env"]},
            "max_ongoing_requests", "num_replicas" | "autoscaling_config"[, "health_check_period_s",
            "health_check_timeout_s"]}``. ``max_ongoing_requests`` defaults to twice the batch (at least 8): a
            replica fills one batch while it runs another (Ray Serve's batching guide asks for at least
            ``max_batch_size``).
        """
        actor_options: dict = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor_options["resources"] = dict(self.resources)
        if runtime_env:
            actor_options["runtime_env"] = runtime_env
        options: dict = {"name": self.name, "ray_actor_options": actor_options,
                         "max_ongoing_requests": self.max_ongoing_requests or max(8, 2 * max_batch_rows)}
        if self.autoscaling is not None:
            options["autoscaling_config"] = dict(self.autoscaling)
        else:
            options["num_replicas"] = self.num_replicas or 1
        if self.health_check_period_s is not None:
            options["health_check_period_s"] = self.health_check_period_s
        if self.health_check_timeout_s is not None:
            options["health_check_timeout_s"] = self.health_check_timeout_s
        return options

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ServeConfig":
        """Rebuild from :meth:`to_dict`; unknown keys raise ConfigError naming them."""
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"ServeConfig has no field(s) {', '.join(unknown)}; fields: {', '.join(sorted(names))}")
        return cls(**data)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _string(config: ServeConfig, field: str) -> None:
    value = getattr(config, field)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"ServeConfig.{field} must be a non-empty string, got {value!r}")


def _choice(config: ServeConfig, field: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, field)
    if value not in choices:
        raise ConfigError(f"ServeConfig.{field} must be one of {', '.join(choices)}, got {value!r}")


def _positive_int(config: ServeConfig, field: str, optional: bool = False) -> None:
    value = getattr(config, field)
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"ServeConfig.{field} must be an int >= 1, got {value!r}")


def _number(config: ServeConfig, field: str, optional: bool = False, positive: bool = False) -> None:
    value = getattr(config, field)
    if value is None and optional:
        return
    if not _is_number(value) or value < 0 or (positive and value == 0):
        raise ConfigError(f"ServeConfig.{field} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
