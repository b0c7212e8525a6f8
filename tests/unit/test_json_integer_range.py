"""JSON integers against an integer input's range, at its edges (:mod:`halfserve.api.dataplane.codec`): what numpy
makes of them (past int64, floats) must neither wrap nor be called fractional; nor may it read a true as 1."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from halfserve.api.dataplane.bounds import JSON_LITERALS, holds_literals
from halfserve.api.dataplane.codec import cast_json_numbers, decode_json, decode_samples
from halfserve.errors import InvalidInputError
from halfserve.manifest import DataType, TensorSpec

BEYOND = "^inputs: values beyond the range of {}$"
"""Integers the parser handed over as floats (past int64), or floats."""
OUTSIDE = r"^inputs: values in \[.*\] do not fit {}$"
"""Integers the parser handed over as integers: their least and greatest are named."""


@pytest.mark.parametrize(
    ("literal", "dtype", "refusal"),
    [
        (b"9223372036854775807", np.int64, None),
        (b"-9223372036854775808", np.int64, None),
        (b"9223372036854775808", np.int64, BEYOND),  # was wrapped to -9223372036854775808
        (b"-9223372036854775809", np.int64, BEYOND),  # was rounded to -2^63 and taken
        (b"18446744073709551617", np.uint64, BEYOND),
        (b"-1", np.uint64, OUTSIDE),
        (b"-128", np.int8, None),
        (b"-128.0", np.int8, None),
        (b"255.0", np.uint8, None),
        (b"256.0", np.uint8, BEYOND),
        (b"2147483648", np.int32, OUTSIDE),
    ],
)
def test_json_integers_at_the_edges_of_a_range(literal: bytes, dtype: type, refusal: str | None) -> None:
    arr = np.asarray(orjson.loads(b"[[1, " + literal + b"]]"))
    if refusal is None:
        out = cast_json_numbers(arr, np.dtype(dtype), "inputs")
        assert int(out[0, 1]) == int(float(literal) if b"." in literal else int(literal))
    else:
        with pytest.raises(InvalidInputError, match=refusal.format(np.dtype(dtype).name)):
            cast_json_numbers(arr, np.dtype(dtype), "inputs")


@pytest.mark.parametrize(
    ("literal", "message"),
    [
        (b"9223372036854775808", "inputs[0].data: values in [1, 9223372036854775808] do not fit int64"),
        (b"-9223372036854775809", "inputs[0].data: values beyond the range of INT64"),
        (b"1.5", "inputs[0].data: INT64 data must be integers"),
        (b"2.0", "inputs[0].data: INT64 data must be integers"),  # as Triton: a float is no INT64, whole or not
    ],
)
def test_v2_names_an_out_of_range_integer_so_and_a_float_as_one(literal: bytes, message: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        decode_json(orjson.loads(b"[1, " + literal + b"]"), DataType.INT64, [1, 2], "inputs[0].data")
    assert str(info.value) == message
    edge = decode_json(orjson.loads(b"[1, 9223372036854775807]"), DataType.INT64, [1, 2], "inputs[0].data")
    assert edge[0, 1] == 2**63 - 1


@pytest.mark.parametrize(
    "values",
    [
        [1, 2**64 - 1],  # int64's and uint64's: numpy made them float64, 2^64 - 1 rounded to 2^64 and refused
        [[0, 2**63], [2**64 - 2, 7]],
        [2**63 + 1, 0],  # float64 rounded it to 2^63
    ],
)
def test_uint64_values_mixed_with_small_ones_are_read_exactly(values: list[object]) -> None:
    data = orjson.loads(orjson.dumps(values))
    assert np.asarray(data).dtype == np.float64  # what made them inexact
    arr = decode_json(data, DataType.UINT64, list(np.shape(values)), "inputs[0].data")
    assert arr.dtype == np.uint64
    assert arr.tolist() == values


def test_integers_past_2_53_beside_a_whole_float_are_exact_for_predict_and_v2_takes_no_float() -> None:
    data = orjson.loads(b"[1.0, 1152921504606846977, -1152921504606846977]")  # +-(2^60 + 1): as float64, +-2^60
    spec = TensorSpec(name="x", datatype=DataType.INT64, shape=[3])
    assert decode_samples([data], spec).tolist() == [[1, 2**60 + 1, -(2**60) - 1]]
    with pytest.raises(InvalidInputError, match=r"^inputs\[0\].data: INT64 data must be integers$"):
        decode_json(data, DataType.INT64, [3], "inputs[0].data")
    with pytest.raises(InvalidInputError, match="fractional"):  # a fraction is still refused
        decode_samples([orjson.loads(b"[1.5, 1152921504606846977]")], spec.model_copy(update={"shape": [2]}))


def test_values_no_64_bit_type_holds_together_are_refused_as_out_of_range() -> None:
    data = orjson.loads(orjson.dumps([-1, 2**64 - 1]))
    with pytest.raises(InvalidInputError, match=r"^inputs\[0\].data: values beyond the range of UINT64$"):
        decode_json(data, DataType.UINT64, [2], "inputs[0].data")
    spec = TensorSpec(name="x", datatype=DataType.INT64, shape=[2])
    with pytest.raises(InvalidInputError, match="^inputs: values beyond the range of int64$"):
        decode_samples([data], spec)
    # A float past 2^53 was rounded by the parser (-2^63 - 1 to -2^63): it is not taken as the integer it became.
    with pytest.raises(InvalidInputError, match="^inputs: values beyond the range of int64$"):
        decode_samples([orjson.loads(b"[0, -9223372036854775809]")], spec)


def test_an_integer_past_2_53_beside_a_float_past_it_is_refused_not_rounded() -> None:
    spec = TensorSpec(name="x", datatype=DataType.INT64, shape=[2])
    with pytest.raises(InvalidInputError, match=r"^inputs: integers past 2\^53 beside floats past it cannot all be"):
        decode_samples([orjson.loads(b"[1e17, 1152921504606846977]")], spec)  # was taken as 2^60
    assert decode_samples([orjson.loads(b"[1e17, 5]")], spec).tolist() == [[10**17, 5]]  # floats alone: as before
    three = TensorSpec(name="x", datatype=DataType.INT64, shape=[3])
    assert decode_samples([orjson.loads(b"[2, 1152921504606846977, 1.0]")], three).tolist() == [[2, 2**60 + 1, 1]]
    with pytest.raises(InvalidInputError, match="^inputs: the 'x' input takes numbers .INT64., got true or false$"):
        decode_samples([orjson.loads(b"[true, 1152921504606846977, 1.0]")], three)  # had been read as 1


@pytest.mark.parametrize("pad", [0, 40_000])  # a body searched byte by byte, and one searched with numpy
def test_a_body_holds_literals_where_true_or_false_is_written_in_it(pad: int) -> None:
    spaces = b" " * pad
    for body, holds in [
        (b'{"inputs": [[true, 1]]}', True),
        (b'{"inputs": [[1, false]]}', True),
        (b'{"text": "it is true"}', True),  # in a string: only the exact look follows
        (b"false", True),
        (b'{"inputs": [[1, 2.5e-05, -3E+2]]}', False),
        (b'{"a": "tru", "b": "fals", "c": "rue"}', False),
    ]:
        assert holds_literals(spaces + body + spaces) is holds, body


@pytest.mark.parametrize(
    ("data", "spec", "refusal"),
    [
        ([[True, 1, 2]], TensorSpec(name="ids", datatype=DataType.INT64, shape=[3]), "the 'ids' input takes numbers"),
        ([[0.5, False, 2]], TensorSpec(name="x", shape=[3]), "the 'x' input takes numbers \\(FP32\\)"),
        ([[1, 0, 1]], TensorSpec(name="keep", datatype=DataType.BOOL, shape=[3]), "the 'keep' input takes true or"),
    ],
)
def test_a_boolean_among_numbers_or_a_number_for_a_bool_is_refused_naming_the_field(
    data: list[list[object]], spec: TensorSpec, refusal: str
) -> None:
    with pytest.raises(InvalidInputError, match=f"^inputs: {refusal}"):
        decode_samples(data, spec)
    wire = spec.datatype
    flat = data[0]
    said = "BOOL data must be true/false" if wire is DataType.BOOL else f"{wire.value} data must be numbers, got true"
    with pytest.raises(InvalidInputError, match=f"^inputs: {said}"):
        decode_json(flat, wire, [1, 3], "inputs")
    token = JSON_LITERALS.set(False)  # a body without a true or false: its numbers are not looked at one by one
    try:
        if wire is not DataType.BOOL:
            assert decode_samples(data, spec).tolist() == np.asarray(data).astype(wire.numpy).tolist()
    finally:
        JSON_LITERALS.reset(token)
