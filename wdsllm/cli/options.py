"""Option types and settings shared by the commands, each written once."""

from __future__ import annotations

import logging
import sys

import click

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1000,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 10**6,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 10**9,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """'128MiB', '1G', '3e9', '4096' -> bytes."""
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("BIKMG")
    unit = s[len(num) :]
    if unit not in SIZE_UNITS:
        raise click.BadParameter(f"unknown size unit in {text!r} (use K, M, G, KiB, MiB, GiB, KB, MB, GB)")
    try:
        return int(float(num) * SIZE_UNITS[unit])
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r}") from None


class SizeType(click.ParamType):
    """A size in bytes, at least one."""

    name = "size"

    def convert(self, value, param, ctx):
        size = value if isinstance(value, int) else parse_size(value)
        if size < 1:
            self.fail(f"{value!r} is not a size of at least 1 byte", param, ctx)
        return size


#: a count that must be at least one (a batch size, a length, a number of tasks)
POSITIVE = click.IntRange(min=1)
#: a count that may be zero (0 often means "all" or "as many as there are cores")
COUNT = click.IntRange(min=0)


def _remember_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """Note that the command answers in JSON, so that main() answers an error in JSON too."""
    if value:
        ctx.ensure_object(dict)["json"] = True
    return value


def json_option(help: str):
    """--json: the command's answer as JSON on stdout; a failure is then a JSON error object there.

    Eager, so that it is noted before the other options are checked."""
    return click.option("--json", "as_json", is_flag=True, is_eager=True, callback=_remember_json, help=help)


def setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet or not verbose else (logging.INFO if verbose == 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
