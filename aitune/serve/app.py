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


def build_app(config: ServeConfig, *, checkpoint_on_replicas: str | None = None) -> Application:
    """The Ray Serve application for ``config`` (``serve.run(build_app(config))`` deploys it).

    Reads the checkpoint's manifest here (its batch range sets ``max_ongoing_requests``); nothing is built or
    loaded on the caller's side.

    Args:
        config: the serve config; ``config.checkpoint`` is read here.
        checkpoint_on_replicas: where the replicas read the checkpoint when that differs from
            ``config.checkpoint`` — e.g. its file name when it travels in the job's ``runtime_env``
            ``working_dir`` (:func:`stage_checkpoint`, then ``ray.init(runtime_env={"working_dir": folder})``:
            Ray Serve gives deployments the runtime_env of the job that deploys them, and accepts a local
            ``working_dir`` only there).

    Raises:
        CheckpointError: the checkpoint cannot be read, or has no module ``config.module``.
        ConfigError: a pad value names an input the module does not take.
    """
    manifest = read_manifest(config.checkpoint)
    inputs = TunedInputs(served_module_entry(manifest, config.module), config.pad_values, config.out_of_range)
    replica_config = config
    if checkpoint_on_replicas is not None:
        replica_config = dataclasses.replace(config, checkpoint=checkpoint_on_replicas)
    options = config.ray_options(config.max_batch_size or inputs.max_rows)
    return TunedModelDeployment.options(**options).bind(replica_config.to_dict())


def stage_checkpoint(checkpoint: str | Path) -> Path:
    """A new folder holding only ``checkpoint`` and its ``<stem>_sha256_sums.txt``, to ship as a job's
    ``runtime_env`` ``working_dir`` (Ray uploads it once and unpacks it on every node that runs a replica;
    the replicas' working directory is then that folder, so the builder must be an installed package)."""
    checkpoint = Path(checkpoint)
    staged = Path(tempfile.mkdtemp(prefix="aitune-serve-"))
    for file in (checkpoint, sums_path(checkpoint)):
        if file.exists():
            shutil.copy2(file, staged / file.name)
    return staged


def run(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, blocking: bool = False,
        checkpoint_on_replicas: str | None = None):
    """Deploy ``config`` on the connected Ray cluster (``ray.init`` first) and return its handle.

    Starts Ray Serve's HTTP proxy on ``host:port`` if it is not running; the application answers under
    ``http://host:port{config.route_prefix}`` (on a cluster where Serve already runs, its proxy keeps its own
    host and port). Waits until every replica has loaded and warmed up. ``checkpoint_on_replicas``: as
    :func:`build_app`.

    Returns:
        The ``DeploymentHandle`` of the application (``handle.infer.remote(inputs)``, ``handle.stats.remote()``).
    """
    serve.start(http_options={"host": host, "port": port})
    application = build_app(config, checkpoint_on_replicas=checkpoint_on_replicas)
    handle = serve.run(application, name=config.name, route_prefix=config.route_prefix, blocking=blocking)
    return handle
