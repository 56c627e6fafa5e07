"""datatrove: pack the documents of a pipeline as its last step (docs/cluster.md).

::

    pack = LocalPipelineExecutor(               # or SlurmPipelineExecutor, RayPipelineExecutor
        pipeline=[
            JsonlReader("data/", adapter=line_adapter),
            LambdaFilter(lambda doc: len(doc.text) > 200),
            PackWriter("out/", tokenizer="tokenizer.json", sources=inputs),
        ],
        tasks=8,
        logging_dir="logs/pack",
    )
    merge = LocalPipelineExecutor(pipeline=[MergeParts("out/")], tasks=1, logging_dir="logs/merge", depends=pack)
    merge.run()

:class:`PackWriter` packs each rank's documents into ``OUT/part-NNNNN/`` (the rank's number) with
:func:`wdsllm.pack.part.pack_part`. datatrove marks a rank complete after its pipeline returns,
which is after the part's manifest is written; a relaunch skips the completed ranks and reruns the
others, and a rerun rank continues its part from the last shard it committed, once it has checked
that the documents before that point are the ones the part holds (a rank given other documents
is refused by name: :mod:`wdsllm.pack.rows`). :class:`MergeParts`
(or ``wdsllm merge OUT -o OUT``) joins the parts; it names any rank whose part is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from . import _need

_need("datatrove", "'wdsllm[datatrove]'")

from datatrove.data import Document, DocumentsPipeline  # noqa: E402 - after the dependency check
from datatrove.pipeline.base import PipelineStep  # noqa: E402

from ..errors import PackError  # noqa: E402
from ..pack.merge import merge  # noqa: E402
from ..pack.part import LINE_FIELD, SOURCE_FIELD, PartOptions, pack_part  # noqa: E402

log = logging.getLogger(__name__)

#: where datatrove's readers put a document's file (``add_file_path``), and ``line_adapter`` its line
FILE_PATH_KEY = "file_path"
LINE_KEY = "line"
#: where a record holds the document's text (``PartOptions``' default ``text_field``)
TEXT_FIELD = "text"


def line_adapter(reader: Any, data: dict, path: str, id_in_file: int | str) -> dict:
    """A datatrove reader ``adapter``: the reader's own, plus the document's 1-based line (row) in
    ``metadata["line"]``, which with ``sources`` gives the provenance a ``wdsllm pack`` gives."""
    document = reader._default_adapter(data, path, id_in_file)
    if isinstance(id_in_file, int):
        document["metadata"][LINE_KEY] = id_in_file + 1
    return document


class PackWriter(PipelineStep):
    """The last step of a pipeline: this rank's documents become part ``rank`` of ``output``.

    With ``sources`` (the input paths as ``metadata["file_path"]`` holds them, in the order a
    ``wdsllm pack`` of them takes), documents keep their file and line (read with
    :func:`line_adapter`); without, a document's provenance is its part and its number in it. The
    other keywords are ``wdsllm pack``'s options, plus ``shard_tokens``; ``where`` reads the
    documents' metadata.
    """

    name = "wdsllm pack"
    type = "Writer"

    def __init__(
        self,
        output: str,
        tokenizer: str,
        *,
        sources: Iterable[str] | None = None,
        shard_tokens: int | None = None,
        **pack_options: Any,
    ) -> None:
        super().__init__()
        if pack_options.get("text_field", TEXT_FIELD) != TEXT_FIELD:
            raise PackError("a datatrove document's text is document.text: PackWriter takes no text_field")
        self.output = str(output)
        self.options = PartOptions.of(tokenizer, sources=sources, shard_tokens=shard_tokens, **pack_options)

    def records(self, data: DocumentsPipeline) -> Iterator[dict]:
        for document in data:
            self.stat_update("documents")
            yield self.record(document)

    def record(self, document: Document) -> dict:
        """The document's metadata (what ``where`` reads) and its text; with ``sources``, its file
        and line as the record's provenance."""
        record = {**document.metadata, TEXT_FIELD: document.text}
        if self.options.sources is not None:
            record[SOURCE_FIELD] = document.metadata.get(FILE_PATH_KEY)
            record[LINE_FIELD] = document.metadata.get(LINE_KEY)
        return record

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        options = replace(self.options, parts=world_size)
        manifest = pack_part(self.records(data or ()), rank, self.output, options)
        self.stat_update("tokens", value=manifest.tokens, unit="part")
        self.stat_update("shards", value=manifest.shards, unit="part")
        log.info("rank %d: part %s holds %d documents", rank, manifest.url, manifest.documents)


class MergeParts(PipelineStep):
    """A one-task step that merges the parts under ``output`` into the dataset at ``output`` (run it
    after the packing executor, e.g. with ``depends=``)."""

    name = "wdsllm merge"
    type = "Writer"

    def __init__(self, output: str, *, allow_partial: bool = False) -> None:
        super().__init__()
        self.output = str(output)
        self.allow_partial = allow_partial

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        if rank != 0:
            return
        index, parts = merge([self.output], self.output, allow_partial=self.allow_partial)
        self.stat_update("parts", value=len(parts), unit="merge")
        self.stat_update("documents", value=index.documents, unit="merge")


__all__ = ["FILE_PATH_KEY", "LINE_KEY", "MergeParts", "PackWriter", "line_adapter"]
