import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch

from aitune.torch.record.pytree import leaf_paths, path_to_name, path_to_str, tree_flatten, tree_unflatten


@dataclasses.dataclass
class HeadOut:
    boxes: torch.Tensor
    scores: torch.Tensor
    extra: dict


Pair = namedtuple("Pair", "left right")


def test_round_trip_keeps_types_keys_and_order():
    value = HeadOut(torch.ones(2), torch.zeros(1), {"z": (torch.ones(1), 3), "a": [None, "s"]})
    nested = (value, Pair(1, torch.ones(3)), OrderedDict(b=1, a=2))
    leaves, spec = tree_flatten(nested)
    assert len(leaves) == spec.num_leaves == 10
    rebuilt = tree_unflatten(spec, leaves)
    assert type(rebuilt[0]) is HeadOut and list(rebuilt[0].extra) == ["z", "a"]
    assert type(rebuilt[1]) is Pair and isinstance(rebuilt[2], dict) and list(rebuilt[2]) == ["b", "a"]
    assert rebuilt[0].extra["z"][1] == 3 and rebuilt[0].extra["a"] == [None, "s"]


def test_model_output_round_trip():
    transformers = pytest.importorskip("transformers")
    output = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(1, 2))
    leaves, spec = tree_flatten(output)
    assert len(leaves) == 1  # None fields are not leaves
    rebuilt = tree_unflatten(spec, [torch.zeros(1, 2)])
    assert type(rebuilt) is type(output) and torch.equal(rebuilt.last_hidden_state, torch.zeros(1, 2))


def test_leaf_paths_and_names():
    _, spec = tree_flatten({"x": torch.ones(1), "options": {"mask": torch.ones(1)}, "pair": (1, 2)})
    paths = leaf_paths(spec)
    assert [path_to_str(p) for p in paths] == ["x", "options.mask", "pair[0]", "pair[1]"]
    assert path_to_name(paths[1], "input") == "input_options_mask"
    assert path_to_name((), "output") == "output"


def test_unflatten_rejects_wrong_leaf_count():
    _, spec = tree_flatten((1, 2))
    with pytest.raises(ValueError):
        tree_unflatten(spec, [1])
    with pytest.raises(ValueError):
        tree_unflatten(spec, [1, 2, 3])


def test_checkpoint_types_from_the_allow_list_are_imported_others_never():
    """ait.load of a checkpoint with transformers ModelOutputs works without the user importing
    transformers.modeling_outputs first; a module outside the allow-list is never imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from aitune.errors import CheckpointError\n"
        "from aitune.torch.record.serialization import resolve_type\n"
        "assert 'transformers.modeling_outputs' not in sys.modules\n"
        "cls = resolve_type('transformers.modeling_outputs:BaseModelOutput', 'model_output')\n"
        "assert cls.__name__ == 'BaseModelOutput'\n"
        "try:\n"
        "    resolve_type('xml.dom.minidom:Document', 'dataclass')\n"
        "except CheckpointError as exc:\n"
        "    assert 'not imported' in str(exc)\n"
        "else:\n"
        "    raise SystemExit('imported a module outside the allow-list')\n"
        "assert 'xml.dom.minidom' not in sys.modules\n"
        "print('ok')\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.stdout.strip().endswith("ok"), completed.stderr[-2000:]
