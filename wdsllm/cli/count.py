"""``wdsllm count``: the documents and tokens of raw text per unit, the sidecar for equal batches."""

from __future__ import annotations

from functools import partial

import click

from ..errors import WdsllmError
from .options import POSITIVE, SizeType, setup_logging
from .output import ProgressLine, bar, echo, fail, human


@click.command()
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
@click.option("--workers", "-j", type=POSITIVE, default=1, show_default=True, help="Counting processes.")
@click.option("-q", "--quiet", is_flag=True, help="No progress line and no summary.")
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
    from ..load.raw import open_raw
    from ..load.rawcount import count_raw, save_counts

    setup_logging(ctx.obj["verbose"], quiet)
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
        progress = partial(_show_progress, ProgressLine(quiet))
        progress(0, len(catalog.units), 0, 0)
        counts = count_raw(catalog, workers, on_unit=progress)
        save_counts(counts, catalog, output)
    except (WdsllmError, OSError) as exc:
        fail(exc)
    if not quiet:
        echo(
            f"{len(catalog.units)} units, {int(counts.documents.sum())} documents, {int(counts.tokens.sum())} tokens"
            + (f", {counts.skipped} skipped" if counts.skipped else "")
            + f" -> {output}"
        )


def _show_progress(line: ProgressLine, done: int, total: int, documents: int, tokens: int) -> None:
    line.show(
        f"count {bar(done / total if total else 1.0)} {done}/{total} units, {human(documents)} documents, "
        f"{human(tokens)} tokens",
        final=done == total and done > 0,
    )
