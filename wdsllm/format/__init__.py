"""The format: the contract between packing and loading (docs/format.md).

``pack/`` writes it and ``load/`` reads it; both import this package and nothing of each other.
This module exposes the index and group layer (pure data and numpy); the tar reader and writer
(:mod:`.tar`), ``verify`` and ``head`` are imported where they are used.
"""

from __future__ import annotations

from ..errors import FormatError, ShardError
from .group import (
    GROUP_COLUMNS,
    LENGTHS,
    META,
    STARTS,
    TOKENS,
    Group,
    check_group_table,
    decode_group,
    encode_group,
    expand_provenance,
    group_key,
    group_table_bytes,
    npy_array,
    npy_bytes,
    provenance_runs,
)
from .index import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUPS_NAME,
    INDEX_NAME,
    LENGTHS_NAME,
    MODES,
    READABLE_VERSIONS,
    SHARD_PATTERN,
    SHARD_RE,
    Index,
    ShardEntry,
    SideFile,
    TokenizerInfo,
    check_shard_name,
    length_histogram,
    read_side_file,
    shard_name,
    token_dtype,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "GROUPS_NAME",
    "GROUP_COLUMNS",
    "INDEX_NAME",
    "LENGTHS",
    "LENGTHS_NAME",
    "META",
    "MODES",
    "READABLE_VERSIONS",
    "SHARD_PATTERN",
    "SHARD_RE",
    "STARTS",
    "TOKENS",
    "FormatError",
    "Group",
    "Index",
    "ShardEntry",
    "ShardError",
    "SideFile",
    "TokenizerInfo",
    "check_group_table",
    "check_shard_name",
    "decode_group",
    "encode_group",
    "expand_provenance",
    "group_key",
    "group_table_bytes",
    "length_histogram",
    "npy_array",
    "npy_bytes",
    "provenance_runs",
    "read_side_file",
    "shard_name",
    "token_dtype",
]
