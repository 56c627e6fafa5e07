"""examples/quickstart.py (what tools/demo.sh runs): its summary of an epoch says what the epoch held."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from pack_helpers import GPT2, wiki_lines

import wdsllm
from wdsllm.pack.part import PartOptions, pack_part

QUICKSTART = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_epoch_summary_counts_documents_not_the_pieces_max_len_cut(tmp_path):
    """#43: it printed 28,469 documents for an epoch of 24,959 (it counted pieces)."""
    records = [json.loads(line) for line in wiki_lines(300)]
    packed = pack_part(records, 0, str(tmp_path), PartOptions.of(str(GPT2))).url
    documents = len([r for r in records if r["text"].strip()])
    epoch = _quickstart().Epoch()
    for batch in wdsllm.loader(packed, batch_size=16, max_len=64, num_workers=0, seed=0):
        epoch.add(batch)
    assert epoch.documents == documents and epoch.pieces > documents
    assert f"{documents:,} documents in {epoch.pieces:,} pieces" in epoch.summary(1.0)
