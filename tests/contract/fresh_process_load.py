"""Load checkpoints in a fresh Python process and write what they compute: the contract suite's one script.

Run as ``python fresh_process_load.py REQUEST.json`` (see :func:`run_fresh_process`). Each entry of the
request's ``loads`` names:

* ``id`` and ``checkpoint``: an ``.ait`` file written by ``ait.save``, loaded with ``ait.load`` into a
  freshly built contract model whose weights come from ``seed`` (not the tuned ones: JIT checkpoints must
  restore the tuned weights, AOT artifacts must not need them), then called through the loaded wrapper;
* ``backend_checkpoint`` (AOT backends): a directory written by ``Backend.save``, restored with
  ``Backend.from_checkpoint`` without module or graph, as an AOT artifact must be, and called directly;
* ``inputs``: a safetensors file holding ``<probe>.tokens`` / ``<probe>.mask`` for the ``probes`` (run)
  and the ``refused_probes`` (only asked about with ``accepts``).

Every load runs on its own: an exception is written as that entry's ``error``. The process writes
``outputs.safetensors`` (``<id>|<route>|<probe>|<leaf path>`` -> tensor) and ``result.json`` (per id and
route: the backends in use, ``accepts`` per probe, the output structure per probe) into ``out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS = REPO_ROOT / "tests"


def run_fresh_process(loads: list[dict], directory: Path, timeout_s: float = 600.0) -> tuple[dict, dict]:
    """Run this script on ``loads`` in a fresh interpreter; returns ``(result.json, outputs)``.

    The child gets the caller's ``PYTHONPATH`` plus the repository root and ``tests/`` (for the model's
    classes, which aitune never imports by name); its output goes to ``child.log`` in ``directory``.
    Fails (AssertionError with the end of the log) when the process does not exit with 0.
    """
    from safetensors.torch import load_file

    directory.mkdir(parents=True, exist_ok=True)
    request_path = directory / "request.json"
    request_path.write_text(json.dumps({"loads": loads, "out": str(directory)}))
    paths = [str(REPO_ROOT), str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    with open(directory / "child.log", "w") as log:
        completed = subprocess.run([sys.executable, __file__, str(request_path)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, timeout=timeout_s)
    log_text = (directory / "child.log").read_text()
    assert completed.returncode == 0, f"the fresh process failed ({completed.returncode}):\n{log_text[-4000:]}"
    return json.loads((directory / "result.json").read_text()), load_file(str(directory / "outputs.safetensors"))


def load_one(load: dict, outputs: dict) -> dict:
    """Load one checkpoint both ways it allows and run the probes; returns its entry of ``result.json``."""
    import torch
    from safetensors.torch import load_file

    import aitune.torch as ait
    from aitune.torch.backend import BackendConfig, get_backend_class
    from contract_support import flatten_output, make_model

    tensors = load_file(load["inputs"])
    probes = {name: (tensors[f"{name}.tokens"], tensors[f"{name}.mask"])
              for name in load["probes"] + load["refused_probes"]}
    result: dict[str, dict] = {}

    def run(route: str, call, backend) -> dict:
        report = result.setdefault(route, {"structures": {}, "accepts": {}})
        for name, (tokens, mask) in probes.items():
            report["accepts"][name] = backend.accepts([tokens, mask])
            if name in load["probes"]:
                with torch.no_grad():
                    leaves, structure = flatten_output(call(tokens.clone(), mask.clone()))
                report["structures"][name] = structure
                outputs.update({f"{load['id']}|{route}|{name}|{path}": value for path, value in leaves.items()})
        return report

    loaded = ait.load(make_model(seed=load["seed"]), load["checkpoint"], device="cpu")
    [(graph_name, backend)] = loaded.backends.items()
    run("ait.load", loaded, backend).update(state=loaded.state.value, backends={graph_name: {
        "name": backend.name, "describe": backend.describe(), "build_mode": backend.build_mode.value}})
    saved = load.get("backend_checkpoint")
    if saved:
        restored = get_backend_class(saved["backend"]).from_checkpoint(
            Path(saved["directory"]), BackendConfig.from_dict(saved["config"]), saved["metadata"], None, None, "cpu")
        run("Backend.from_checkpoint", restored, restored)["describe"] = restored.describe()
    return result


def main(request_path: str) -> None:
    from safetensors.torch import save_file

    request = json.loads(Path(request_path).read_text())
    outputs: dict = {}
    results = {}
    for load in request["loads"]:
        try:
            results[load["id"]] = load_one(load, outputs)
        except Exception:  # noqa: BLE001 - reported to the test of that checkpoint, the others still load
            results[load["id"]] = {"error": traceback.format_exc()}
    save_file(outputs, str(Path(request["out"]) / "outputs.safetensors"))
    (Path(request["out"]) / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
