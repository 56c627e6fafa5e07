"""``wdsllm merge``: the task outputs of a multi-task pack combined into one dataset."""

from __future__ import annotations

from functools import partial

import click

from ..errors import WdsllmError
from .options import setup_logging
from .output import ProgressLine, bar, echo, fail, plural


@click.command()
@click.argument("parts", nargs=-1, required=True)
@click.option(
    "-o",
    "--output",
    required=True,
    help="The merged dataset: a directory or s3://bucket/prefix/ (may be the parts' parent).",
)
@click.option("--copy", is_flag=True, help="Copy the shards and keep the parts (default: move them).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output (never the parts in it).")
@click.option(
    "--allow-partial",
    is_flag=True,
    help="Merge even if some tasks of the pack are missing or unfinished (unfinished ones stay where they are).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress line and no summary.")
@click.pass_context
def merge(ctx, parts, output, copy, overwrite, allow_partial, quiet):
    """Combine the task outputs of a multi-task pack (PART... are task dirs, or their parent) into
    one dataset with one index.

    \b
    Shards keep their bytes (their keys are task-qualified) and are renamed PREFIX-%06d.tar in
    task order, then shard order; index.json is written last. Run it again if it was interrupted.

    \b
    Examples:
      wdsllm merge out/ -o out/                # in place: out/task-*/ become out/
      wdsllm merge out/task-0000{0,1} -o merged/ --copy
    """
    from ..pack.merge import merge as run_merge

    setup_logging(ctx.obj["verbose"], quiet)
    on_shard = partial(_show_progress, ProgressLine(quiet))
    try:
        index, used = run_merge(
            list(parts), output, copy=copy, overwrite=overwrite, allow_partial=allow_partial, on_shard=on_shard
        )
    except (WdsllmError, OSError) as exc:
        fail(exc)
    if not quiet:
        t = index.totals()
        echo(
            f"merged {plural(len(used), 'task')} ({'copied' if copy else 'moved'}): {plural(t['shards'], 'shard')}, "
            f"{t['documents']:,} documents, {t['tokens']:,} tokens at {output}"
        )


def _show_progress(line: ProgressLine, done: int, total: int) -> None:
    line.show(f"merge {bar(done / total)} {done}/{total} shards", final=done == total)
