"""The ``wdsllm`` command line: one module per command group.

``app`` holds the group and ``main``; ``options`` the shared option types; ``output`` what every
command writes (redacted lines, one-line errors, the progress line); ``pack``, ``merge``, ``count``,
``inspect`` (info, verify, head) and ``stats`` one command group each.
"""

from .app import cli, main
from .inspect import histogram_lines, info_lines
from .options import SizeType, parse_size
from .output import INTERRUPTED, human, human_bytes

__all__ = [
    "INTERRUPTED",
    "SizeType",
    "cli",
    "histogram_lines",
    "human",
    "human_bytes",
    "info_lines",
    "main",
    "parse_size",
]
