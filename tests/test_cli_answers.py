"""The command line answers as a script expects: numbers refused at the face with the option's
name, --json output that every JSON parser reads (a failure included), verify naming a changed
sample by its key and byte range, and progress that says something true from the first line."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from pack_helpers import GPT2, SHAKESPEARE, cached, cli, pack_api

from wdsllm import format as fmt
from wdsllm.cli import cli as wdsllm_cli
from wdsllm.cli.output import to_json
from wdsllm.pack.job import PackConfig, pack


def _text(d: Path, chars: int = 120_000) -> Path:
    path = d / "shakespeare-head.txt"
    path.write_text(SHAKESPEARE.read_text()[:chars])
    return path


def tiny_docs() -> Path:
    """A docs-mode dataset of one shard of several small samples."""

    def build(d: Path) -> Path:
        pack_api([_text(d)], d / "ds", split="paragraph", sample_tokens=4096)
        return d / "ds"

    return cached("cli-answers-docs", build)


def pack_with_progress(inputs: list[Path], output: Path, on_progress, **options):
    cfg = PackConfig(inputs=[str(i) for i in inputs], output=str(output), tokenizer=str(GPT2), workers=1, **options)
    return pack(cfg, on_progress=on_progress)


def run(*args) -> tuple[int, str, str]:
    """``wdsllm ARGS`` in this process through click's runner: (status, stdout, stderr)."""
    result = CliRunner().invoke(wdsllm_cli, [str(a) for a in args], obj={"verbose": 0})
    return result.exit_code, result.stdout, result.stderr


# -- numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["stats", "DS", "--batch-size", "0"], "--batch-size"),
        (["stats", "DS", "--batch-size", "-8"], "--batch-size"),
        (["stats", "DS", "--seq-len", "-1"], "--seq-len"),
        (["stats", "DS", "--sample", "-2"], "--sample"),
        (["stats", "DS", "--max-tokens", "0"], "--max-tokens"),
        (["stats", "DS", "--window", "0"], "--window"),
        (["head", "DS", "-n", "-3"], "-n"),
        (["verify", "DS", "-j", "-1"], "--jobs"),
        (["pack", "x.txt", "-o", "out", "-t", "tok.json", "--seq-len", "0"], "--seq-len"),
        (["pack", "x.txt", "-o", "out", "-t", "tok.json", "--sample-tokens", "-5"], "--sample-tokens"),
        (["pack", "x.txt", "-o", "out", "-t", "tok.json", "--shard-size", "-1MiB"], "--shard-size"),
        (["count", "x.txt", "-o", "c.npz", "-t", "tok.json", "-j", "0"], "--workers"),
    ],
)
def test_a_number_out_of_range_is_refused_by_name(args, option):
    args = [str(tiny_docs()) if a == "DS" else a for a in args]
    status, out, err = run(*args)
    assert status == 2, out + err
    assert f"Invalid value for '{option}'" in err or f"Invalid value for '-j' / '{option}'" in err, err
    assert "unexpected" not in err and out == ""


def test_stats_with_a_zero_batch_size_is_a_usage_error_not_a_bug():
    result = cli("stats", tiny_docs(), "--batch-size", "0", check=False)
    assert result.returncode == 2
    assert "--batch-size" in result.stderr and "ZeroDivisionError" not in result.stderr


def test_head_zero_prints_nothing():
    status, out, _ = run("head", tiny_docs(), "-n", "0")
    assert status == 0 and out == ""


# -- JSON --------------------------------------------------------------------------------------


def _strict_json(text: str) -> object:
    def refuse(word: str) -> None:
        raise ValueError(f"{word} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_to_json_writes_no_nan():
    assert _strict_json(to_json({"a": float("nan"), "b": [float("inf"), 1.5]})) == {"a": None, "b": [None, 1.5]}


def test_info_json_of_an_index_with_a_nan_total_is_json_and_fails(tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(tiny_docs(), ds)
    index = json.loads((ds / "index.json").read_text())
    tokens = index["totals"]["tokens"]
    index["totals"]["tokens"] = float("nan")
    (ds / "index.json").write_text(json.dumps(index))
    status, out, err = run("info", ds, "--json")
    assert status == 1
    assert _strict_json(out)["totals"]["tokens"] is None
    assert "totals.tokens is nan" in err
    status, out, _ = run("info", ds)  # the summary still prints, and the status says it is wrong
    assert status == 1 and "documents" in out
    index["totals"]["tokens"] = tokens + 1
    (ds / "index.json").write_text(json.dumps(index))
    status, _, err = run("info", ds, "--json")
    assert status == 1 and f"the shard entries add up to {tokens}" in err


@pytest.mark.parametrize("command", ["info", "verify", "head", "stats"])
def test_an_unreadable_index_is_a_json_error_object(tmp_path, command):
    (tmp_path / "index.json").write_text("{not json")
    status, out, err = run(command, tmp_path, "--json")
    assert status == 1
    answer = _strict_json(out)
    assert answer["ok"] is False and "index.json" in answer["error"]
    assert "index.json" in err  # and the line for people


def test_the_wdsllm_command_answers_an_unreadable_index_in_json(tmp_path):
    (tmp_path / "index.json").write_text("{not json")
    result = cli("info", tmp_path, "--json", check=False)
    assert result.returncode == 1
    assert _strict_json(result.stdout)["ok"] is False and "index.json" in result.stderr


def test_a_missing_dataset_is_a_json_error_object(tmp_path):
    status, out, _ = run("verify", tmp_path / "nowhere", "--json")
    assert status == 1
    assert "cannot read the index" in _strict_json(out)["error"]


def test_a_usage_error_after_json_is_a_json_error_object():
    status, out, _ = run("stats", tiny_docs(), "--json", "--batch-size", "0")
    assert status == 2
    assert "--batch-size" in _strict_json(out)["error"]


def test_a_failed_pack_with_json_is_a_json_error_object(tmp_path):
    result = cli("pack", tmp_path / "missing.txt", "-o", tmp_path / "out", "-t", GPT2, "--json", check=False)
    assert result.returncode == 1
    assert _strict_json(result.stdout)["ok"] is False


# -- verify ------------------------------------------------------------------------------------


def test_verify_names_the_changed_sample_and_its_byte_range(tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(tiny_docs(), ds)
    index = fmt.Index.from_json((ds / "index.json").read_text())
    rows = np.load(ds / "groups.npy").reshape(-1, index.group_columns)
    offset, size = int(rows[1][0]), int(rows[1][3])  # the shard's second sample
    shard = ds / index.shards[0].name
    with tarfile.open(shard) as tar:
        tokens_at = next(m.offset_data for m in tar if m.offset > offset and m.name.endswith(".tokens.npy"))
    data = bytearray(shard.read_bytes())
    data[tokens_at + 200] ^= 0x01  # a token id changed: the sample still decodes
    shard.write_bytes(bytes(data))

    status, out, err = run("verify", ds, "-j", "1")
    assert status == 1
    assert f"{shard.name}: sample " in out
    assert f"bytes {offset}-{offset + size}: the bytes do not match the checksum in groups.npy" in out
    assert "problems;" in err
    report = _strict_json(run("verify", ds, "-j", "1", "--json")[1])
    assert any(f"bytes {offset}-{offset + size}" in f for f in report["failures"])


def test_verify_says_one_problem_in_the_singular(tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(tiny_docs(), ds)
    (ds / "tokenizer.json").write_text("{}")  # one dataset-level problem, no shard touched
    status, _, err = run("verify", ds, "-j", "1")
    assert status == 1
    assert "FAILED: 1 problem; 0 of" in err


# -- progress ----------------------------------------------------------------------------------


def test_count_shows_a_progress_line(tmp_path):
    text = _text(tmp_path, 30_000)
    status, _, err = run("count", text, "-t", GPT2, "--unit-bytes", "10000", "-o", tmp_path / "c.npz")
    assert status == 0
    lines = err.splitlines()
    assert lines[0].startswith("count [....................] 0/") and " units, 0 documents" in lines[0]
    assert lines[-1].startswith("count [####################] ")
    status, _, err = run("count", text, "-t", GPT2, "--unit-bytes", "10000", "-o", tmp_path / "d.npz", "-q")
    assert status == 0 and err == ""


class _StopAfterShards:
    """An on_progress that interrupts the pack once some shards are out (as Ctrl-C would)."""

    def __init__(self, shards: int):
        self.shards = shards

    def __call__(self, progress) -> None:
        if progress.shards >= self.shards and not progress.done:
            raise KeyboardInterrupt


def test_progress_counts_documents_from_the_first_report(tmp_path):
    reports = []
    pack_with_progress([_text(tmp_path)], tmp_path / "ds", lambda p: reports.append(dict(vars(p))), split="paragraph")
    first = reports[0]
    assert first["input_bytes"] > 0 and first["documents"] > 0 and first["tokens"] > 0


def test_a_resumed_pack_rates_only_the_tokens_it_packed(tmp_path):
    text = _text(tmp_path, 200_000)
    options = dict(split="paragraph", sample_tokens=2048, shard_size=16384)
    with pytest.raises(KeyboardInterrupt):
        pack_with_progress([text], tmp_path / "ds", _StopAfterShards(2), **options)
    result = pack_api([text], tmp_path / "ds", resume=True, **options)
    p = result.progress
    assert result.resumed_shards >= 2
    assert 0 < p.resumed_tokens < p.tokens == result.index.totals()["tokens"]
    assert p.tokens_per_s == pytest.approx((p.tokens - p.resumed_tokens) / p.elapsed)


# -- stats on packed data ----------------------------------------------------------------------


def tiny_packed(name: str, split: str) -> Path:
    def build(d: Path) -> Path:
        pack_api([_text(d, 60_000)], d / "ds", split=split, mode="packed", seq_len=128, sample_tokens=4096)
        return d / "ds"

    return cached(f"cli-answers-packed-{name}", build)


def test_stats_of_a_packed_dataset_counts_rows_padding_and_cut_documents():
    ds = tiny_packed("plays", "paragraph")
    status, out, err = run("stats", ds, "--json")
    assert status == 0, err
    (rows,) = _strict_json(out)["packed"]
    index = fmt.Index.from_json((ds / "index.json").read_text())
    lengths = np.load(ds / "lengths.npy").astype(np.int64)
    assert rows["rows"] == index.totals()["rows"] and rows["seq_len"] == 128
    assert rows["padding"] == rows["rows"] * 128 - int(lengths.sum()) and rows["short_rows"] == 1
    ends = np.cumsum(lengths)  # one shard: the row boundaries are the multiples of 128
    assert rows["documents_cut"] == int(np.count_nonzero((ends - lengths) // 128 < (ends - 1) // 128))
    status, out, _ = run("stats", ds)
    assert status == 0 and "packed rows are fixed" in out and f"{rows['documents_cut']:,}" in out


def test_stats_of_a_mixture_of_packed_datasets_tables_and_plots_its_shares(tmp_path):
    pytest.importorskip("matplotlib")
    mix = tmp_path / "mix.yaml"
    plays, lines = tiny_packed("plays", "paragraph"), tiny_packed("lines", "line")
    mix.write_text(f"sources:\n  plays: {plays}\n  lines: {lines}\nweights: {{plays: 0.7, lines: 0.3}}\n")
    status, out, err = run("stats", mix, "--plot", tmp_path / "shares.png")
    assert status == 0, err
    assert "quota (tokens)" in out and "planned shares drawn to" in out
    assert (tmp_path / "shares.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    answer = _strict_json(run("stats", mix, "--json")[1])
    assert [r["source"] for r in answer["mixture"]] == [r["source"] for r in answer["packed"]] == ["plays", "lines"]
