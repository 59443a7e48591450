"""Checkpoints (``.ait``): save a tuned model or pipeline, load it later without re-tuning.

A checkpoint is one zip archive (stored, not compressed) holding:

``manifest.json``
    format version, aitune/torch/CUDA/package versions, device, and per tuned module (addressed by its
    attribute path in the saved object) and per graph: backend name, build mode, config
    (``BackendConfig.to_dict``), backend metadata (what ``Backend.save`` returned), the graph spec (input
    structure, tensor specs with ranges and axes, constants, output structure), the tune-report row of
    the chosen backend (measured figures) and the tolerance it was checked under (:mod:`.manifest`).
``modules/<m>/graphs/<graph>/artifacts/...``
    what ``Backend.save`` wrote (e.g. a ``.pt2`` package or an ``.onnx`` model).
``modules/<m>/graphs/<graph>/samples.safetensors``
    the recorded samples' tensors (JIT backends recompile from them; they also fix each graph's identity).
``modules/<m>/weights.safetensors``
    the module's ``state_dict`` — only for modules with at least one JIT graph (eager, Inductor JIT,
    TorchAO): AOT artifacts are self-contained, so the weights of AOT-only modules are neither stored nor
    needed at load; their SHA-256 is (``weights_sha256``), and ``load`` compares the target module with it
    (NOTE [one model per loaded module] in :mod:`.load`).
``SHA256SUMS``
    ``<sha256 hex>  <path>`` for every other file (the layout of ``sha256sum``); a copy is written beside
    the archive as ``<stem>_sha256_sums.txt`` (:mod:`.archive`).

Modules: :mod:`.archive` (zip + digests), :mod:`.manifest` (the JSON), :mod:`.wrappers` (paths to the
wrappers), :mod:`.save`, :mod:`.plan` and :mod:`.load` (plan -> restore -> install), :mod:`.describe`,
:mod:`.export` (``aitune export``: the deployment artifacts written to a folder).

NOTE [checkpoint safety]: :func:`load` hashes every member while copying it out of the archive and compares
all digests before anything is deserialised; member names that are absolute, contain ``..`` or a
backslash, and members not listed in ``SHA256SUMS`` are refused; every file name the manifest or a backend's
metadata gives is resolved inside the extracted checkpoint and must be a verified member
(:func:`.archive.checkpoint_path`). Stored backend configs and tolerances with fields or a version this aitune
does not know are refused (``BackendConfig.from_dict``). Nothing is unpickled: tensors come from
safetensors, everything else from JSON. Python types named by a checkpoint (user dataclasses, namedtuples,
``transformers`` ``ModelOutput`` classes in input/output structures) are looked up only among modules
already imported in this process (``sys.modules``) and the few library modules of
:data:`aitune.torch.record.serialization.IMPORTABLE_MODULES`, which may be imported; no other import happens.
What this does not give: the SHA-256 digests are stored in and beside the archive, so they detect
corruption and accidental changes (integrity), not tampering — whoever can rewrite the archive can rewrite
its sums file too (NOTE [what the digests prove] in :mod:`.archive`). And an Inductor AOT artifact
(``inductor_aot``) contains a compiled shared library that :func:`load` loads and runs in this process, so
loading a checkpoint from an untrusted source runs native code, whatever the digests say: load only
checkpoints you made or got from a source you trust.

NOTE [checkpoint devices]: ``load(..., device=None)`` picks, per module, the device of the module's
parameters when the module needs its weights (a JIT graph), else the device the checkpoint was saved on
when that device exists here, else the CPU. A JIT graph whose saved device type differs from the target
is rebuilt there with a warning (its backend choice was measured elsewhere); an AOT artifact built for
another device type (e.g. a CUDA artifact loaded on a CPU-only machine) or another GPU architecture is
refused with a :class:`~aitune.errors.CheckpointError` — it would either not run or, with AOTInductor,
crash the process — and the message says to load it where it was built or to re-tune. Other
differences (torch/aitune/CUDA versions, another GPU or CPU model) load with one warning that lists them.
"""

from aitune.torch.checkpoint.archive import SUMS, sums_path
from aitune.torch.checkpoint.describe import describe_checkpoint
from aitune.torch.checkpoint.export import export_checkpoint
from aitune.torch.checkpoint.load import ExtractedFiles, load
from aitune.torch.checkpoint.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST
from aitune.torch.checkpoint.save import save
from aitune.torch.checkpoint.wrappers import WrapperEntry, find_wrappers
from aitune.torch.record.serialization import tree_spec_from_json, tree_spec_to_json

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "SUMS", "ExtractedFiles", "WrapperEntry",
           "describe_checkpoint", "export_checkpoint", "find_wrappers", "load", "save", "sums_path",
           "tree_spec_from_json", "tree_spec_to_json"]
