"""`--where`: a small filter language over JSON fields and Parquet/Arrow columns, never ``eval``.

    language_score >= 0.9 and lang in ('en', 'de') and not meta.flagged
    url is not null or `odd.name` != 'x'

Grammar (keywords are case-insensitive)::

    expr      := conj ("or" conj)*
    conj      := neg ("and" neg)*
    neg       := "not" neg | "(" expr ")" | predicate
    predicate := operand [cmp operand | ["not"] "in" "(" literal ("," literal)* ")" | "is" ["not"] "null"]
    cmp       := "==" | "=" | "!=" | "<>" | "<" | "<=" | ">" | ">="
    operand   := field | literal
    field     := name ("." name)*      name: [A-Za-z_][A-Za-z0-9_]* or `any text` in backquotes
    literal   := number | 'string' | "string" | true | false | null

A bare operand is a predicate that holds when it is ``true``. Logic is three-valued, as in SQL: a
comparison with a missing or null value, or (in JSON) with a value of another type than the
other side's, is *unknown*; ``not`` of unknown is unknown; a document is kept only when the whole
expression is true. One :class:`Where` evaluates the same way on a JSON object (in the tokenizer
workers) and on a batch of Arrow columns (vectorised, with ``pyarrow.compute``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

MAX_LENGTH = 10_000
MAX_DEPTH = 64
#: characters a number literal may have: past any Arrow decimal (76 digits), far below int()'s 4300
MAX_NUMBER_CHARS = 100

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<number>-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    | (?P<string>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*|`[^`]+`)
    | (?P<op>==|!=|<>|<=|>=|=|<|>)
    | (?P<punct>[(),.])
    )""",
    re.VERBOSE,
)
_KEYWORDS = {"and", "or", "not", "in", "is", "null", "true", "false"}
_OPS = {"==": "eq", "=": "eq", "!=": "ne", "<>": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "t": "\t"}


# ----------------------------------------------------------------------------------------------
# The tree.


@dataclass(frozen=True)
class Field:
    path: tuple[str, ...]

    @property
    def name(self) -> str:
        return ".".join(p if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) else f"`{p}`" for p in self.path)


@dataclass(frozen=True)
class Literal:
    value: Any  # None, bool, int, float or str


@dataclass(frozen=True)
class Compare:
    op: str  # eq ne lt le gt ge
    left: Field | Literal
    right: Field | Literal


@dataclass(frozen=True)
class In:
    operand: Field | Literal
    values: tuple
    negated: bool


@dataclass(frozen=True)
class IsNull:
    operand: Field | Literal
    negated: bool


@dataclass(frozen=True)
class Not:
    item: Any


@dataclass(frozen=True)
class And:
    items: tuple


@dataclass(frozen=True)
class Or:
    items: tuple


# ----------------------------------------------------------------------------------------------
# Parsing.


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ConfigError(f"--where: cannot read {text[pos:].strip()[:20]!r} (at character {pos + 1})")
        pos = m.end()
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "number":
            if len(value) > MAX_NUMBER_CHARS:
                raise ConfigError(
                    f"--where: the number at character {m.start(kind) + 1} has {len(value)} characters "
                    f"(at most {MAX_NUMBER_CHARS}): {value[:12]}..."
                )
            number = float(value) if any(c in value for c in ".eE") else int(value)
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(f"--where: {value} is not a finite number")
            out.append(("lit", number))
        elif kind == "string":
            out.append(("lit", _unquote(value)))
        elif kind == "name" and value.startswith("`"):
            out.append(("name", value[1:-1]))
        elif kind == "name" and value.lower() in _KEYWORDS:
            word = value.lower()
            if word in ("null", "true", "false"):
                out.append(("lit", {"null": None, "true": True, "false": False}[word]))
            else:
                out.append(("kw", word))
        else:
            out.append((kind, value))
    out.append(("end", None))
    return out


def _unquote(quoted: str) -> str:
    body, out, i = quoted[1:-1], [], 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            out.append(_ESCAPES.get(body[i + 1], body[i + 1]))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    def peek(self, kind: str, value: Any = None) -> bool:
        k, v = self.toks[self.i]
        return k == kind and (value is None or v == value)

    def take(self, kind: str, value: Any = None) -> Any:
        if not self.peek(kind, value):
            k, v = self.toks[self.i]
            found = "the end" if k == "end" else repr(v)
            raise ConfigError(f"--where {self.text!r}: expected {value or kind}, found {found}")
        v = self.toks[self.i][1]
        self.i += 1
        return v

    def parse(self):
        node = self.expr()
        self.take("end")
        return node

    def expr(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ConfigError(f"--where: nested deeper than {MAX_DEPTH} levels")
        items = [self.conj()]
        while self.peek("kw", "or"):
            self.i += 1
            items.append(self.conj())
        self.depth -= 1
        return items[0] if len(items) == 1 else Or(tuple(items))

    def conj(self):
        items = [self.neg()]
        while self.peek("kw", "and"):
            self.i += 1
            items.append(self.neg())
        return items[0] if len(items) == 1 else And(tuple(items))

    def neg(self):
        if self.peek("kw", "not"):
            self.i += 1
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ConfigError(f"--where: nested deeper than {MAX_DEPTH} levels")
            node = Not(self.neg())
            self.depth -= 1
            return node
        if self.peek("punct", "("):
            self.i += 1
            node = self.expr()
            self.take("punct", ")")
            return node
        return self.predicate()

    def operand(self):
        if self.peek("lit"):
            return Literal(self.take("lit"))
        if self.peek("name"):
            path = [self.take("name")]
            while self.peek("punct", "."):
                self.i += 1
                path.append(self.take("name"))
            return Field(tuple(path))
        k, v = self.toks[self.i]
        found = "the end" if k == "end" else repr(v)
        raise ConfigError(f"--where {self.text!r}: expected a field or a value, found {found}")

    def predicate(self):
        left = self.operand()
        if self.peek("op"):
            op = _OPS[self.take("op")]
            right = self.operand()
            if any(isinstance(side, Literal) and side.value is None for side in (left, right)):
                raise ConfigError(f"--where {self.text!r}: compare with null by 'is null' or 'is not null'")
            return Compare(op, left, right)
        negated = False
        if self.peek("kw", "not") and self.toks[self.i + 1] == ("kw", "in"):
            self.i += 1
            negated = True
        if self.peek("kw", "in"):
            self.i += 1
            self.take("punct", "(")
            values = [self.take("lit")]
            while self.peek("punct", ","):
                self.i += 1
                values.append(self.take("lit"))
            self.take("punct", ")")
            if any(v is None for v in values):
                raise ConfigError(f"--where {self.text!r}: null is never in a list; use 'is null'")
            return In(left, tuple(values), negated)
        if self.peek("kw", "is"):
            self.i += 1
            negated = bool(self.peek("kw", "not"))
            if negated:
                self.i += 1
            if self.take("lit") is not None:
                raise ConfigError(f"--where {self.text!r}: 'is' takes only null ('is null', 'is not null')")
            return IsNull(left, negated)
        return Compare("eq", left, Literal(True))  # a bare operand: true when it is true


# ----------------------------------------------------------------------------------------------
# Evaluation on JSON objects: True, False or None (unknown).

_MISSING = None


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return None  # null, lists, objects: nothing to compare


def _value(node, obj: Any) -> Any:
    if isinstance(node, Literal):
        return node.value
    for part in node.path:
        if not isinstance(obj, Mapping) or part not in obj:
            return _MISSING
        obj = obj[part]
    return obj


_COMPARE = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
}


def _eval(node, obj: Any) -> bool | None:
    if isinstance(node, Compare):
        a, b = _value(node.left, obj), _value(node.right, obj)
        ka, kb = _kind(a), _kind(b)
        if ka is None or ka != kb:
            return None
        return _COMPARE[node.op](a, b)
    if isinstance(node, In):
        a = _value(node.operand, obj)
        ka = _kind(a)
        if ka is None:
            return None
        found = any(_kind(v) == ka and a == v for v in node.values)
        return found != node.negated
    if isinstance(node, IsNull):
        return (_value(node.operand, obj) is None) != node.negated
    if isinstance(node, Not):
        r = _eval(node.item, obj)
        return None if r is None else not r
    if isinstance(node, And):
        unknown = False
        for item in node.items:
            r = _eval(item, obj)
            if r is False:
                return False
            unknown |= r is None
        return None if unknown else True
    if isinstance(node, Or):
        unknown = False
        for item in node.items:
            r = _eval(item, obj)
            if r is True:
                return True
            unknown |= r is None
        return None if unknown else False
    raise TypeError(node)  # pragma: no cover


def _fields(node) -> Iterator[Field]:
    if isinstance(node, Field):
        yield node
    elif isinstance(node, Compare):
        yield from _fields(node.left)
        yield from _fields(node.right)
    elif isinstance(node, (In, IsNull)):
        yield from _fields(node.operand)
    elif isinstance(node, Not):
        yield from _fields(node.item)
    elif isinstance(node, (And, Or)):
        for item in node.items:
            yield from _fields(item)


# ----------------------------------------------------------------------------------------------
# Evaluation on Arrow columns.


def _arrow_value(node, column):
    import pyarrow as pa

    if isinstance(node, Literal):
        return pa.scalar(node.value)
    return column(node)


def _arrow_eval(node, column):
    """A boolean Arrow array (nulls are unknown) for a batch; ``column(Field)`` gives its column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(node, Compare):
        fn = {"eq": pc.equal, "ne": pc.not_equal, "lt": pc.less, "le": pc.less_equal}.get(node.op)
        fn = fn or {"gt": pc.greater, "ge": pc.greater_equal}[node.op]
        return fn(_arrow_value(node.left, column), _arrow_value(node.right, column))
    if isinstance(node, In):
        values = _arrow_value(node.operand, column)
        found = pc.is_in(values, value_set=pa.array(list(node.values)))
        if node.negated:
            found = pc.invert(found)
        return pc.if_else(pc.is_valid(values), found, pa.scalar(None, pa.bool_()))
    if isinstance(node, IsNull):
        nulls = pc.is_null(_arrow_value(node.operand, column))
        return pc.invert(nulls) if node.negated else nulls
    if isinstance(node, Not):
        return pc.invert(_arrow_eval(node.item, column))
    if isinstance(node, (And, Or)):
        combine = pc.and_kleene if isinstance(node, And) else pc.or_kleene
        result = _arrow_eval(node.items[0], column)
        for item in node.items[1:]:
            result = combine(result, _arrow_eval(item, column))
        return result
    raise TypeError(node)  # pragma: no cover


@dataclass(frozen=True)
class Where:
    """A parsed ``--where`` expression (picklable: it travels to the tokenizer workers)."""

    text: str
    tree: Any

    @property
    def fields(self) -> list[Field]:
        """The fields it reads, each once, in order of appearance."""
        return list(dict.fromkeys(_fields(self.tree)))

    def keeps(self, obj: Any) -> bool:
        """Whether a JSON object passes (unknown does not)."""
        return _eval(self.tree, obj) is True

    def mask(self, column, length: int):
        """Which rows of a batch pass, as a boolean Arrow array without nulls; ``column(Field)``
        returns a field's column (an Arrow array of ``length`` values)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        result = _arrow_eval(self.tree, column)
        if isinstance(result, pa.Scalar):  # literals only: the same answer for every row
            return pa.array([result.as_py() is True] * length, pa.bool_())
        return pc.fill_null(result, False)


def parse_where(text: str | None) -> Where | None:
    """Parse a ``--where`` expression; a :class:`ConfigError` says what is wrong and where."""
    if text is None or not text.strip():
        return None
    if len(text) > MAX_LENGTH:
        raise ConfigError(f"--where is longer than {MAX_LENGTH} characters")
    return Where(text, _Parser(text).parse())
