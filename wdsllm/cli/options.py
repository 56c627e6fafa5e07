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
    name = "size"

    def convert(self, value, param, ctx):
        return value if isinstance(value, int) else parse_size(value)


def setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet or not verbose else (logging.INFO if verbose == 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
