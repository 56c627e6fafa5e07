"""A tokenizer named by its hub id is found in the Hugging Face cache at the revision refs/main
names, not at whichever snapshot sorts last."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pack_helpers import GPT2, LLAMA

from wdsllm.pack.tokenizer import load_tokenizer


def _cache_with_two_snapshots(root: Path, main: str) -> Path:
    """An HF hub cache holding org/tok at two revisions (GPT-2 at 'aaaa…', Llama at 'ffff…')."""
    repo = root / "models--org--tok"
    for rev, source in (("a" * 40, GPT2), ("f" * 40, LLAMA)):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "tokenizer.json").write_bytes(source.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    return root


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_cache_lookup_follows_refs_main(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(_cache_with_two_snapshots(tmp_path / "a", "a" * 40)))
    assert load_tokenizer("org/tok").sha256 == _sha(GPT2)  # the older-sorting snapshot, because main names it
    monkeypatch.setenv("HF_HUB_CACHE", str(_cache_with_two_snapshots(tmp_path / "f", "f" * 40)))
    assert load_tokenizer("org/tok").sha256 == _sha(LLAMA)


def test_hf_home_is_honoured_when_hf_hub_cache_is_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    _cache_with_two_snapshots(tmp_path / "hub", "f" * 40)
    assert load_tokenizer("org/tok").sha256 == _sha(LLAMA)
