"""orjson reads and writes the HTTP inference JSON where it gives what ``json`` gives (http.infer_body).

The reference is ``json``'s reading and writing, which the endpoint used alone before: a header given
as ``str`` takes that path (decoded as ``json`` decodes bytes), the same header as ``bytes`` the
orjson one. Whatever the document, both must give the same values (or the same refusal; the one
exception, nesting between json's recursion limit and orjson's 1,024 levels, is read now), and an
answer orjson writes must read back as the one ``json`` writes.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ShoalError
from shoal.http import infer_body

# Integers past 64 bits (orjson would read them as doubles), floats of every kind (NaN and the
# infinities written as json writes them), strings with lone surrogates (json escapes them).
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(alphabet=st.characters(codec=None), max_size=8)
)
_DOCUMENTS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


def _reading(header: bytes | str) -> tuple[str, Any]:
    """What ``_parse_header`` gives, comparable: the document as json writes it (NaN, -0.0 and 1 against
    1.0 told apart), or the refusal's message."""
    try:
        document = infer_body._parse_header(header)
    except ShoalError as exc:
        return "refused", exc.message
    return "read", json.dumps(document)


def _same_reading(header: bytes) -> None:
    try:
        text = header.decode(json.detect_encoding(header), "surrogatepass")
    except UnicodeDecodeError:
        return  # refused before any parser: not a question of which one reads it
    assert _reading(header) == _reading(text)


@settings(max_examples=400, deadline=None)
@given(_DOCUMENTS, st.booleans(), st.sampled_from(["", " ", "\n\t"]))
def test_a_header_reads_the_same_through_orjson_as_through_json(document: Any, ascii_only: bool, space: str) -> None:
    _same_reading((space + json.dumps(document, ensure_ascii=ascii_only) + space).encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_any_bytes_read_or_refused_the_same(raw: bytes) -> None:
    _same_reading(raw)


@pytest.mark.parametrize(
    "text",
    [
        '{"parameters":{"sequence_id":18446744073709551621}}',  # 2**64 + 5: orjson would make it 1.8e19
        '{"x":-9223372036854775809}',
        '{"x":1e400}',
        '{"x":[NaN,Infinity,-Infinity]}',
        '{"id":"Infinity"}',
        '{"x":"\\ud800"}',
        "\ufeff{}",
        '{"a":1,"a":2}',
        "[" * 1100 + "]" * 1100,  # past orjson's 1,024 levels and json's recursion: refused by json
        '{"x":0.1000000000000000055511151231257827}',
    ],
)
def test_what_orjson_reads_otherwise_is_read_by_json(text: str) -> None:
    header = text.encode("utf-8", "surrogatepass")
    _same_reading(header)
    if "18446744073709551621" in text:
        assert _reading(header) == ("read", '{"parameters": {"sequence_id": 18446744073709551621}}')


_ANSWER_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.characters(codec=None), max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _ANSWER_VALUES, max_size=5))
def test_an_answer_without_floats_reads_back_as_json_writes_it(document: dict[str, Any]) -> None:
    written = infer_body._response_json(document, floats_written=False)
    reference = infer_body.COMPACT_JSON.encode(document)
    assert json.loads(written) == json.loads(reference)


def test_floats_are_written_by_json_as_triton_writes_them() -> None:
    document = {"outputs": [{"data": [math.nan, math.inf, -math.inf, 1e16, 0.1]}]}
    assert infer_body._response_json(document, floats_written=True) == (
        b'{"outputs":[{"data":[NaN,Infinity,-Infinity,1e+16,0.1]}]}'
    )


def test_nesting_within_orjson_s_limit_is_read_where_json_s_recursion_gave_up() -> None:
    """The one reading that differs: json gave up (RecursionError) a few levels under orjson's 1,024,
    where the interpreter's stack ends; such a header is read now, as Triton's rapidjson, which has no
    limit of its own, reads it. Past 1,024 both refuse."""
    document = infer_body._parse_header(b'{"x":' + b"[" * 1020 + b"]" * 1020 + b"}")
    depth, inner = 0, document["x"]
    while inner:
        depth, inner = depth + 1, inner[0]
    assert depth == 1019
    refused = _reading(b'{"x":' + b"[" * 1100 + b"]" * 1100 + b"}")
    assert refused[0] == "refused" and refused[1].startswith("failed to parse the request JSON buffer")
