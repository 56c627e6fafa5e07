"""``wdsllm pack``: tokenize inputs into shards, with a progress line and a summary."""

from __future__ import annotations

import shlex
import sys
from functools import partial

import click

from ..errors import ON_ERROR, WdsllmError
from .options import COUNT, POSITIVE, SizeType, json_option, setup_logging
from .output import INTERRUPTED, ProgressLine, bar, echo, fail, human, human_bytes, plural, to_json


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Output directory, or s3://bucket/prefix/.")
@click.option(
    "--tokenizer",
    "-t",
    required=True,
    help="A tokenizer.json path, or a Hugging Face name (needs the Hub or its cache).",
)
@click.option(
    "--mode",
    type=click.Choice(["docs", "packed"]),
    default="docs",
    show_default=True,
    help="One document per sample, or fixed rows.",
)
@click.option("--seq-len", type=POSITIVE, help="Row length for --mode packed.")
@click.option(
    "--max-doc-tokens", type=POSITIVE, help="Split longer documents into pieces (docs mode). Never truncates."
)
@click.option(
    "--split",
    type=click.Choice(["line", "paragraph", "file"]),
    default="line",
    show_default=True,
    help="How .txt inputs become documents.",
)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="JSON field or Parquet/Arrow column with the text; dots reach nested keys and struct fields (meta.body).",
)
@click.option(
    "--input-format",
    type=click.Choice(["txt", "jsonl", "parquet", "arrow", "wds"]),
    help="Treat every input as this type (needed for stdin: txt, jsonl or wds).",
)
@click.option(
    "--where",
    metavar="EXPR",
    help="Keep only the documents this holds for, e.g. \"score >= 0.9 and lang in ('en', 'de')\": comparisons, in, "
    "is [not] null, and/or/not over JSON fields, Parquet/Arrow columns or a tar sample's .json. Others are counted "
    "as filtered.",
)
@click.option(
    "--max-doc-bytes",
    type=SizeType(),
    default="16MiB",
    show_default=True,
    help="A longer document (line, paragraph, row, sample) is bad input: an error, or skipped with --on-error skip.",
)
@click.option(
    "--bos/--no-bos",
    default=None,
    help="Prepend BOS. Default: as the tokenizer's post-processor does (Llama yes, GPT-2 no).",
)
@click.option("--eos/--no-eos", default=True, show_default=True, help="Append EOS to every document.")
@click.option("--bos-token", help="BOS token text, when the tokenizer does not name one.")
@click.option("--eos-token", help="EOS token text, when the tokenizer does not name one.")
@click.option("--shard-size", type=SizeType(), default="128MiB", show_default=True, help="Largest shard in bytes.")
@click.option("--shard-samples", type=POSITIVE, help="Most documents (docs mode) or rows (packed) per shard.")
@click.option(
    "--sample-tokens",
    type=POSITIVE,
    default=262144,
    show_default=True,
    help="Tokens per tar sample (a group of documents or rows).",
)
@click.option("--prefix", default="shard", show_default=True, help="Shard name prefix: PREFIX-000000.tar.")
@click.option(
    "--dtype",
    type=click.Choice(["uint16", "uint32"]),
    help="Token dtype [default: the smallest that holds the vocabulary]; uint32 leaves room to extend it.",
)
@click.option("--workers", "-j", type=COUNT, default=0, help="Tokenizer processes [default: all cores].")
@click.option(
    "--on-error",
    type=click.Choice([*ON_ERROR, "stop"]),
    default="raise",
    show_default=True,
    help="Bad input: raise an error that names the file and line, or skip it (counted and listed). 'stop' is the old "
    "word for raise.",
)
@click.option(
    "--num-tasks",
    type=POSITIVE,
    help="Split the inputs into this many disjoint tasks [default: SLURM array or torchrun size, else 1].",
)
@click.option(
    "--task-index", type=COUNT, help="Which task this process packs [default: SLURM array id or torchrun rank]."
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output.")
@click.option("--resume", is_flag=True, help="Finish an interrupted pack into the same output.")
@click.option("-q", "--quiet", is_flag=True, help="No progress line and no summary.")
@json_option("Print the summary as one JSON object (progress stays on stderr).")
@click.pass_context
def pack(ctx, inputs, quiet, as_json, **settings):
    """Tokenize INPUT... (files, directories, globs, {a,b} patterns, or - for stdin) into shards.

    \b
    Examples:
      wdsllm pack data/*.jsonl.gz -o out/ -t tokenizer.json
      wdsllm pack book.txt --split paragraph -o out/ -t tok.json --mode packed --seq-len 2048
      cat x.jsonl | wdsllm pack - --input-format jsonl -o s3://bucket/ds/ -t tok.json
      wdsllm pack data/ -o out/ -t tok.json --resume      # finish an interrupted pack

    Ctrl-C stops cleanly (status 130) and prints the command that continues the pack.
    """
    from ..pack.job import PackConfig
    from ..pack.job import pack as run_pack

    setup_logging(ctx.obj["verbose"], quiet)
    if settings["on_error"] == "stop":
        echo("warning: --on-error stop is deprecated; it is now called --on-error raise", err=True)
        settings["on_error"] = "raise"
    settings["num_tasks"], settings["task_index"] = _task(settings, quiet)
    cfg = PackConfig(inputs=list(inputs), **settings)
    line = ProgressLine(quiet)
    try:
        result = run_pack(cfg, on_progress=partial(_show_progress, line))
    except KeyboardInterrupt:
        line.clear()
        echo(f"interrupted; the finished shards are kept. To continue:\n  {_resume_command(ctx)}", err=True)
        raise SystemExit(INTERRUPTED) from None
    except (WdsllmError, OSError) as exc:
        fail(exc)
    if as_json:
        echo(to_json(_pack_json(result)))
    elif not quiet:
        _pack_summary(result)


def _task(settings: dict, quiet: bool) -> tuple[int, int]:
    """This process's (num_tasks, task_index): as given, else from SLURM or torchrun, else (1, 0)."""
    from ..pack.job import task_from_env

    num_tasks, task_index = settings["num_tasks"], settings["task_index"]
    if (num_tasks is None) != (task_index is None):
        raise click.UsageError("--num-tasks and --task-index go together")
    if num_tasks is not None:
        return num_tasks, task_index
    try:
        num_tasks, task_index, source = task_from_env()
    except WdsllmError as exc:
        fail(exc)
    if source and not quiet:
        output = settings["output"]
        echo(
            f"task {task_index} of {num_tasks} (from {source}); writes {output.rstrip('/')}/task-{task_index:05d}",
            err=True,
        )
    return num_tasks, task_index


def _show_progress(line: ProgressLine, p) -> None:
    fraction = min(1.0, p.input_bytes / p.input_total) if p.input_total else 0.0
    shown = f"{bar(fraction)} {100 * fraction:5.1f}% " if p.input_total else ""
    line.show(
        f"{shown}{human(p.documents)} docs {human(p.tokens)} tokens | "
        f"{human(p.documents_per_s)} docs/s {human(p.tokens_per_s)} tok/s | "
        f"{plural(p.shards, 'shard')} | {human(p.skipped)} skipped",
        final=p.done,
    )


def _resume_command(ctx: click.Context) -> str:
    """The command line that continues this pack: the same one, with --resume instead of --overwrite."""
    args = [a for a in ctx.find_root().obj.get("argv", sys.argv[1:]) if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["wdsllm", *args])


def _pack_json(result) -> dict:
    idx = result.index
    p = result.progress
    return {
        "output": result.output,
        "mode": idx.mode,
        "dtype": idx.dtype,
        "seq_len": idx.seq_len,
        **idx.totals(),
        "elapsed_s": round(p.elapsed, 3),
        "tokens_per_s": round(p.tokens_per_s),
        "resumed_shards": result.resumed_shards,
        "skipped": {"total": idx.skipped.get("total", 0), "counts": idx.skipped.get("counts", {})},
    }


def _pack_summary(result) -> None:
    idx = result.index
    t = idx.totals()
    p = result.progress
    echo(
        f"packed {t['documents']:,} documents, {t['tokens']:,} tokens into {plural(t['shards'], 'shard')} "
        f"({human_bytes(t['bytes'])}) at {result.output}"
    )
    echo(
        f"  {p.tokens_per_s:,.0f} tokens/s over {p.elapsed:.1f} s; "
        f"{t['bytes'] / max(t['tokens'], 1):.3f} bytes/token; "
        f"dtype {idx.dtype}; mode {idx.mode}"
        + (f" seq_len {idx.seq_len}, {t.get('rows', 0):,} rows" if idx.seq_len else "")
    )
    if result.resumed_shards:
        echo(f"  resumed after {plural(result.resumed_shards, 'finished shard')}")
    _print_skipped(idx.skipped)


def _print_skipped(skipped: dict, limit: int = 10) -> None:
    from ..inputs.sources import UNLISTED

    if not skipped.get("total"):
        return
    counts = ", ".join(f"{k} {v:,}" for k, v in skipped["counts"].items())
    echo(f"  skipped {skipped['total']:,}: {counts}")
    for rec in skipped["records"][:limit]:
        where = f"{rec['file']}:{rec['line']}" + (f" ({rec['key']})" if rec.get("key") else "")
        many = f" (x{rec['count']:,})" if rec.get("count", 1) != 1 else ""
        echo(f"    {where}: {rec['reason']}{many} {rec['detail']}".rstrip())
    listed = sum(v for k, v in skipped["counts"].items() if k not in UNLISTED)
    more = listed - sum(r.get("count", 1) for r in skipped["records"][:limit])
    if more > 0:
        echo(
            f"    ... {more:,} more listed in index.json"
            if len(skipped["records"]) > limit
            else f"    ... {more:,} more (not listed)"
        )
