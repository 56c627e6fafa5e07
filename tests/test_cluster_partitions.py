"""The Spark/Dask partition functions, called as the engines call them (neither engine is
installed here: the functions are exercised with the objects the engines pass)."""

from __future__ import annotations

import pandas as pd
from cluster_helpers import GPT2, SMALL, documents_by_origin, local_pack, source_records

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
