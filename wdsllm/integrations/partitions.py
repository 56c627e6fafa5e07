"""Spark and Dask: a partition function that packs each partition into a part (docs/cluster.md).

::

    packer = PackPartitions("s3://bucket/packed/", tokenizer="tokenizer.json")
    df.rdd.mapPartitionsWithIndex(packer.spark).collect()        # Spark: a manifest per partition
    ddf.map_partitions(packer.dask, meta=packer.dask_meta).compute()  # Dask
    # then, once: wdsllm merge s3://bucket/packed/ -o s3://bucket/packed/

Partition ``i`` becomes ``OUT/part-NNNNN/`` (``i``'s number) through
:func:`wdsllm.pack.part.pack_part`, so a retried partition task continues or finds its part, as a
Ray write task does, and a re-run with another partitioning is refused by the first partition that
finds a part of other rows. Pass ``parts=`` (the number of partitions) to have merge name any
missing part and refuse parts of a run with another number. Imports neither engine: the functions
are what the engines call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any, ClassVar, Protocol

from ..pack.part import PartOptions, pack_part


class SparkRow(Protocol):
    """What pyspark's ``Row`` gives us."""

    def asDict(self, recursive: bool = False) -> dict: ...


class PackPartitions:
    """Packs each partition it is given into the part of the partition's number."""

    #: the columns of what ``dask`` returns (Dask's ``meta``)
    dask_meta: ClassVar[dict[str, str]] = {
        "part_id": "int64",
        "url": "object",
        "documents": "int64",
        "tokens": "int64",
        "digest": "object",
    }

    def __init__(
        self,
        out: str,
        tokenizer: str,
        *,
        sources: Iterable[str] | None = None,
        shard_tokens: int | None = None,
        **pack_options: Any,
    ) -> None:
        self.out = str(out)
        self.options = PartOptions.of(tokenizer, sources=sources, shard_tokens=shard_tokens, **pack_options)

    def spark(self, index: int, rows: Iterable[SparkRow]) -> Iterator[dict]:
        """For ``rdd.mapPartitionsWithIndex``: yields the part's manifest as a dict."""
        manifest = pack_part((row.asDict(recursive=True) for row in rows), index, self.out, self.options)
        yield asdict(manifest)

    def dask(self, frame: Any, partition_info: dict | None = None) -> Any:
        """For ``map_partitions``: a one-row pandas DataFrame of the part's manifest (``dask_meta``)."""
        import pandas as pd

        if partition_info is None:  # Dask's meta inference calls it on an empty frame
            return pd.DataFrame({k: pd.Series(dtype=v) for k, v in self.dask_meta.items()})
        records = frame.to_dict("records")
        manifest = pack_part(records, int(partition_info["number"]), self.out, self.options)
        return pd.DataFrame([{k: getattr(manifest, k) for k in self.dask_meta}])


__all__ = ["PackPartitions", "SparkRow"]
