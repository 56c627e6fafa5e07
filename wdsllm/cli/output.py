"""What the command line writes: redacted lines, one-line errors, the progress line, figures.

Only the cli package prints; the library logs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import click

#: exit status after Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED = 130


def quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def message(exc: BaseException) -> str:
    """An exception's message, never blank, with every URL redacted."""
    from ..storage.urls import redact_text

    text = str(exc).strip()
    if not text or text in ("None", "''"):
        return type(exc).__name__
    return redact_text(text)


def echo(text: object = None, **kwargs: object) -> None:
    """click.echo with every URL redacted: no password or query token reaches a terminal or a log."""
    from ..storage.urls import redact_text

    click.echo(redact_text(text) if isinstance(text, str) else text, **kwargs)


def fail(exc: Exception) -> None:
    """End the command with one line naming what went wrong."""
    if isinstance(exc, BrokenPipeError):
        raise exc  # the reader went away: main() ends quietly
    raise click.ClickException(message(exc))


def to_json(value: object, indent: int | None = None, ensure_ascii: bool = True) -> str:
    """JSON that every parser reads: NaN and the infinities, which JSON has no word for, become null."""
    return json.dumps(_finite(value), indent=indent, ensure_ascii=ensure_ascii, allow_nan=False)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def human(n: float, unit: str = "") -> str:
    for suffix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000
    return f"{n:.3g}P{unit}"


def human_bytes(n: float) -> str:
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {suffix}" if suffix != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} PiB"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def bar(fraction: float, width: int = 20) -> str:
    filled = int(width * max(0.0, min(1.0, fraction)))
    return f"[{'#' * filled}{'.' * (width - filled)}]"


class ProgressLine:
    """One self-overwriting status line on stderr (a plain line per update when not a terminal)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last_plain = 0.0

    def clear(self) -> None:
        """Make room for a message line on a terminal."""
        if self.tty and not self.quiet:
            echo("\r\033[K", err=True, nl=False)

    def show(self, text: str, final: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:
            echo("\r\033[K" + text, err=True, nl=final)
        elif final or time.monotonic() - self.last_plain > 10:
            self.last_plain = time.monotonic()
            echo(text, err=True)
