"""The Spark/Dask partition functions: Dask's map_partitions run for real where Dask is installed
(it runs in this process, nothing to download); Spark's mapPartitionsWithIndex (which needs a JVM
and a Spark install) with the objects Spark passes."""

from __future__ import annotations

import pandas as pd
import pytest
from cluster_helpers import GPT2, SMALL, documents_by_origin, local_pack, source_records

from wdsllm.errors import PackError
from wdsllm.integrations.partitions import PackPartitions
from wdsllm.pack.merge import merge

N = 2000


class Row(dict):
    """pyspark's Row, as far as the partition function uses it."""

    def asDict(self, recursive: bool = False) -> dict:
        return dict(self)


def test_spark_and_dask_partitions_merge_into_the_local_pack(tmp_path):
    name, records = source_records(N)
    packer = PackPartitions(str(tmp_path), tokenizer=str(GPT2), sources=[name], **SMALL)
    [manifest] = packer.spark(0, (Row(r) for r in records[:1000]))
    assert manifest["part_id"] == 0 and manifest["documents"] == 1000
    assert packer.dask(pd.DataFrame(records[:0])).empty  # Dask's meta inference
    done = packer.dask(pd.DataFrame(records[1000:]), partition_info={"number": 1, "division": None})
    assert done["documents"].tolist() == [1000]
    merge([str(tmp_path)], str(tmp_path))
    assert documents_by_origin(tmp_path) == documents_by_origin(local_pack(N))


def test_dask_map_partitions_packs_a_part_per_partition(tmp_path):
    dd = pytest.importorskip("dask.dataframe")
    name, records = source_records(N)
    packer = PackPartitions(str(tmp_path), tokenizer=str(GPT2), sources=[name], **SMALL)
    frame = dd.from_pandas(pd.DataFrame(records), npartitions=3, sort=False)
    manifests = frame.map_partitions(packer.dask, meta=packer.dask_meta).compute(scheduler="threads")
    assert manifests["part_id"].tolist() == [0, 1, 2] and manifests["documents"].sum() == N
    again = frame.map_partitions(packer.dask, meta=packer.dask_meta).compute(scheduler="threads")
    assert again["digest"].tolist() == manifests["digest"].tolist()  # a rerun finds the committed parts
    other = dd.from_pandas(pd.DataFrame(records), npartitions=2, sort=False)  # a rerun partitioned otherwise
    with pytest.raises(PackError, match=r"part-0000[01] holds other input than this task's \(\d+ records"):
        other.map_partitions(packer.dask, meta=packer.dask_meta).compute(scheduler="synchronous")
    merge([str(tmp_path)], str(tmp_path))
    assert documents_by_origin(tmp_path) == documents_by_origin(local_pack(N))
