"""What the input checks of #31 cost: CPU seconds with and without them, alternating in one run.

    python tools/bench_input_checks.py [--work bench-out/input-checks] [--docs 40000] [--repeat 3]

Writes the first ``--docs`` wiki documents (../shared/data/corpora/wiki) as ``.jsonl.zst`` and
``.jsonl.gz``, and a Parquet file written with page CRCs, then measures (CPU seconds of this
process, best of ``--repeat``; "checked" and "bare" alternate, so both see the same machine):

- reader: every chunk of each compressed file through the text reader, parsed (the work ``pack``'s
  reading process and the loader's workers do before tokenizing). checked: the product
  (``inputs.decompress.CheckedStream``: 64 KiB pieces, zstd frames followed, the version check at
  open). bare: the library's stream straight (``gzip.GzipFile``, zstandard's ``stream_reader``), no
  version check: the reader before #31.
- count: ``count_raw`` (what ``wdsllm count`` runs, one process) over the ``.zst`` file, checked and bare.
- loader: one epoch of ``wdsllm.loader`` over raw text (the ``.zst`` file, ``num_workers=0``,
  batch 64), checked and bare.
- Parquet: ``pq.ParquetFile(...).read()`` with and without ``page_checksum_verification``.
- sidecar: ``load_counts`` of a version 2 sidecar (digest and input versions checked).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO.parent / "shared" / "data"
WIKI = sorted((DATA / "corpora" / "wiki").glob("wiki-*.jsonl.gz"))
TOKENIZER = str(DATA / "tokenizers" / "gpt2.json")
sys.path.insert(0, str(REPO))

from wdsllm.inputs import registry, sources  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _bare_decompressing(raw, compression):
    """The decompressing stream before #31: the library's own, unchecked."""
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zst":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, closefd=False)
    return raw


CHECKED = (sources.decompressing, sources.check_unchanged)
BARE = (_bare_decompressing, lambda inp, f: None)


def _use(pair) -> None:
    sources.decompressing, sources.check_unchanged = pair


def _corpus(work: Path, docs: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = []
    for path in WIKI:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines.extend(itertools.islice(f, docs - len(lines)))
        if len(lines) >= docs:
            break
    data = "".join(lines).encode()
    work.mkdir(parents=True, exist_ok=True)
    files = {"zst": work / "docs.jsonl.zst", "gz": work / "docs.jsonl.gz", "parquet": work / "docs.parquet"}
    files["zst"].write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
    files["gz"].write_bytes(gzip.compress(data, compresslevel=6))
    texts = [json.loads(x)["text"] for x in lines]
    pq.write_table(pa.table({"text": texts}), files["parquet"], write_page_checksum=True, row_group_size=4096)
    print(f"corpus: {len(lines)} documents, {len(data) / 1e6:.1f} MB of JSON lines", flush=True)
    return files


def _read_all(path: Path) -> int:
    (inp,) = sources.expand_inputs([str(path)])
    opts = sources.ParseOptions()
    n = 0
    for chunk in registry.reader_for(inp.kind).chunks(sources.Part(inp, size=inp.size), opts, 1 << 20, 1):
        n += len(chunk.parse(opts, inp.display).texts)
    return n


def _count(path: Path) -> int:
    from wdsllm.load.raw import open_raw
    from wdsllm.load.rawcount import count_raw

    return int(count_raw(open_raw(str(path), tokenizer=TOKENIZER)).documents.sum())


def _load(path: Path) -> int:
    import wdsllm
    from wdsllm.load.options import RawTextSource

    loader = wdsllm.loader(RawTextSource(str(path), tokenizer=TOKENIZER), batch_size=64, num_workers=0)
    return sum(int(b["input_ids"].shape[0]) for b in loader)


def _parquet(path: Path, verify: bool) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, page_checksum_verification=verify).read().num_rows


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = _cpu()
        out = fn()
        best = min(best, _cpu() - t)
    return best, out


def _pair(name: str, checked, bare, repeat: int) -> None:
    """Best CPU seconds of each, alternating run by run, the order swapped every repeat."""
    results = {"checked": [], "bare": []}
    outs = {}
    checked(), bare()  # warm: imports, the tokenizer, page cache
    for i in range(repeat):
        order = (("checked", checked), ("bare", bare))
        for label, fn in order if i % 2 == 0 else order[::-1]:  # neither always runs first
            t = _cpu()
            outs[label] = fn()
            results[label].append(_cpu() - t)
    a, b = min(results["checked"]), min(results["bare"])
    assert outs["checked"] == outs["bare"], (name, outs)
    print(f"{name:<28} checked {a:7.3f} s   bare {b:7.3f} s   checked/bare {a / b:5.3f}", flush=True)


def _with(pair, fn):
    def run():
        _use(pair)
        try:
            return fn()
        finally:
            _use(CHECKED)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="bench-out/input-checks")
    ap.add_argument("--docs", type=int, default=40_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-loader", action="store_true", help="leave out the count and loader rows (slow)")
    args = ap.parse_args()
    files = _corpus(Path(args.work), args.docs)
    print("CPU seconds of this process, best of", args.repeat)
    for fmt in ("zst", "gz"):
        path = files[fmt]
        _pair(
            f"reader .jsonl.{fmt}",
            _with(CHECKED, lambda p=path: _read_all(p)),
            _with(BARE, lambda p=path: _read_all(p)),
            args.repeat,
        )
    pq_path = files["parquet"]
    _pair("parquet read (page CRCs)", lambda: _parquet(pq_path, True), lambda: _parquet(pq_path, False), args.repeat)
    if not args.skip_loader:
        zst = files["zst"]
        _pair("count .jsonl.zst", _with(CHECKED, lambda: _count(zst)), _with(BARE, lambda: _count(zst)), args.repeat)
        _pair(
            "loader .jsonl.zst, 0 workers",
            _with(CHECKED, lambda: _load(zst)),
            _with(BARE, lambda: _load(zst)),
            args.repeat,
        )
    _sidecar(files["zst"], Path(args.work), args.repeat)


def _sidecar(path: Path, work: Path, repeat: int) -> None:
    from wdsllm.load.raw import open_raw
    from wdsllm.load.rawcount import count_raw, load_counts, save_counts

    catalog = open_raw(str(path), tokenizer=TOKENIZER)
    sidecar = str(work / "counts.npz")
    save_counts(count_raw(catalog), catalog, sidecar)
    seconds, counts = _best(lambda: load_counts(sidecar, catalog), repeat)
    size = Path(sidecar).stat().st_size
    print(f"sidecar load ({int(counts.documents.sum())} documents, {size / 1e6:.2f} MB): {seconds * 1e3:.1f} ms CPU")


if __name__ == "__main__":
    main()
