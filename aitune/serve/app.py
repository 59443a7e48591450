"""From a :class:`~aitune.serve.config.ServeConfig` to a Ray Serve application, and running it.

What scales how (all of it Ray Serve's): replicas spread over the Ray cluster's nodes, each holding the model
once (``num_replicas``, or ``autoscaling`` by ongoing requests per replica); Ray places a replica only where
its ``num_cpus``/``num_gpus``/``resources`` are free; within a replica, concurrent requests are batched up to
the tuned batch; the HTTP proxy routes each request to a replica with room (``max_ongoing_requests``).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path

from ray import serve
from ray.serve import Application

from aitune.serve.config import ServeConfig
from aitune.serve.deployment import TunedModelDeployment
from aitune.serve.fit import read_manifest, served_module_entry
from aitune.serve.inputs import TunedInputs
from aitune.torch.checkpoint import sums_path

logger = logging.getLogger(__name__)


def build_app(config: ServeConfig) -> Application:
    """The Ray Serve application for ``config`` (``serve.run(build_app(config))`` deploys it).

    Reads the checkpoint's manifest here (its batch range sets ``max_ongoing_requests``); nothing is built or
    loaded on the caller's side. With ``ship_checkpoint``, the checkpoint (and its sums file) is copied to a
    staging folder that Ray ships to every replica as its ``working_dir``.

    Raises:
        CheckpointError: the checkpoint cannot be read, or has no module ``config.module``.
        ConfigError: a pad value names an input the module does not take.
    """
    manifest = read_manifest(config.checkpoint)
    inputs = TunedInputs(served_module_entry(manifest, config.module), config.pad_values, config.out_of_range)
    replica_config, runtime_env = config, None
    if config.ship_checkpoint:
        staged = stage_checkpoint(Path(config.checkpoint))
        runtime_env = {"working_dir": str(staged)}
        replica_config = dataclasses.replace(config, checkpoint=Path(config.checkpoint).name)
    options = config.ray_options(config.max_batch_size or inputs.max_rows, runtime_env)
    return TunedModelDeployment.options(**options).bind(replica_config.to_dict())


def stage_checkpoint(checkpoint: Path) -> Path:
    """A new folder holding only ``checkpoint`` and its ``<stem>_sha256_sums.txt`` (for Ray's ``working_dir``)."""
    staged = Path(tempfile.mkdtemp(prefix="aitune-serve-"))
    for file in (checkpoint, sums_path(checkpoint)):
        if file.exists():
            shutil.copy2(file, staged / file.name)
    return staged


def run(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, blocking: bool = False):
    """Deploy ``config`` on the connected Ray cluster (``ray.init`` first) and return its handle.

    Starts Ray Serve's HTTP proxy on ``host:port`` if it is not running; the application answers under
    ``http://host:port{config.route_prefix}``. Waits until every replica has loaded and warmed up.

    Returns:
        The ``DeploymentHandle`` of the application (``handle.infer.remote(inputs)``, ``handle.stats.remote()``).
    """
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(build_app(config), name=config.name, route_prefix=config.route_prefix, blocking=blocking)
    return handle
