"""Requests checked against a real checkpoint's tuned inputs, the JSON tensor form, and batch planning."""

import math

import pytest
import torch

from aitune.errors import ConfigError, RequestError
from aitune.serve.batching import OutputNotSplittable, plan_calls, split_outputs
from aitune.serve.fit import read_manifest, served_module_entry
from aitune.serve.inputs import TunedInputs
from aitune.serve.tensors import tensor_from_json, to_json

PAD = {"input_ids": 0, "attention_mask": 0}


@pytest.fixture(scope="module")
def entry(tiny_checkpoint):
    return served_module_entry(read_manifest(tiny_checkpoint), None)


def ids(rows, tokens, value=1):
    return {"input_ids": [[value] * tokens] * rows, "attention_mask": [[1] * tokens] * rows}


def test_tuned_ranges_come_from_the_checkpoint(entry):
    inputs = TunedInputs(entry)
    graph = inputs.graphs[0]
    assert set(graph.tensors) == {"input_ids", "attention_mask"}
    assert graph.batch_range == (1, 4) and inputs.max_rows == 4
    spec = graph.tensors["input_ids"]
    assert spec.dtype == torch.int64 and spec.low == (1, 4) and spec.high == (4, 8) and spec.batch_axis == 0
    assert inputs.tuned_latency_ms is not None and inputs.tuned_latency_ms > 0


def test_good_request_in_both_tensor_forms(entry):
    inputs = TunedInputs(entry)
    request = inputs.prepare({"input_ids": {"data": [1, 2, 3, 4, 5, 6, 7, 8], "dtype": "int64", "shape": [2, 4]},
                              "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 0]]})
    assert request.rows == 2 and request.in_range
    assert request.tensors["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    args, kwargs = request.graph.call_arguments(request.tensors)
    assert args == () and set(kwargs) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize("body, status, field, words", [
    ([1, 2], 400, "inputs", "non-empty object"),
    ({"input_ids": [[1, 2, 3, 4]]}, 422, "inputs.attention_mask", "missing attention_mask"),
    ({**ids(1, 4), "pixels": [[1]]}, 422, "inputs.pixels", "unexpected pixels"),
    ({**ids(1, 4), "input_ids": [[1.5, 2, 3, 4]]}, 422, "inputs.input_ids", "floating-point"),
    ({**ids(1, 4), "input_ids": {"data": [[1, 2, 3, 4]], "dtype": "float32"}}, 422, "inputs.input_ids", "dtype float32"),
    ({**ids(1, 4), "input_ids": {"values": [[1, 2, 3, 4]]}}, 400, "inputs.input_ids", "'data'"),
    ({**ids(1, 4), "input_ids": [[1, 2], [3]]}, 422, "inputs.input_ids", "rectangular"),
    ({**ids(1, 4), "input_ids": [1, 2, 3, 4]}, 422, "inputs.input_ids", "rank 1"),
    (ids(1, 9), 422, "inputs.input_ids", "outside the tuned range 4..8"),
    (ids(5, 4), 422, "inputs.input_ids", "outside the tuned range 1..4"),
    ({**ids(1, 4), "attention_mask": [[1, 1, 1, 1]] * 2}, 422, "inputs", "disagree on the batch size"),
    ({"input_ids": {"data": [], "shape": [0, 4]}, "attention_mask": {"data": [], "shape": [0, 4]}}, 422,
     "inputs.input_ids", "holds no values"),
    ({**ids(1, 4), "input_ids": {"data": [1, 2, 3], "shape": [1, 4]}}, 422, "inputs.input_ids", "do not fill"),
])
def test_bad_requests_name_the_field(entry, body, status, field, words):
    with pytest.raises(RequestError) as info:
        TunedInputs(entry).prepare(body)
    assert info.value.status == status
    assert info.value.field.startswith(field)
    assert words in str(info.value)


def test_padding_lifts_short_inputs_into_the_tuned_range_and_must_agree(entry):
    inputs = TunedInputs(entry, pad_values=PAD)
    request = inputs.prepare(ids(1, 2))
    assert request.tensors["input_ids"].tolist() == [[1, 1, 0, 0]]
    assert request.tensors["attention_mask"].tolist() == [[1, 1, 0, 0]]
    with pytest.raises(RequestError, match="padded together must have equal sizes"):
        inputs.prepare({"input_ids": [[1, 1]], "attention_mask": [[1, 1, 1]]})
    with pytest.raises(ConfigError, match="token_type_ids"):
        TunedInputs(entry, pad_values={"token_type_ids": 0})


def test_out_of_range_eager_lets_the_request_through_marked(entry):
    request = TunedInputs(entry, out_of_range="eager").prepare(ids(1, 12))
    assert not request.in_range


def test_plan_concatenates_pads_and_chunks_at_the_tuned_batch(entry):
    inputs = TunedInputs(entry, pad_values=PAD)
    requests = [inputs.prepare(ids(1, 4, value=1)), inputs.prepare(ids(2, 6, value=2)),
                inputs.prepare(ids(1, 5, value=3)), inputs.prepare(ids(2, 8, value=4))]
    calls = plan_calls(requests, PAD)
    # 1 + 2 + 1 rows fill the tuned batch of 4; the last request starts the next call.
    assert [call.rows for call in calls] == [4, 2]
    assert [index for index, _ in calls[0].members] == [0, 1, 2]
    assert calls[0].tensors["input_ids"].shape == (4, 6)
    assert calls[0].tensors["input_ids"][0].tolist() == [1, 1, 1, 1, 0, 0]
    assert calls[0].tensors["attention_mask"][3].tolist() == [1, 1, 1, 1, 1, 0]
    assert [call.rows for call in plan_calls(requests, PAD, max_rows=2)] == [1, 2, 1, 2]


def test_without_pad_values_only_equal_lengths_share_a_call(entry):
    inputs = TunedInputs(entry)
    requests = [inputs.prepare(ids(1, 4)), inputs.prepare(ids(1, 6)), inputs.prepare(ids(1, 4))]
    calls = plan_calls(requests, {})
    assert sorted(len(call.members) for call in calls) == [1, 2]


def test_outputs_split_back_by_rows(entry):
    inputs = TunedInputs(entry)
    call = plan_calls([inputs.prepare(ids(1, 4)), inputs.prepare(ids(2, 4))], {})[0]
    output = {"embedding": torch.arange(6.0).reshape(3, 2), "scores": torch.arange(3.0)}
    first, second = split_outputs(output, call)
    assert first["embedding"].tolist() == [[0.0, 1.0]] and second["scores"].tolist() == [1.0, 2.0]
    with pytest.raises(OutputNotSplittable):
        split_outputs(torch.zeros(2, 2), call)


def test_json_form_of_outputs():
    assert to_json(torch.tensor([[1.0, float("nan")], [float("inf"), -float("inf")]])) == {
        "data": [[1.0, "NaN"], ["Infinity", "-Infinity"]], "dtype": "float32", "shape": [2, 2]}
    assert to_json({"a": (torch.tensor([1]), None)}) == {"a": [{"data": [1], "dtype": "int64", "shape": [1]}, None]}
    assert math.isclose(to_json(torch.tensor(0.5, dtype=torch.bfloat16))["data"], 0.5)


def test_tensor_from_json_accepts_tensors_and_checks_their_dtype():
    assert tensor_from_json(torch.ones(2, dtype=torch.int64), torch.int64, "x").tolist() == [1, 1]
    with pytest.raises(RequestError, match="dtype float32 given"):
        tensor_from_json(torch.ones(2), torch.int64, "x")
    assert tensor_from_json([True, False], torch.float32, "x").tolist() == [1.0, 0.0]
