"""`--where` over hostile literals (#31): a clear error naming the place, never a raw ValueError."""

from __future__ import annotations

import pytest

from wdsllm.errors import ConfigError
from wdsllm.inputs.where import parse_where


@pytest.mark.parametrize("literal", ["9" * 5000, "-" + "1" * 4301, "1." + "0" * 5000, "1e" + "9" * 200])
def test_a_number_of_thousands_of_digits_is_a_named_error(literal):
    with pytest.raises(
        ConfigError, match=r"--where: the number at character 7 has \d+ characters \(at most 100\)"
    ) as exc:
        parse_where(f"x.y > {literal}")
    assert len(str(exc.value)) < 200


def test_long_but_reasonable_numbers_still_parse():
    where = parse_where("a == 123456789012345678901234567890 and b < 1.5e300")
    assert where.keeps({"a": 123456789012345678901234567890, "b": 1.0})
