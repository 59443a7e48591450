"""A minimal aitune backend: ``torch.export`` to a ``.pt2`` file, run the exported program.

docs/adding_a_backend.md walks through it; tests/unit/test_docs_backend_example.py tunes, saves and loads a
model with it. Importing this file registers the backend under the name ``"example_export"``.
"""

import dataclasses
import shutil

import torch

from aitune.torch.backend import Backend, BackendConfig, BuildMode
from aitune.torch.backend.accepted import AcceptedInputs
from aitune.torch.common.files import checkpoint_path

PROGRAM_FILE = "program.pt2"


@dataclasses.dataclass(kw_only=True)
class ExportConfig(BackendConfig):
    """No settings: plain-data fields would go here, checked in ``validate()``."""


class ExportBackend(Backend):
    """``torch.export.export`` of the module, saved with ``torch.export.save``; AOT: the file holds the weights."""

    name, config_class, build_mode = "example_export", ExportConfig, BuildMode.AOT

    def _build(self, module, graph, device, workdir):
        shapes = torch.export.AdditionalInputs()  # axes that differ between the samples become dynamic
        for sample in graph.samples:
            shapes.add(sample.args, sample.kwargs)
        example = max(graph.samples, key=lambda sample: sample.shapes())  # not size 1 where an axis varies
        program = torch.export.export(module, example.args, example.kwargs, dynamic_shapes=shapes)
        torch.export.save(program, workdir / PROGRAM_FILE)
        self._load(workdir, {"program": PROGRAM_FILE}, module, graph, device)

    def _infer(self, args, kwargs):
        with torch.no_grad():
            return self._program(*args, **kwargs)

    def rejects(self, leaves):
        return self._accepted.rejects(leaves)  # dtype, device, rank or size outside what was recorded

    def _save(self, directory):
        if (directory / PROGRAM_FILE).resolve() != (self.workdir / PROGRAM_FILE).resolve():
            shutil.copyfile(self.workdir / PROGRAM_FILE, directory / PROGRAM_FILE)
        return {"program": PROGRAM_FILE}

    def _load(self, directory, metadata, module, graph, device):
        path = checkpoint_path(directory, metadata["program"], "example_export metadata 'program'")
        self._program = torch.export.load(path).module()
        self._accepted = AcceptedInputs.from_graph(graph, device)
