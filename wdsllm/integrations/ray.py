"""Ray Data: pack a Dataset as the last stage of the pipeline that filtered it (docs/cluster.md).

::

    ds.write_datasink(PackSink("s3://bucket/packed/", tokenizer="tokenizer.json", mode="packed", seq_len=2048))

Each write task packs its blocks into ``OUT/part-NNNNN/`` with :func:`wdsllm.pack.part.pack_part`,
named by the task's index: a task that Ray retries (its worker died, its node was preempted) finds
the part its earlier attempt left, keeps the shards that attempt committed and continues after
them, so no document is written twice or lost. ``on_write_complete`` merges the parts into ``OUT``
(set ``merge=False`` to run ``wdsllm merge`` yourself). A task holds one chunk of text and one open
shard, whatever its blocks' size.

A part is tied to the rows it holds (their digest is in its manifest): a task reuses a part only
when it holds exactly the task's rows, in order. A re-run (after a driver crash) that splits the
rows otherwise, such as with another number of blocks (Ray's default follows the cluster's size),
is refused by the first task that finds a part of other rows, naming it: never a document packed
twice nor one lost. For a re-run to reuse the parts (and give byte-identical shards), Ray must
hand the same rows to the same task index in the same order: set ``override_num_blocks`` and
``ray.data.DataContext.get_current().execution_options.preserve_order = True``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from . import _need

_need("ray", "'wdsllm[ray]'")

from ray.data import Datasink  # noqa: E402 - after the dependency check
from ray.data.block import Block, BlockAccessor  # noqa: E402

from .. import format as fmt  # noqa: E402
from .. import storage  # noqa: E402
from ..errors import PackError  # noqa: E402
from ..pack.merge import merge  # noqa: E402
from ..pack.part import PartManifest, PartOptions, pack_part  # noqa: E402

log = logging.getLogger(__name__)

#: the most rows converted from Arrow to dicts at once (converting a batch costs a fraction of row
#: by row); a batch holds at most about ``chunk_bytes`` of the block, whatever its rows' sizes
ROWS_PER_BATCH = 1024


class PackSink(Datasink):
    """A Datasink that packs each write task's rows into a part and merges the parts at the end.

    Rows are records: the text in ``text_field`` (default ``text``), and with ``sources`` (the
    dataset's input names) a ``source`` and a ``line`` column that give each document the
    provenance a ``wdsllm pack`` of those inputs gives it. The other keywords are ``wdsllm pack``'s
    options (``mode``, ``seq_len``, ``shard_size``, ``sample_tokens``, ``max_doc_tokens``, ...),
    plus ``shard_tokens``. ``overwrite`` replaces a finished dataset already in ``out``.
    """

    def __init__(
        self,
        out: str,
        tokenizer: str,
        *,
        sources: Iterable[str] | None = None,
        shard_tokens: int | None = None,
        merge: bool = True,
        overwrite: bool = False,
        **pack_options: Any,
    ) -> None:
        self.out = str(out)
        self.options = PartOptions.of(tokenizer, sources=sources, shard_tokens=shard_tokens, **pack_options)
        self.merge = merge
        self.overwrite = overwrite
        self.manifests: list[PartManifest] = []
        self.index: fmt.Index | None = None

    def on_write_start(self, schema: Any = None) -> None:
        """Refuse (or with ``overwrite``, clear) an output that already holds a merged dataset: its
        shards' names are the ones this write would merge into. Then name this run (its parts
        record it: merge refuses the parts of a run that was refused, docs/cluster.md)."""
        out = storage.Output(self.out)
        try:
            if out.get_bytes(fmt.INDEX_NAME) is not None:
                if not self.overwrite:
                    raise PackError(f"{self.out} already holds a packed dataset; pass overwrite=True to replace it")
                out.clear()
            self.options = replace(self.options, run=run_name(out.list_names()))
        finally:
            out.close()

    def records(self, blocks: Iterable[Block]) -> Iterator[dict]:
        """The task's rows as records, converted from Arrow a batch at a time (a subclass may map
        columns here): the records a task holds are bounded in bytes, not by the block's size."""
        batch_bytes = self.options.pack.chunk_bytes
        for block in blocks:
            for batch in BlockAccessor.for_block(block).to_arrow().to_batches(max_chunksize=ROWS_PER_BATCH):
                rows = max(1, len(batch) * batch_bytes // max(batch.nbytes, 1))
                for start in range(0, len(batch), rows):
                    yield from batch.slice(start, rows).to_pylist()

    def write(self, blocks: Iterable[Block], ctx: Any) -> PartManifest:
        return pack_part(self.records(blocks), ctx.task_idx, self.out, self.options)

    def on_write_complete(self, write_result: Any) -> None:
        self.manifests = sorted(write_result.write_returns, key=lambda m: m.part_id)
        log.info(
            "packed %d parts: %d documents, %d tokens",
            len(self.manifests),
            sum(m.documents for m in self.manifests),
            sum(m.tokens for m in self.manifests),
        )
        if self.merge and self.manifests:
            self.index, _ = merge([m.url for m in self.manifests], self.out)

    def get_name(self) -> str:
        return "WdsllmPack"


def run_name(names: list[str]) -> str:
    """A run's name: the digest of what the output held when it started. Two runs into an empty
    output share it (their parts are byte-identical), and a re-run after a crash or a refusal
    differs from the run before it (that run left parts, journals or its refusal)."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:16]


__all__ = ["PackSink"]
