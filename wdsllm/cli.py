"""The `wdsllm` command line. Only this module prints; the library logs."""

from __future__ import annotations

import logging
import os
import sys
import time

import click

from . import __version__

SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20, "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30}


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

    def show(self, text: str, final: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:
            click.echo("\r\033[K" + text, err=True, nl=final)
        elif final or time.monotonic() - self.last_plain > 10:
            self.last_plain = time.monotonic()
            click.echo(text, err=True)


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet or not verbose else (logging.INFO if verbose == 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="wdsllm")
@click.option("-v", "--verbose", count=True, help="Log more (-v info, -vv debug).")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Pack text into WebDataset shards of token ids, and inspect them."""
    ctx.obj = {"verbose": verbose}


def _fail(exc: Exception) -> None:
    raise click.ClickException(str(exc))


# ----------------------------------------------------------------------------------------------
# pack


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, help="Output directory, or s3://bucket/prefix/.")
@click.option("--tokenizer", "-t", required=True, help="A tokenizer.json path, or a Hugging Face name (needs the Hub or its cache).")
@click.option("--mode", type=click.Choice(["docs", "packed"]), default="docs", show_default=True, help="One document per sample, or fixed rows.")
@click.option("--seq-len", type=int, help="Row length for --mode packed.")
@click.option("--max-doc-tokens", type=int, help="Split longer documents into pieces (docs mode). Never truncates.")
@click.option("--split", type=click.Choice(["line", "paragraph", "file"]), default="line", show_default=True, help="How .txt inputs become documents.")
@click.option("--text-field", default="text", show_default=True, help="JSON field with the text; dots reach nested keys (meta.body).")
@click.option("--input-format", type=click.Choice(["txt", "jsonl"]), help="Treat every input as this type (needed for stdin).")
@click.option("--bos/--no-bos", default=None, help="Prepend BOS. Default: as the tokenizer's post-processor does (Llama yes, GPT-2 no).")
@click.option("--eos/--no-eos", default=True, show_default=True, help="Append EOS to every document.")
@click.option("--bos-token", help="BOS token text, when the tokenizer does not name one.")
@click.option("--eos-token", help="EOS token text, when the tokenizer does not name one.")
@click.option("--shard-size", type=SizeType(), default="128MiB", show_default=True, help="Largest shard in bytes.")
@click.option("--shard-samples", type=int, help="Most documents (docs mode) or rows (packed) per shard.")
@click.option("--sample-tokens", type=int, default=262144, show_default=True, help="Tokens per tar sample (a group of documents or rows).")
@click.option("--prefix", default="shard", show_default=True, help="Shard name prefix: PREFIX-000000.tar.")
@click.option("--workers", "-j", type=int, default=0, help="Tokenizer processes [default: all cores].")
@click.option("--on-error", type=click.Choice(["stop", "skip"]), default="stop", show_default=True, help="Bad input: stop with an error, or skip, count and list it.")
@click.option("--num-tasks", type=int, help="Split the inputs into this many disjoint tasks [default: SLURM array or torchrun size, else 1].")
@click.option("--task-index", type=int, help="Which task this process packs [default: SLURM array id or torchrun rank].")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output.")
@click.option("--resume", is_flag=True, help="Finish an interrupted pack into the same output.")
@click.option("-q", "--quiet", is_flag=True, help="No progress line and no summary.")
@click.pass_context
def pack(ctx, inputs, output, tokenizer, mode, seq_len, max_doc_tokens, split, text_field, input_format, bos, eos, bos_token,
         eos_token, shard_size, shard_samples, sample_tokens, prefix, workers, on_error, num_tasks, task_index, overwrite, resume, quiet):
    """Tokenize INPUT... (files, directories, globs, {a,b} patterns, or - for stdin) into shards.

    \b
    Examples:
      wdsllm pack data/*.jsonl.gz -o out/ -t tokenizer.json
      wdsllm pack book.txt --split paragraph -o out/ -t tok.json --mode packed --seq-len 2048
      cat x.jsonl | wdsllm pack - --input-format jsonl -o s3://bucket/ds/ -t tok.json
    """
    from .packer import PackConfig, PackError, pack as run_pack, task_from_env
    from .sources import SourceError
    from .storage import StorageError
    from .tokenize import TokenizerError

    _setup_logging(ctx.obj["verbose"], quiet)
    if (num_tasks is None) != (task_index is None):
        raise click.UsageError("--num-tasks and --task-index go together")
    if num_tasks is None:
        num_tasks, task_index = task_from_env()
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
        bos=bos,
        eos=eos,
        bos_token=bos_token,
        eos_token=eos_token,
        shard_size=shard_size,
        shard_samples=shard_samples,
        sample_tokens=sample_tokens,
        prefix=prefix,
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
        pct = f"{100 * p.input_bytes / p.input_total:5.1f}% " if p.input_total else ""
        bar_w = 20
        filled = int(bar_w * p.input_bytes / p.input_total) if p.input_total else 0
        bar = f"[{'#' * filled}{'.' * (bar_w - filled)}] " if p.input_total else ""
        line.show(
            f"{bar}{pct}{human(p.documents)} docs {human(p.tokens)} tokens | {human(drate)} docs/s {human(rate)} tok/s | "
            f"{p.shards} shards | {human(p.skipped)} skipped",
            final=p.done,
        )

    try:
        result = run_pack(cfg, on_progress=on_progress)
    except (PackError, SourceError, TokenizerError, StorageError, OSError) as exc:
        _fail(exc)
    if quiet:
        return
    idx = result.index
    t = idx.totals()
    p = result.progress
    click.echo(f"packed {t['documents']:,} documents, {t['tokens']:,} tokens into {t['shards']} shards ({human_bytes(t['bytes'])}) at {result.output}")
    click.echo(
        f"  {p.tokens / max(p.elapsed, 1e-9):,.0f} tokens/s over {p.elapsed:.1f} s; {t['bytes'] / max(t['tokens'], 1):.3f} bytes/token; "
        f"dtype {idx.dtype}; mode {idx.mode}" + (f" seq_len {idx.seq_len}" if idx.seq_len else "")
    )
    if result.resumed_shards:
        click.echo(f"  resumed after {result.resumed_shards} finished shards")
    skipped = idx.skipped
    if skipped.get("total"):
        counts = ", ".join(f"{k} {v:,}" for k, v in skipped["counts"].items())
        click.echo(f"  skipped {skipped['total']:,}: {counts}")
        for rec in skipped["records"][:10]:
            click.echo(f"    {rec['file']}:{rec['line']}: {rec['reason']} {rec['detail']}".rstrip())
        more = sum(v for k, v in skipped["counts"].items() if k != "empty") - min(10, len(skipped["records"]))
        if more > 0:
            click.echo(f"    ... {more:,} more listed in index.json")


if __name__ == "__main__":  # pragma: no cover
    main()
