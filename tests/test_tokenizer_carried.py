"""The dataset carries its tokenizer (issue #17): pack writes tokenizer.json beside the index,
verify checks it against the index's sha256, and head and the loader use it, also after the
dataset moved to a machine without the original tokenizer file."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from pack_helpers import GPT2, SHAKESPEARE, cached, cli, pack_api
from synth import write_dataset

import wdsllm
from wdsllm import format as fmt
from wdsllm.errors import TokenizerError


def _packed(tmp_path):
    """A pack made with a tokenizer file that is then deleted, and the dataset moved elsewhere."""

    def build(d):
        tok = d / "my-tokenizer.json"
        shutil.copy(GPT2, tok)
        text = d / "head.txt"
        text.write_bytes(SHAKESPEARE.read_bytes()[:4000])
        pack_api([text], d / "ds", tokenizer=tok)
        return d / "ds"

    original = cached("carried-tokenizer", build)
    moved = tmp_path / "elsewhere"
    shutil.copytree(original, moved)
    return moved


def test_pack_stores_the_tokenizer_and_verify_checks_it(tmp_path):
    ds = _packed(tmp_path)
    index = fmt.Index.from_json((ds / "index.json").read_text())
    assert index.tokenizer.source.endswith("my-tokenizer.json")
    assert index.tokenizer_file == fmt.SideFile.of("tokenizer.json", (ds / "tokenizer.json").read_bytes())
    assert hashlib.sha256((ds / "tokenizer.json").read_bytes()).hexdigest() == index.tokenizer.sha256
    assert (ds / "tokenizer.json").read_bytes() == GPT2.read_bytes()
    assert cli("verify", ds).returncode == 0
    data = json.loads((ds / "tokenizer.json").read_text())
    data["added_tokens"] = []
    (ds / "tokenizer.json").write_text(json.dumps(data))
    bad = cli("verify", ds, check=False)
    assert bad.returncode == 1 and "tokenizer.json: size or sha256 differs" in bad.stdout
    (ds / "tokenizer.json").unlink()
    gone = cli("verify", ds, check=False)
    assert gone.returncode == 1 and "tokenizer.json: missing" in gone.stdout


def test_head_and_the_loader_decode_with_the_carried_tokenizer(tmp_path):
    ds = _packed(tmp_path)
    out = cli("head", ds, "-n", "2", "--json", "--skip-special-tokens")
    assert "warning" not in out.stderr
    first = json.loads(out.stdout.splitlines()[0])
    assert first["text"].strip() == SHAKESPEARE.read_text().splitlines()[0].strip()
    loader = wdsllm.loader(ds, batch_size=2, shuffle=False)
    batch = next(iter(loader))
    text = loader.tokenizer.decode(batch["input_ids"][0, : int(batch["lengths"][0])].tolist(), skip_special_tokens=True)
    assert text == first["text"]
    assert wdsllm.dataset(ds, batch_size=2).tokenizer.to_str() == loader.tokenizer.to_str()


def test_a_dataset_without_tokenizer_json_says_so(tmp_path):
    write_dataset(tmp_path, [5, 4])
    with pytest.raises(TokenizerError, match="carries no tokenizer.json"):
        wdsllm.loader(tmp_path, batch_size=2).tokenizer  # noqa: B018
