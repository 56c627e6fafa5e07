"""`--where`: the expression language, its three-valued logic, and the same answers on JSON objects
(the workers) and on Arrow columns (pyarrow.compute)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wdsllm.errors import ConfigError
from wdsllm.inputs.columns import resolve
from wdsllm.inputs.where import parse_where


def keeps(expr: str, obj: dict) -> bool:
    return parse_where(expr).keeps(obj)


@pytest.mark.parametrize(
    "expr,obj,expected",
    [
        ("score >= 0.9", {"score": 0.95}, True),
        ("score >= 0.9", {"score": 0.5}, False),
        ("score >= 0.9", {}, False),  # missing is null: unknown, not kept
        ("not score >= 0.9", {}, False),  # not unknown is unknown
        ("not score >= 0.9", {"score": 0.1}, True),
        ("score >= 0.9", {"score": "high"}, False),  # another type: unknown
        ("meta.lang == 'en'", {"meta": {"lang": "en"}}, True),
        ('meta.lang = "en"', {"meta": {"lang": "de"}}, False),
        ("lang in ('en', 'de')", {"lang": "de"}, True),
        ("lang not in ('en', 'de')", {"lang": "fr"}, True),
        ("lang not in ('en', 'de')", {}, False),
        ("url is null", {"url": None}, True),
        ("url is null", {}, True),
        ("url is not null", {"url": "x"}, True),
        ("flag", {"flag": True}, True),
        ("flag", {"flag": 1}, False),  # a boolean is not a number
        ("n == 1", {"n": True}, False),
        ("a > 1 or b > 1", {"a": 0, "b": 2}, True),
        ("a > 1 or b > 1", {"b": 0}, False),
        ("a > 1 or b > 1", {"b": 2}, True),  # unknown or true is true
        ("a > 1 and b > 1", {"a": 0}, False),  # false and unknown is false
        ("(a > 1 or b > 1) and not c", {"a": 2, "c": False}, True),
        ("`odd name`.x <> -1.5e0", {"odd name": {"x": 2}}, True),
        ("NOT (x < 3) AND y IS NOT NULL", {"x": 3, "y": 0}, True),
        ("s >= 'b'", {"s": "c"}, True),
        ("s == 'it''s'", {"s": "x"}, False),
    ],
)
def test_json_evaluation(expr, obj, expected):
    if "''" in expr:  # quotes inside strings are escaped with a backslash, not doubled
        with pytest.raises(ConfigError):
            parse_where(expr)
        return
    assert keeps(expr, obj) is expected


@pytest.mark.parametrize(
    "expr,message",
    [
        ("score >=", "expected a field or a value, found the end"),
        ("score >= 0.9 extra", "expected end"),
        ("score == null", "is null"),
        ("lang in ()", "expected lit"),
        ("lang in ('en', null)", "null is never in a list"),
        ("x is 3", "takes only null"),
        ("__import__('os').system('x')", "expected end"),
        ("a ; b", "cannot read"),
        ("(" * 100 + "a" + ")" * 100, "nested deeper"),
        ("x > 1e999", "not a finite number"),
    ],
)
def test_bad_expressions_are_refused_with_a_reason(expr, message):
    with pytest.raises(ConfigError, match=message):
        parse_where(expr)


def test_fields_and_escapes():
    w = parse_where("`c.d` == 'x\\'y' or a.b > 1 and a.b < 0")
    assert [f.path for f in w.fields] == [("c.d",), ("a", "b")]
    assert w.keeps({"c.d": "x'y"}) and not w.keeps({"c.d": "xy"})
    assert parse_where("   ") is None and parse_where(None) is None


def test_dotted_names_resolve_to_columns_then_struct_fields():
    schema = pa.schema(
        [("a.b", pa.string()), ("a", pa.struct([("b", pa.int64()), ("c", pa.struct([("d", pa.string())]))]))]
    )
    assert resolve(schema, ("a", "b"))[:2] == ("a.b", ())  # a column named with a dot wins
    assert resolve(schema, ("a", "c", "d"))[:2] == ("a", ("c", "d"))
    assert resolve(schema, ("a", "x")) is None and resolve(schema, ("z",)) is None


# ----------------------------------------------------------------------------------------------
# The same answers on JSON and on Arrow columns.

records = st.lists(
    st.fixed_dictionaries({"x": st.integers(-3, 3) | st.none(), "y": st.floats(-3, 3) | st.none()}),
    min_size=1,
    max_size=30,
)
atoms = st.sampled_from(
    ["x > 0", "x <= -1", "y < 1.5", "x == y", "x in (1, 2, -3)", "x not in (0)", "y is null", "x is not null", "x != 2"]
)


@st.composite
def expressions(draw, depth=3):
    if depth == 0 or draw(st.booleans()):
        return draw(atoms)
    op = draw(st.sampled_from(["and", "or", "not"]))
    if op == "not":
        return f"not ({draw(expressions(depth - 1))})"
    return f"({draw(expressions(depth - 1))}) {op} ({draw(expressions(depth - 1))})"


@settings(max_examples=200, deadline=None)
@given(rows=records, expr=expressions())
def test_json_and_arrow_agree(rows, expr):
    where = parse_where(expr)
    batch = pa.RecordBatch.from_pylist(rows, pa.schema([("x", pa.int64()), ("y", pa.float64())]))
    mask = where.mask(lambda f: batch.column(f.path[0]), len(rows)).to_pylist()
    assert mask == [where.keeps(r) for r in rows]
