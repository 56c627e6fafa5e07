"""lengths.npy and groups.npy of a dataset being written (by ``wdsllm pack`` or ``merge``), given
in dataset order a shard's or a part's rows at a time.

They are staged in local files, hashed as they are written (``format.SideWriter``), summarised
as they go (the index's length histogram) and put into the output before index.json: what a
writer holds is one piece, never the dataset's lengths (4 bytes a document: 4 GB at a billion).
"""

from __future__ import annotations

import os

import numpy as np

from .. import format as fmt
from .. import storage
from ..format.side import SideWriter


class SideFiles:
    """The side files of ``documents`` documents in ``groups`` groups of ``columns`` columns."""

    def __init__(self, out: storage.Output, documents: int, groups: int, columns: int = fmt.GROUP_COLUMNS):
        self.out = out
        staging = out.local_staging_dir()
        self.lengths = SideWriter(
            os.path.join(staging, f".{fmt.LENGTHS_NAME}.tmp"), fmt.LENGTHS_NAME, np.uint32, documents
        )
        self.groups: SideWriter | None = SideWriter(
            os.path.join(staging, f".{fmt.GROUPS_NAME}.tmp"), fmt.GROUPS_NAME, np.int64, groups * columns
        )
        self.summary = fmt.LengthSummary()

    def add_lengths(self, lengths: np.ndarray) -> None:
        """The next documents' lengths."""
        self.lengths.write(lengths)
        self.summary.add(lengths)

    def add_groups(self, rows: np.ndarray | None) -> None:
        """The next rows of groups.npy (None: a shard or part without them, a format-1 dataset;
        then the whole has none)."""
        if rows is None and self.groups is not None:
            self.groups.abort()
            self.groups = None
        elif self.groups is not None:
            self.groups.write(np.asarray(rows, np.int64).reshape(-1))

    def put(self) -> tuple[fmt.SideFile, fmt.SideFile | None]:
        """Finish both files and put them into the output; their index references."""
        lengths = self.lengths.finish()
        groups = self.groups.finish() if self.groups is not None else None
        self.out.put_file(self.lengths.path, fmt.LENGTHS_NAME)
        if groups is not None:
            self.out.put_file(self.groups.path, fmt.GROUPS_NAME)
        return lengths, groups

    def abort(self) -> None:
        for writer in (self.lengths, self.groups):
            if writer is not None:
                writer.abort()

    def __enter__(self) -> SideFiles:
        return self

    def __exit__(self, kind, *_exc) -> None:
        if kind is not None:
            self.abort()
