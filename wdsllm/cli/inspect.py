"""Looking into a dataset: ``wdsllm info``, ``verify`` and ``head``."""

from __future__ import annotations

import click

from ..errors import WdsllmError
from .options import COUNT, json_option, setup_logging
from .output import ProgressLine, bar, echo, fail, human, human_bytes, message, plural, to_json


@click.command()
@click.argument("dataset")
@json_option("Print index.json as it is (NaN and infinities as null).")
@click.pass_context
def info(ctx, dataset, as_json):
    """Summarise a dataset's index (DATASET: a directory, URL, or index.json URL).

    \b
    Examples:
      wdsllm info out/wiki
      wdsllm info https://host/wiki/index.json
      wdsllm info s3://bucket/wiki/ --json | jq .totals

    Exits non-zero when the index contradicts itself (totals that are not the sum of its shards, a
    NaN or infinite number); `wdsllm verify` also reads the shards.
    """
    from ..format.verify import index_problems, load

    try:
        root, index, raw = load(dataset)
    except (WdsllmError, OSError, ValueError) as exc:  # storage, format and JSON errors: no usable index
        fail(exc)
    if as_json:
        echo(to_json(raw, indent=1))
    else:
        for text in info_lines(root, index):
            echo(text)
    problems = index_problems(index, raw)
    for problem in problems:
        echo(f"Error: {problem}", err=True)
    if problems:
        ctx.exit(1)


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
        f"inputs     {plural(len(inputs), 'file')}, {human_bytes(sum(i.get('bytes', 0) for i in inputs))}"
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


@click.command()
@click.argument("dataset")
@click.option("--jobs", "-j", type=COUNT, default=0, help="Parallel processes [default: one per core].")
@click.option("-q", "--quiet", is_flag=True, help="Only failures and the final line.")
@json_option("Print the result as one JSON object (ok, counts, failures).")
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
    from ..format.verify import verify as run_verify

    setup_logging(ctx.obj["verbose"], quiet)
    try:
        report = run_verify(dataset, jobs=jobs, on_shard=VerifyProgress(quiet, print_failures=not as_json))
    except (WdsllmError, OSError, ValueError) as exc:  # an unreadable index is a failed verification
        fail(exc)
    t = report.index.totals()
    if as_json:
        echo(
            to_json(
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
        echo(f"FAIL {error}")
    if report.ok:
        echo(f"OK: {plural(t['shards'], 'shard')}, {t['documents']:,} documents, {t['tokens']:,} tokens verified")
        return
    bad = sum(1 for s in report.shards if s.errors)
    echo(f"FAILED: {plural(len(report.failures), 'problem')}; {bad} of {plural(t['shards'], 'shard')} bad", err=True)
    ctx.exit(1)


class VerifyProgress:
    """verify's progress line, with each shard's failures printed as they come."""

    def __init__(self, quiet: bool, print_failures: bool):
        self.line = ProgressLine(quiet)
        self.print_failures = print_failures
        self.documents = 0
        self.tokens = 0

    def __call__(self, done: int, total: int, check) -> None:
        self.documents += check.documents
        self.tokens += check.tokens
        for error in check.errors if self.print_failures else []:
            self.line.clear()
            echo(f"FAIL {error if error.startswith(check.name) else f'{check.name}: {error}'}")
        self.line.show(
            f"verify {bar(done / total)} {done}/{total} shards, {human(self.documents)} documents, "
            f"{human(self.tokens)} tokens",
            final=done == total,
        )


@click.command()
@click.argument("dataset")
@click.option(
    "-n", "count", type=COUNT, default=5, show_default=True, help="How many documents (docs mode) or rows (packed)."
)
@click.option(
    "--tokenizer",
    "-t",
    help="Tokenizer to decode with [default: the dataset's own tokenizer.json; a dataset without one needs this].",
)
@json_option("One JSON object per line.")
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

    from .. import format as fmt
    from ..format.head import iter_items
    from ..format.verify import load
    from ..pack.tokenizer import load_tokenizer, tokenizer_from_json
    from ..storage import redact

    try:
        root, index, _ = load(dataset)
    except (WdsllmError, OSError, ValueError) as exc:
        fail(exc)
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
        raise click.ClickException(f"cannot load the tokenizer: {message(exc)}; pass --tokenizer PATH") from None
    if tok.sha256 != index.tokenizer.sha256:
        echo(f"warning: {spec} is not the tokenizer this dataset was packed with (sha256 differs)", err=True)
    try:
        for item in islice(iter_items(root, index), max(0, count)):
            text = tok.tokenizer.decode(item.tokens.tolist(), skip_special_tokens=skip_special_tokens)
            echo(_head_json(item, text, ids) if as_json else _head_text(item, text, ids, index.mode))
    except (WdsllmError, OSError) as exc:  # a broken shard: say which (the message has the offset)
        fail(exc)


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
    return to_json(record, ensure_ascii=False)


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
