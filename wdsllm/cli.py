"""The `wdsllm` command line. Only this module prints; the library logs.

Manners: a closed pipe (``wdsllm head ds | head``) ends quietly with status 0; Ctrl-C ends with
status 130 (and, for ``pack``, the command that continues the work); an error is one line that
names what and where, never a traceback (``-vv`` adds one for an unexpected error).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time

import click

from . import __version__
from .errors import ON_ERROR, WdsllmError

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


class ProgressLine:
    """One self-overwriting status line on stderr (a plain line per update when not a terminal)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last_plain = 0.0

    def clear(self) -> None:
        """Make room for a message line on a terminal."""
        if self.tty and not self.quiet:
            _echo("\r\033[K", err=True, nl=False)

    def show(self, text: str, final: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:
            _echo("\r\033[K" + text, err=True, nl=final)
        elif final or time.monotonic() - self.last_plain > 10:
            self.last_plain = time.monotonic()
            _echo(text, err=True)


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet or not verbose else (logging.INFO if verbose == 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


class _Commands(click.Group):
    """The command group; a reader that closed the pipe ends the command quietly (status 0),
    before click would turn it into status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            _quiet_stdout()
            raise click.exceptions.Exit(0) from None


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


#: exit status after Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> None:
    """The ``wdsllm`` command: run it, and turn what escapes into a status and one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    obj: dict = {"argv": args, "verbose": 0}
    try:
        status = cli.main(args=args, prog_name="wdsllm", obj=obj, standalone_mode=False)
        sys.stdout.flush()  # a closed pipe shows here, not as noise at exit
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(0)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt) or isinstance(exc.__cause__, KeyboardInterrupt):
            _echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
        _echo("aborted", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        _echo("interrupted", err=True)
        sys.exit(INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except WdsllmError as exc:
        _echo(f"Error: {_message(exc)}", err=True)
        sys.exit(1)
    except Exception as exc:  # a bug: one line, and the traceback only when asked for
        if obj.get("verbose", 0) >= 2:
            import traceback

            traceback.print_exc()
        _echo(
            f"Error: unexpected {type(exc).__name__}: {_message(exc)} (a bug in wdsllm: please report it with the "
            "command; -vv shows the traceback)",
            err=True,
        )
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _message(exc: BaseException) -> str:
    """An exception's message, never blank, with every URL redacted."""
    from .storage.urls import redact_text

    text = str(exc).strip()
    if not text or text in ("None", "''"):
        return type(exc).__name__
    return redact_text(text)


def _echo(message: object = None, **kwargs: object) -> None:
    """click.echo with every URL redacted: no password or query token reaches a terminal or a log."""
    from .storage.urls import redact_text

    click.echo(redact_text(message) if isinstance(message, str) else message, **kwargs)


def _fail(exc: Exception) -> None:
    if isinstance(exc, BrokenPipeError):
        raise exc  # the reader went away: main() ends quietly
    raise click.ClickException(_message(exc))


# ----------------------------------------------------------------------------------------------
# pack


@cli.command()
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
@click.option("--seq-len", type=int, help="Row length for --mode packed.")
@click.option("--max-doc-tokens", type=int, help="Split longer documents into pieces (docs mode). Never truncates.")
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
@click.option("--shard-samples", type=int, help="Most documents (docs mode) or rows (packed) per shard.")
@click.option(
    "--sample-tokens",
    type=int,
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
@click.option("--workers", "-j", type=int, default=0, help="Tokenizer processes [default: all cores].")
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
    type=int,
    help="Split the inputs into this many disjoint tasks [default: SLURM array or torchrun size, else 1].",
)
@click.option(
    "--task-index", type=int, help="Which task this process packs [default: SLURM array id or torchrun rank]."
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output.")
@click.option("--resume", is_flag=True, help="Finish an interrupted pack into the same output.")
@click.option("-q", "--quiet", is_flag=True, help="No progress line and no summary.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as one JSON object (progress stays on stderr)."
)
@click.pass_context
def pack(
    ctx,
    inputs,
    output,
    tokenizer,
    mode,
    seq_len,
    max_doc_tokens,
    split,
    text_field,
    input_format,
    where,
    max_doc_bytes,
    bos,
    eos,
    bos_token,
    eos_token,
    shard_size,
    shard_samples,
    sample_tokens,
    prefix,
    dtype,
    workers,
    on_error,
    num_tasks,
    task_index,
    overwrite,
    resume,
    quiet,
    as_json,
):
    """Tokenize INPUT... (files, directories, globs, {a,b} patterns, or - for stdin) into shards.

    \b
    Examples:
      wdsllm pack data/*.jsonl.gz -o out/ -t tokenizer.json
      wdsllm pack book.txt --split paragraph -o out/ -t tok.json --mode packed --seq-len 2048
      cat x.jsonl | wdsllm pack - --input-format jsonl -o s3://bucket/ds/ -t tok.json
      wdsllm pack data/ -o out/ -t tok.json --resume      # finish an interrupted pack

    Ctrl-C stops cleanly (status 130) and prints the command that continues the pack.
    """
    from .pack.job import PackConfig, task_from_env
    from .pack.job import pack as run_pack

    _setup_logging(ctx.obj["verbose"], quiet)
    if on_error == "stop":
        _echo("warning: --on-error stop is deprecated; it is now called --on-error raise", err=True)
        on_error = "raise"
    if (num_tasks is None) != (task_index is None):
        raise click.UsageError("--num-tasks and --task-index go together")
    if num_tasks is None:
        try:
            num_tasks, task_index, source = task_from_env()
        except WdsllmError as exc:
            _fail(exc)
        if source and not quiet:
            _echo(
                f"task {task_index} of {num_tasks} (from {source}); writes {output.rstrip('/')}/task-{task_index:05d}",
                err=True,
            )
    cfg = PackConfig(
        inputs=list(inputs),
        output=output,
        tokenizer=tokenizer,
        mode=mode,
        seq_len=seq_len,
        max_doc_tokens=max_doc_tokens,
        split=split,
        text_field=text_field,
        input_format=input_format,
        where=where,
        max_doc_bytes=max_doc_bytes,
        bos=bos,
        eos=eos,
        bos_token=bos_token,
        eos_token=eos_token,
        shard_size=shard_size,
        shard_samples=shard_samples,
        sample_tokens=sample_tokens,
        prefix=prefix,
        dtype=dtype,
        workers=workers,
        on_error=on_error,
        num_tasks=num_tasks,
        task_index=task_index,
        overwrite=overwrite,
        resume=resume,
    )
    line = ProgressLine(quiet)

    def on_progress(p) -> None:
        rate = p.tokens / p.elapsed if p.elapsed else 0
        drate = p.documents / p.elapsed if p.elapsed else 0
        fraction = min(1.0, p.input_bytes / p.input_total) if p.input_total else 0.0
        bar = f"{_bar(fraction)} {100 * fraction:5.1f}% " if p.input_total else ""
        line.show(
            f"{bar}{human(p.documents)} docs {human(p.tokens)} tokens | {human(drate)} docs/s {human(rate)} tok/s | "
            f"{_plural(p.shards, 'shard')} | {human(p.skipped)} skipped",
            final=p.done,
        )

    try:
        result = run_pack(cfg, on_progress=on_progress)
    except KeyboardInterrupt:
        line.clear()
        _echo(f"interrupted; the finished shards are kept. To continue:\n  {_resume_command(ctx)}", err=True)
        raise SystemExit(INTERRUPTED) from None
    except (WdsllmError, OSError) as exc:
        _fail(exc)
    if as_json:
        _echo(json.dumps(_pack_json(result)))
    elif not quiet:
        _pack_summary(result)


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
        "tokens_per_s": round(p.tokens / max(p.elapsed, 1e-9)),
        "resumed_shards": result.resumed_shards,
        "skipped": {"total": idx.skipped.get("total", 0), "counts": idx.skipped.get("counts", {})},
    }


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _bar(fraction: float, width: int = 20) -> str:
    filled = int(width * max(0.0, min(1.0, fraction)))
    return f"[{'#' * filled}{'.' * (width - filled)}]"


def _pack_summary(result) -> None:
    idx = result.index
    t = idx.totals()
    p = result.progress
    _echo(
        f"packed {t['documents']:,} documents, {t['tokens']:,} tokens into {_plural(t['shards'], 'shard')} "
        f"({human_bytes(t['bytes'])}) at {result.output}"
    )
    _echo(
        f"  {p.tokens / max(p.elapsed, 1e-9):,.0f} tokens/s over {p.elapsed:.1f} s; "
        f"{t['bytes'] / max(t['tokens'], 1):.3f} bytes/token; "
        f"dtype {idx.dtype}; mode {idx.mode}"
        + (f" seq_len {idx.seq_len}, {t.get('rows', 0):,} rows" if idx.seq_len else "")
    )
    if result.resumed_shards:
        _echo(f"  resumed after {_plural(result.resumed_shards, 'finished shard')}")
    _print_skipped(idx.skipped)


def _print_skipped(skipped: dict, limit: int = 10) -> None:
    from .inputs.sources import UNLISTED

    if not skipped.get("total"):
        return
    counts = ", ".join(f"{k} {v:,}" for k, v in skipped["counts"].items())
    _echo(f"  skipped {skipped['total']:,}: {counts}")
    for rec in skipped["records"][:limit]:
        where = f"{rec['file']}:{rec['line']}" + (f" ({rec['key']})" if rec.get("key") else "")
        many = f" (x{rec['count']:,})" if rec.get("count", 1) != 1 else ""
        _echo(f"    {where}: {rec['reason']}{many} {rec['detail']}".rstrip())
    listed = sum(v for k, v in skipped["counts"].items() if k not in UNLISTED)
    more = listed - sum(r.get("count", 1) for r in skipped["records"][:limit])
    if more > 0:
        _echo(
            f"    ... {more:,} more listed in index.json"
            if len(skipped["records"]) > limit
            else f"    ... {more:,} more (not listed)"
        )


# ----------------------------------------------------------------------------------------------
# merge


@cli.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="The sidecar file to write (e.g. raw.counts.npz).")
@click.option("-t", "--tokenizer", required=True, help="tokenizer.json path, a directory holding one, or a hub name.")
@click.option("--text-field", default="text", show_default=True, help="JSON field or column holding the text.")
@click.option("--split", type=click.Choice(["line", "paragraph", "file"]), default="line", show_default=True)
@click.option("--where", help="Keep only documents that match (as the loader's where=).")
@click.option("--bos/--no-bos", default=None, help="Prepend BOS [default: as the tokenizer's post-processor does].")
@click.option("--eos/--no-eos", default=True, show_default=True, help="Append EOS to every document.")
@click.option("--unit-bytes", type=SizeType(), default=None, help="Input bytes per unit [default: 16MiB].")
@click.option("--on-error", type=click.Choice(["raise", "skip"]), default="raise", show_default=True)
@click.option("--workers", "-j", type=int, default=1, show_default=True, help="Counting processes.")
@click.option("-q", "--quiet", is_flag=True, help="No summary.")
@click.pass_context
def count(ctx, inputs, output, tokenizer, text_field, split, where, bos, eos, unit_bytes, on_error, workers, quiet):
    """Count the documents and tokens of raw text per unit of work: the sidecar that lets
    ``wdsllm.loader(INPUTS, tokenizer=..., counts=OUTPUT)`` plan equal batches per rank, report
    ``len`` and resume exactly, as with a packed dataset's index.

    \b
    Pass the loader's own inputs and options: the sidecar is refused for any other.

    \b
    Examples:
      wdsllm count "data/*.jsonl.zst" -t tok.json -o data.counts.npz -j 8
      wdsllm count s3://b/fineweb/*.parquet -t tok.json --unit-bytes 64MiB -o fw.counts.npz
    """
    from .load.raw import open_raw
    from .load.rawcount import count_raw, save_counts

    _setup_logging(ctx.obj["verbose"], quiet)
    try:
        catalog = open_raw(
            list(inputs),
            tokenizer=tokenizer,
            text_field=text_field,
            split=split,
            where=where,
            bos=bos,
            eos=eos,
            unit_bytes=unit_bytes,
            on_error=on_error,
        )
        counts = count_raw(catalog, workers)
        save_counts(counts, catalog, output)
    except (WdsllmError, OSError) as exc:
        _fail(exc)
    if not quiet:
        _echo(
            f"{len(catalog.units)} units, {int(counts.documents.sum())} documents, {int(counts.tokens.sum())} tokens"
            + (f", {counts.skipped} skipped" if counts.skipped else "")
            + f" -> {output}"
        )


@cli.command()
@click.argument("parts", nargs=-1, required=True)
@click.option(
    "-o",
    "--output",
    required=True,
    help="The merged dataset: a directory or s3://bucket/prefix/ (may be the parts' parent).",
)
@click.option("--copy", is_flag=True, help="Copy the shards and keep the parts (default: move them).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output.")
@click.option("--allow-partial", is_flag=True, help="Merge even if some tasks of the pack are missing or unfinished.")
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
    from .pack.merge import merge as run_merge

    _setup_logging(ctx.obj["verbose"], quiet)
    line = ProgressLine(quiet)

    def on_shard(done: int, total: int) -> None:
        line.show(f"merge {_bar(done / total)} {done}/{total} shards", final=done == total)

    try:
        index, used = run_merge(
            list(parts), output, copy=copy, overwrite=overwrite, allow_partial=allow_partial, on_shard=on_shard
        )
    except (WdsllmError, OSError) as exc:
        _fail(exc)
    if not quiet:
        t = index.totals()
        _echo(
            f"merged {_plural(len(used), 'task')} ({'copied' if copy else 'moved'}): {_plural(t['shards'], 'shard')}, "
            f"{t['documents']:,} documents, {t['tokens']:,} tokens at {output}"
        )


# ----------------------------------------------------------------------------------------------
# info


@cli.command()
@click.argument("dataset")
@click.option("--json", "as_json", is_flag=True, help="Print index.json as it is.")
def info(dataset, as_json):
    """Summarise a dataset's index (DATASET: a directory, URL, or index.json URL).

    \b
    Examples:
      wdsllm info out/wiki
      wdsllm info https://host/wiki/index.json
      wdsllm info s3://bucket/wiki/ --json | jq .totals
    """
    from .format.verify import load

    try:
        root, index, raw = load(dataset)
    except (WdsllmError, OSError, ValueError) as exc:  # storage, format and JSON errors: no usable index
        _fail(exc)
    if as_json:
        _echo(json.dumps(raw, indent=1))
        return
    for text in info_lines(root, index):
        _echo(text)


def info_lines(root: str, index) -> list[str]:
    """The human summary of an index, line by line."""
    t = index.totals()
    tok = index.tokenizer
    opts = index.options
    out = [
        f"dataset    {root}  (format {index.format} v{index.version}, {index.created_by or 'unknown writer'})",
        f"mode       {index.mode}, dtype {index.dtype}" + (f", seq_len {index.seq_len}" if index.seq_len else ""),
        f"tokenizer  {tok.source}",
        f"           sha256 {tok.sha256[:16]}…, vocab {tok.vocab_size:,}, bos {_opt(tok.bos_id)}, eos "
        f"{_opt(tok.eos_id)}, pad {_opt(tok.pad_id)}",
        f"           added: bos {'yes' if opts.get('bos') else 'no'}, eos {'yes' if opts.get('eos') else 'no'}",
        f"totals     {t['documents']:,} documents, {t['tokens']:,} tokens, {t['samples']:,} samples"
        + (f", {t['rows']:,} rows" if "rows" in t else ""),
    ]
    sizes = index.shards.column("bytes")  # a column of the shard table, not one object per shard
    if len(sizes):
        total = int(sizes.sum())
        out.append(
            f"shards     {len(sizes):,}, {human_bytes(total)} ({human_bytes(int(sizes.min()))} to "
            f"{human_bytes(int(sizes.max()))}), "
            f"{total / max(1, t['tokens']):.3f} bytes/token"
            + (f"; table in {index.shards_file.name}" if index.shards_file else "")
        )
    else:
        out.append("shards     none")
    if index.packed:
        out.append(
            f"packed     {index.packed.get('short_rows', 0):,} short rows, at most "
            f"{index.packed.get('max_row_segments', 0)} documents per row"
        )
    inputs = index.inputs
    out.append(
        f"inputs     {_plural(len(inputs), 'file')}, {human_bytes(sum(i.get('bytes', 0) for i in inputs))}"
        + (f": {inputs[0]['path']}" if len(inputs) == 1 else "")
    )
    skipped = index.skipped or {}
    counts = ", ".join(f"{k} {v:,}" for k, v in skipped.get("counts", {}).items())
    out.append(f"skipped    {skipped.get('total', 0):,}" + (f" ({counts})" if counts else ""))
    out.extend(histogram_lines(index.doc_lengths or {}))
    return out


def _opt(value) -> str:
    return "-" if value is None else str(value)


def histogram_lines(hist: dict, width: int = 40) -> list[str]:
    """The power-of-two length histogram as a text bar chart (empty buckets at the ends left out)."""
    counts, edges = hist.get("counts", []), hist.get("edges", [])
    if not hist.get("count") or not counts:
        return ["lengths    no documents"]
    stats = ", ".join(f"{k} {_num(hist[k])}" for k in ("min", "mean", "p50", "p90", "p99", "max") if k in hist)
    lines = [f"lengths    {stats} (tokens per document)"]
    nonzero = [i for i, c in enumerate(counts) if c]
    top = max(counts)
    for i in range(nonzero[0], nonzero[-1] + 1):
        label = f"[{edges[i]:,}, {edges[i + 1]:,})"
        bar = "█" * max(1 if counts[i] else 0, round(width * counts[i] / top))
        lines.append(f"  {label:>18} {counts[i]:>11,} {bar}")
    return lines


def _num(v) -> str:
    return f"{v:,.1f}" if isinstance(v, float) and not float(v).is_integer() else f"{int(v):,}"


# ----------------------------------------------------------------------------------------------
# verify


@cli.command()
@click.argument("dataset")
@click.option("--jobs", "-j", type=int, default=0, help="Parallel processes [default: one per core].")
@click.option("-q", "--quiet", is_flag=True, help="Only failures and the final line.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object (ok, counts, failures).")
@click.pass_context
def verify(ctx, dataset, jobs, quiet, as_json):
    """Check every shard against the index: existence, size, sha256, header checksums, and counts
    from decoding every sample; lengths.npy, groups.npy, tokenizer.json; token ids below the
    vocabulary size.

    Exits non-zero when anything is wrong; each problem names the shard and the byte offset.

    \b
    Examples:
      wdsllm verify out/wiki
      wdsllm verify s3://bucket/wiki/ -j 8 -q
      wdsllm verify out/wiki --json | jq .ok
    """
    from .format.verify import verify as run_verify

    _setup_logging(ctx.obj["verbose"], quiet)
    line = ProgressLine(quiet)
    seen = {"documents": 0, "tokens": 0}

    def on_shard(done: int, total: int, check) -> None:
        seen["documents"] += check.documents
        seen["tokens"] += check.tokens
        for error in [] if as_json else check.errors:
            line.clear()
            _echo(f"FAIL {error if error.startswith(check.name) else f'{check.name}: {error}'}")
        line.show(
            f"verify {_bar(done / total)} {done}/{total} shards, {human(seen['documents'])} documents, "
            f"{human(seen['tokens'])} tokens",
            final=done == total,
        )

    try:
        report = run_verify(dataset, jobs=jobs, on_shard=on_shard)
    except (WdsllmError, OSError, ValueError) as exc:  # an unreadable index is a failed verification
        _fail(exc)
    t = report.index.totals()
    if as_json:
        _echo(
            json.dumps(
                {
                    "dataset": report.root,
                    "ok": report.ok,
                    "shards": t["shards"],
                    "documents": t["documents"],
                    "tokens": t["tokens"],
                    "bad_shards": sum(1 for sh in report.shards if sh.errors),
                    "failures": report.failures,
                }
            )
        )
        if not report.ok:
            ctx.exit(1)
        return
    for error in report.errors:
        _echo(f"FAIL {error}")
    if report.ok:
        _echo(f"OK: {_plural(t['shards'], 'shard')}, {t['documents']:,} documents, {t['tokens']:,} tokens verified")
        return
    bad = sum(1 for s in report.shards if s.errors)
    _echo(f"FAILED: {len(report.failures)} problems; {bad} of {_plural(t['shards'], 'shard')} bad", err=True)
    ctx.exit(1)


# ----------------------------------------------------------------------------------------------
# head


@cli.command()
@click.argument("dataset")
@click.option(
    "-n", "count", type=int, default=5, show_default=True, help="How many documents (docs mode) or rows (packed)."
)
@click.option(
    "--tokenizer",
    "-t",
    help="Tokenizer to decode with [default: the dataset's own tokenizer.json; a dataset without one needs this].",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--ids", is_flag=True, help="Also show the token ids.")
@click.option("--skip-special-tokens", is_flag=True, help="Leave BOS/EOS and other special tokens out of the text.")
def head(dataset, count, tokenizer, as_json, ids, skip_special_tokens):
    """Decode the first documents (or rows) back to text, with their key, index and provenance.

    \b
    Examples:
      wdsllm head out/wiki -n 3
      wdsllm head out/wiki -n 100 --json | jq -r .text
      wdsllm head out/wiki --ids --tokenizer other/tokenizer.json
    """
    from itertools import islice

    from . import format as fmt
    from .format.head import iter_items
    from .format.verify import load
    from .pack.tokenizer import load_tokenizer, tokenizer_from_json
    from .storage import redact

    try:
        root, index, _ = load(dataset)
    except (WdsllmError, OSError, ValueError) as exc:
        _fail(exc)
    if tokenizer is None and index.tokenizer_file is None:
        # The index's tokenizer source is a stranger's path or Hub name: never opened unless asked.
        raise click.ClickException(
            f"{redact(root)} carries no {fmt.TOKENIZER_NAME} (packed by an older wdsllm); pass --tokenizer PATH "
            f"(it was packed with {redact(index.tokenizer.source)!r}, sha256 {index.tokenizer.sha256[:16]}…)"
        )
    try:
        if tokenizer is None:  # the dataset's own tokenizer.json, checked against the index
            spec = f"{root.rstrip('/')}/{index.tokenizer_file.name}"
            tok = tokenizer_from_json(fmt.read_tokenizer_json(root, index), spec)
        else:
            spec = tokenizer
            tok = load_tokenizer(spec)
    except (WdsllmError, OSError) as exc:
        raise click.ClickException(f"cannot load the tokenizer: {_message(exc)}; pass --tokenizer PATH") from None
    if tok.sha256 != index.tokenizer.sha256:
        _echo(f"warning: {spec} is not the tokenizer this dataset was packed with (sha256 differs)", err=True)
    try:
        for item in islice(iter_items(root, index), max(0, count)):
            text = tok.tokenizer.decode(item.tokens.tolist(), skip_special_tokens=skip_special_tokens)
            _echo(_head_json(item, text, ids) if as_json else _head_text(item, text, ids, index.mode))
    except (WdsllmError, OSError) as exc:  # a broken shard: say which (the message has the offset)
        _fail(exc)


def _head_json(item, text: str, ids: bool) -> str:
    record = {
        "shard": item.shard,
        "key": item.key,
        "index": item.index,
        "input": item.input,
        "line": item.line,
        "piece": item.piece,
        "tokens": len(item.tokens),
        "text": text,
    }
    if item.source_key is not None:
        record["source_key"] = item.source_key
    if item.segments:
        record["segments"] = item.segments
    if ids:
        record["ids"] = item.tokens.tolist()
    return json.dumps(record, ensure_ascii=False)


def _head_text(item, text: str, ids: bool, mode: str) -> str:
    what = "row" if mode == "packed" else "#"
    where = f"{item.input}:{item.line}" + (f" ({item.source_key})" if item.source_key else "")
    where += f" piece {item.piece}" if item.piece else ""
    head = (
        f"==> {item.key} {what}{'' if what == '#' else ' '}{item.index}  {where}  ({item.shard}, "
        f"{len(item.tokens):,} tokens)"
    )
    if item.segments:
        head += "\n    documents: " + ", ".join(
            f"{s['input']}:{s['line']}{' (continued)' if s['continues'] else ''} @{s['offset']}" for s in item.segments
        )
    body = text + ("\n    ids: " + " ".join(map(str, item.tokens.tolist())) if ids else "")
    return f"{head}\n{body}\n"


# ----------------------------------------------------------------------------------------------
# stats


@cli.command()
@click.argument("dataset")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Documents per batch (random and bucket).")
@click.option(
    "--max-tokens",
    type=int,
    default=65536,
    show_default=True,
    help="Padded tokens per batch (bucket with a token budget).",
)
@click.option(
    "--seq-len",
    type=int,
    default=2048,
    show_default=True,
    help="Row length (pack, concat) and the length cap of the other modes.",
)
@click.option("--window", type=int, default=10_000, show_default=True, help="Documents per bucket/pack window.")
@click.option("--pad-to-multiple-of", type=int, help="Round padded lengths up.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Also draw the length histogram to this PNG (needs matplotlib: pip install wdsllm[plot]).",
)
@click.option(
    "--sample",
    type=int,
    default=None,
    help="Runs of windows to simulate (0: the whole stream) [default: the whole stream up to 5,000,000 "
    "documents, else 400 runs].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def stats(dataset, batch_size, max_tokens, seq_len, window, pad_to_multiple_of, seed, plot, sample, as_json):
    """Length histogram, and the padding and truncation each batching mode would give.

    Simulated from the index and lengths.npy over the documents one worker sees in epoch 0 (the
    shard plan and the shuffle buffer included); no shard is read. DATASET may be a mixture file
    (.yaml): each source's size, quota and repeats or subset come first, and --plot draws the
    planned share of each source over the run, schedule included. Longer documents are split at
    --seq-len, except in the "random, truncated" line, which shows what capping would cut. A large
    dataset is simulated on a seeded sample of its windows (it says so, with confidence bounds).

    \b
    Examples:
      wdsllm stats out/wiki --max-tokens 65536 --seq-len 2048
      wdsllm stats out/wiki --plot hist.png --json
      wdsllm stats mix.yaml --plot shares.png
    """
    from .load import stats as statsmod
    from .load.catalog import open_catalog

    try:
        catalog = open_catalog(dataset)
        if catalog.index is None:
            raise click.ClickException(f"{dataset}: stats need a dataset with index.json and lengths.npy")
        if catalog.mode != "docs":
            raise click.ClickException(
                f"{dataset} is a packed dataset: its rows are fixed; stats compares batching modes of docs-mode data"
            )
        costs, sample = statsmod.all_modes(
            catalog,
            batch_size=batch_size,
            max_tokens=max_tokens,
            seq_len=seq_len,
            window=window,
            multiple=pad_to_multiple_of,
            seed=seed,
            sample=sample,
        )
    except (WdsllmError, OSError) as exc:  # storage/format errors name the file
        _fail(exc)
    hist = catalog.index.doc_lengths or {}
    mix = None
    if catalog.mixing is not None:
        from .load.mixcatalog import mixture_summary

        mix = mixture_summary(catalog)
    if as_json:
        _echo(
            json.dumps(
                {
                    "doc_lengths": hist,
                    "modes": [
                        {
                            "mode": c.mode,
                            "settings": c.settings,
                            "batches": c.batches,
                            "tokens": c.tokens,
                            "padded": c.padded,
                            "padding_pct": round(c.padding_pct, 4),
                            "truncated": c.truncated,
                            "truncation_pct": round(c.truncation_pct, 4),
                            "small_batches": c.small_batches,
                            "padding_ci_pct": None if c.padding_ci is None else round(c.padding_ci, 4),
                        }
                        for c in costs
                    ],
                    "sample": None if sample is None else vars(sample),
                    **({"mixture": mix} if mix is not None else {}),
                },
                indent=1,
            )
        )
    else:
        if mix is not None:
            _echo(_mixture_table(mix, catalog.mixture.unit))
        else:
            for text in histogram_lines(hist):
                _echo(text)
        _echo("")
        if sample is not None:
            _echo(
                f"simulated on a seeded sample: {sample.runs:,} runs of windows, {sample.documents:,} of "
                f"{sample.total_documents:,} documents; batches extrapolated, padding ± its 95% confidence bound"
            )
        _echo(f"{'mode':<20} {'settings':<30} {'batches':>11} {'padding':>16} {'truncated':>10}")
        for c in costs:
            padding = f"{c.padding_pct:.2f}%" + (f" ± {c.padding_ci:.2f}" if c.padding_ci is not None else "")
            _echo(f"{c.mode:<20} {c.settings:<30} {c.batches:>11,} {padding:>16} {c.truncation_pct:>9.2f}%")
    if plot:
        if mix is not None:
            _plot_shares(catalog, plot, dataset)
        else:
            _plot_histogram(hist, plot, dataset)
        if not as_json:
            _echo(f"\n{'planned shares' if mix is not None else 'histogram'} drawn to {plot}")


def _mixture_table(rows: list[dict], unit: str) -> str:
    """Each source's size, its epoch quota and whether that repeats it or takes a subset."""
    lines = [f"{'source':<16} {'items':>12} {'tokens':>14} {'weight':>7} {'quota (' + unit + ')':>16} {'epoch':>16}"]
    for r in rows:
        took = f"x{r['repeats']:.2f} (repeats)" if r["repeats"] is not None else f"{100 * r['subset']:.1f}% subset"
        lines.append(
            f"{r['source']:<16} {r['items']:>12,} {r['tokens']:>14,} {r['weight']:>7.3f} {r['quota']:>16,} {took:>16}"
        )
    return "\n".join(lines)


def _plot_shares(catalog, path: str, title: str) -> None:
    """The planned share of each source over the run (schedule included), stacked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install wdsllm[plot]") from None
    from .load.mixcatalog import planned_shares

    planner = catalog.planner
    last = max((p for p, _ in planner.phases()), default=0)
    epochs = min(100, max(1, -(-(last + 1) // planner.epoch) + 1 if last else 1))
    xs, shares = planned_shares(catalog, epochs)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.stackplot(xs, shares.T, labels=catalog.mixture.names, step="post")
    for e in range(1, epochs):
        ax.axvline(e * planner.epoch, color="k", lw=0.5, ls=":")
    ax.set_xlabel(f"{catalog.mixture.unit} into the run (dotted: epochs)")
    ax.set_ylabel("planned share")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"Mixture: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def _plot_histogram(hist: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install wdsllm[plot]") from None
    edges, counts = hist.get("edges", []), hist.get("counts", [])
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    labels = [f"{edges[i]:,}" for i in range(len(counts))]
    ax.bar(range(len(counts)), counts, color="#4c72b0")
    ax.set_xticks(range(len(counts)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("document length in tokens (bucket start, powers of two)")
    ax.set_ylabel("documents")
    ax.set_title(f"Document lengths: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":  # pragma: no cover
    main()
