"""The ``wdsllm`` command group and its entry point. Only this package prints; the library logs.

Manners: a closed pipe (``wdsllm head ds | head``) ends quietly with status 0; Ctrl-C ends with
status 130 (and, for ``pack``, the command that continues the work); an error is one line that
names what and where, never a traceback (``-vv`` adds one for an unexpected error).
"""

from __future__ import annotations

import sys

import click

from .. import __version__
from ..errors import WdsllmError
from .count import count
from .explain import explain
from .inspect import head, info, verify
from .merge import merge
from .metrics import metrics
from .output import INTERRUPTED, echo, message, quiet_stdout, to_json
from .pack import pack
from .stats import stats


class _Commands(click.Group):
    """The command group; a reader that closed the pipe ends the command quietly (status 0),
    before click would turn it into status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            quiet_stdout()
            raise click.exceptions.Exit(0) from None
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.ClickException as exc:
            _answer_error(ctx.obj, exc.format_message())
            raise
        except WdsllmError as exc:
            _answer_error(ctx.obj, message(exc))
            raise
        except Exception as exc:
            _answer_error(ctx.obj, unexpected(exc))
            raise


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="wdsllm")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug and tracebacks).")
@click.pass_context
def cli(ctx: click.Context, verbose: int) -> None:
    """Pack text into WebDataset shards of token ids, and inspect them.

    \b
    Examples:
      wdsllm pack corpus/*.jsonl.gz -o out/wiki -t tokenizer.json
      wdsllm info out/wiki
      python -m wdsllm verify out/wiki --json
    """
    ctx.ensure_object(dict)["verbose"] = verbose


for _command in (pack, count, merge, info, verify, head, stats, metrics, explain):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """The ``wdsllm`` command: run it, and turn what escapes into a status and one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    obj: dict = {"argv": args, "verbose": 0}
    try:
        status = cli.main(args=args, prog_name="wdsllm", obj=obj, standalone_mode=False)
        sys.stdout.flush()  # a closed pipe shows here, not as noise at exit
    except BrokenPipeError:
        quiet_stdout()
        sys.exit(0)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt) or isinstance(exc.__cause__, KeyboardInterrupt):
            echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
        echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        echo("interrupted", err=True)
        sys.exit(INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except WdsllmError as exc:
        echo(f"Error: {message(exc)}", err=True)
        sys.exit(1)
    except Exception as exc:  # a bug: one line, and the traceback only when asked for
        if obj.get("verbose", 0) >= 2:
            import traceback

            traceback.print_exc()
        echo(f"Error: {unexpected(exc)}", err=True)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)


def unexpected(exc: Exception) -> str:
    """The one line for an error that is a bug of ours."""
    return (
        f"unexpected {type(exc).__name__}: {message(exc)} (a bug in wdsllm: please report it with the command; "
        "-vv shows the traceback)"
    )


def _answer_error(obj: dict | None, text: str) -> None:
    """A command asked for --json answers a failure as one JSON object on stdout, which is what a
    script reads; the line on stderr stays for people."""
    if obj and obj.get("json"):
        try:
            echo(to_json({"ok": False, "error": text}))
        except BrokenPipeError:
            quiet_stdout()
