"""Parallel layouts under real torchrun (gloo, 127.0.0.1): data-parallel ranks from a DeviceMesh
or from process groups, replica peers (tensor, context, pipeline parallel) yielding the same
batches, read by each or broadcast by one, and the check that peers agree."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from pack_helpers import cached
from synth import write_dataset

SCRIPT = Path(__file__).parent / "scripts" / "parallel_layout.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, out: Path, *args: str, timeout: float = 240) -> list[dict]:
    """Every rank's report of one run of the script (which must exit cleanly on every rank)."""
    return torchrun_runs(nproc, {"run": (out, list(args))}, timeout)["run"]


def torchrun_runs(nproc: int, runs: dict[str, tuple[Path, list[str]]], timeout: float = 240) -> dict[str, list[dict]]:
    """Every rank's report of each run, by name: the runs go one after the other in one launch
    (one start of torchrun and of its processes for several layouts)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(SCRIPT)]
    for i, (out, args) in enumerate(runs.values()):
        out.mkdir(parents=True, exist_ok=True)
        cmd += [*(["--then"] if i else []), "--out", str(out), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish in {timeout} s (a rank hung?)\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {
        name: [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)] for name, (out, _) in runs.items()
    }


@pytest.fixture(scope="module")
def data() -> tuple[Path, list[int]]:
    def build(d: Path) -> tuple[Path, list[int]]:
        info = write_dataset(d / "ds", [12, 12, 12, 12], max_len=30, seed=3)
        return d / "ds", sorted(info["expect"])

    return cached("layouts-data", build)


@pytest.fixture(scope="module")
def four(data) -> tuple[Path, dict[str, list[dict]]]:
    """The 4-process runs of the local dataset, by name, from one launch (once per test run, its
    xdist workers included): each test below checks its own. The runs whose peers fail on purpose
    (another seed) come last."""
    return cached("layouts-four", lambda tmp: (tmp, _four_runs(data[0], tmp)))


def _four_runs(root: Path, tmp: Path) -> dict[str, list[dict]]:
    on = ["--data", str(root)]
    runs = {
        "mesh-read": [*on, "--layout", "dp2tp2"],
        "groups-broadcast": [*on, "--layout", "dp2tp2", "--groups", "--replicas", "broadcast"],
        "dp2cp2": [*on, "--layout", "dp2cp2", "--groups"],
        "pp2dp2": [*on, "--layout", "pp2dp2"],
        "json-saved": [*on, "--layout", "dp2tp2", "--save-at", "2"],
        "json-resumed": [*on, "--layout", "dp4", "--resume", str(tmp / "json-saved")],
        "dcp-saved": [*on, "--layout", "dp2tp2", "--save-at", "2", "--dcp"],
        "dcp-resumed": [*on, "--layout", "dp4", "--resume", str(tmp / "dcp-saved"), "--dcp"],
        "other-seed-read": [*on, "--layout", "dp2tp2", "--other-seed-at", "tp", "--replicas", "read"],
        "other-seed-broadcast": [*on, "--layout", "dp2tp2", "--other-seed-at", "tp", "--replicas", "broadcast"],
    }
    return torchrun_runs(4, {name: (tmp / name, args) for name, args in runs.items()}, timeout=560)


def _peers(reports: list[dict], *, differ_in: str) -> list[list[dict]]:
    """The reports grouped by every coordinate but ``differ_in``."""
    groups: dict[tuple, list[dict]] = {}
    for rep in reports:
        key = tuple(sorted((k, v) for k, v in rep["coords"].items() if k != differ_in))
        groups.setdefault(key, []).append(rep)
    return list(groups.values())


def _check_epoch_once(reports: list[dict], expect: list[int], dp_size: int) -> None:
    """Equal steps everywhere; the DP ranks' documents disjoint, their union the epoch."""
    assert len({len(r["steps"]) for r in reports}) == 1, "every rank yields the same number of steps"
    by_dp = {}
    for rep in reports:
        if any(s.get("docs") for s in rep["steps"]):
            by_dp.setdefault(rep["dp_rank"], [d for s in rep["steps"] for d in s["docs"]])
    assert sorted(by_dp) == list(range(dp_size))
    seen = Counter(d for docs in by_dp.values() for d in docs)
    assert max(seen.values()) == 1, "a document went to two data-parallel ranks"
    assert sorted(seen) == expect, "the data-parallel ranks' union is the epoch"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["mesh-read", "groups-broadcast"])
def test_dp2_tp2_tensor_peers_share_every_batch_and_dp_ranks_split_the_epoch(data, four, how):
    _, expect = data
    reports = four[1][how]
    assert all("error" not in r for r in reports), [r.get("error") for r in reports]
    assert {(r["dp_rank"], r["dp_size"]) for r in reports} == {(0, 2), (1, 2)}
    for peers in _peers(reports, differ_in="tp"):
        assert len(peers) == 2
        assert peers[0]["steps"] == peers[1]["steps"], "tensor-parallel peers yield identical batches"
    _check_epoch_once(reports, expect, 2)


@pytest.mark.timeout(600)
def test_dp2_cp2_context_peers_hold_the_two_halves_of_one_batch(data, four):
    """Megatron style: dp_group, replica_group and cp_group (the mesh's CP dim: the 8-process
    test and the example)."""
    _, expect = data
    reports = four[1]["dp2cp2"]
    for a, b in _peers(reports, differ_in="cp"):
        a, b = sorted((a, b), key=lambda r: r["coords"]["cp"])
        assert len(a["steps"]) == len(b["steps"])
        for sa, sb in zip(a["steps"], b["steps"]):
            assert sa["docs"] == sb["docs"], "context-parallel peers slice the same batch"
            assert sa["ranges"] != sb["ranges"]
            width = 2 * len(sa["input_ids"][0])
            whole = [[None] * width for _ in sa["input_ids"]]
            for part in (sa, sb):
                for i, row in enumerate(part["input_ids"]):
                    at = 0
                    for lo, hi in part["ranges"]:
                        whole[i][lo:hi] = row[at : at + hi - lo]
                        at += hi - lo
            assert all(None not in row for row in whole), "the slices cover every token"
    _check_epoch_once(reports, expect, 2)


@pytest.mark.timeout(600)
def test_pp2_dp2_first_stage_gets_inputs_last_gets_labels(data, four):
    _, expect = data
    reports = four[1]["pp2dp2"]
    for rep in reports:
        keys = set(rep["steps"][0]["digest"])
        if rep["coords"]["pp"] == 0:
            assert "input_ids" in keys and "labels" not in keys
        else:
            assert "labels" in keys and "loss_mask" in keys and "input_ids" not in keys
    _check_epoch_once(reports, expect, 2)


@pytest.mark.timeout(400)
def test_pp3_dp2_middle_stages_read_nothing_and_step_with_the_others(data, tmp_path, http_server):
    """replicas="read" over HTTP, 6 processes: each pipeline's middle stage fetches no shard byte
    (only the index, as every rank does) and builds no batch; it follows its first stage (one
    small header per step) and yields {"epoch"} as often as the others step, with the same len()
    and epoch after the pass; the first and last stages read for themselves (the server serves
    each shard request twice); states after 2 steps are identical on the three stages; the
    agreement check (every 2 steps) passes with the middle stage's digests sent by the first."""
    import shutil

    root, expect = data
    shutil.copytree(root, http_server.root / "ds")
    url = http_server.url_for("ds").rstrip("/")
    args = ["--data", url, "--layout", "pp3dp2", "--workers", "0", "--state-at", "2", "--agree-every", "2"]
    reports = torchrun(6, tmp_path / "out", *args)
    assert all("error" not in r for r in reports), [r.get("error") for r in reports]
    by_stage = {s: [r for r in reports if r["coords"]["pp"] == s] for s in range(3)}
    for first, middle, last in zip(*(sorted(by_stage[s], key=lambda r: r["dp_rank"]) for s in range(3))):
        assert first["dp_rank"] == middle["dp_rank"] == last["dp_rank"]
        assert all(step["digest"] == {} for step in middle["steps"]), "a middle stage gets only the epoch"
        assert "input_ids" in first["steps"][0]["digest"] and "labels" in last["steps"][0]["digest"]
        assert [s["docs"] for s in first["steps"]] == [s["docs"] for s in last["steps"]]
        assert len(middle["steps"]) == len(first["steps"]) == first["len"] > 2
        assert (middle["len"], middle["epoch"]) == (first["len"], first["epoch"]) == (last["len"], last["epoch"])
        assert middle["state"] == first["state"] == last["state"]
        assert middle["received_bytes"] < first["received_bytes"] == last["received_bytes"], "the end stages read"
    # every shard request twice (the first and the last stage of one DP rank), none a third time
    requests = Counter((rec.path, rec.range) for rec in http_server.log("*.tar"))
    assert set(requests.values()) == {2}, requests
    assert {Path(path).name for path, _ in requests} == {p.name for p in root.glob("*.tar")}
    _check_epoch_once(reports, expect, 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("replicas", ["read", "broadcast"])
def test_a_peer_with_another_seed_fails_at_construction(four, replicas):
    reports = four[1][f"other-seed-{replicas}"]
    for rep in reports:
        err = rep.get("error")
        assert err is not None and err["type"] == "ReplicaMismatchError", rep
        assert err["step"] == "construction", "the settings are compared before the first collective"
        assert "setting 'seed': 7 at dp=" in err["message"] and "8 at dp=0 tp=1" in err["message"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["json", "dcp"])
def test_dp2_tp2_saved_mid_epoch_resumes_as_dp4_with_every_document_once(data, four, how):
    """dp2 x tp2 saves after 2 steps (every rank: the tensor peers' states are compared and
    equal), as JSON per DP rank or through torch.distributed.checkpoint; dp4 resumes from them:
    the epoch ends with every document exactly once."""
    _, expect = data
    tmp, reports = four
    before = reports[f"{how}-saved"]
    assert all("error" not in r for r in before)
    if how == "json":
        saved = sorted(p.name for p in (tmp / "json-saved").glob("state-*.json"))
        assert saved == ["state-dp0.json", "state-dp1.json"]
    after = reports[f"{how}-resumed"]
    assert len({len(r["steps"]) for r in after}) == 1
    seen = Counter(d for rep in before if rep["coords"]["tp"] == 0 for s in rep["steps"] for d in s["docs"])
    seen.update(d for rep in after for s in rep["steps"] for d in s["docs"])
    assert max(seen.values()) == 1 and sorted(seen) == expect


def _shard_bytes(server, root: Path) -> int:
    """Bytes of shards the server was asked for: each GET's range, or the whole file."""
    total = 0
    for rec in server.log("*.tar"):
        if rec.range is None:
            total += (root / Path(rec.path).name).stat().st_size
        else:
            lo, hi = rec.range.removeprefix("bytes=").split("-")
            size = (root / Path(rec.path).name).stat().st_size
            total += min(int(hi), size - 1) + 1 - int(lo) if hi else size - int(lo)
    return total


@pytest.mark.timeout(400)
def test_broadcast_over_http_reads_the_shard_bytes_of_the_dp_ranks_alone(data, tmp_path, http_server):
    """dp2 x tp2 with replicas="broadcast" asks the server for the same shard bytes as dp2 alone:
    the tensor peers that receive read nothing."""
    import shutil

    root, expect = data
    shutil.copytree(root, http_server.root / "ds")
    url = http_server.url_for("ds").rstrip("/")
    alone = torchrun(2, tmp_path / "alone", "--data", url, "--layout", "dp2tp1", "--workers", "0")
    alone_bytes = _shard_bytes(http_server, root)
    http_server.reset()
    shared = torchrun(
        4, tmp_path / "tp", "--data", url, "--layout", "dp2tp2", "--replicas", "broadcast", "--workers", "0"
    )
    assert alone_bytes > 0 and _shard_bytes(http_server, root) == alone_bytes
    for peers in _peers(shared, differ_in="tp"):
        assert peers[0]["steps"] == peers[1]["steps"]
    assert sorted(d for r in alone for s in r["steps"] for d in s["docs"]) == expect
    _check_epoch_once(shared, expect, 2)


@pytest.mark.timeout(300)
def test_a_reader_that_fails_tells_its_receivers(data, tmp_path, http_server):
    """replicas="broadcast" over HTTP with a shard that answers 404: the reader raises the storage
    error, and its tensor peer raises ReplicaError naming it instead of waiting for a batch."""
    import shutil

    root, _ = data
    shutil.copytree(root, http_server.root / "ds")
    http_server.faults.add("*/shard-000002.tar", "status_permanent", status=404)
    url = http_server.url_for("ds").rstrip("/")
    args = ["--data", url, "--layout", "dp1tp2", "--replicas", "broadcast", "--workers", "0"]
    reader, receiver = sorted(torchrun(2, tmp_path / "out", *args), key=lambda r: r["coords"]["tp"])
    assert reader["error"]["type"] in ("NotFoundError", "StorageError"), reader
    assert receiver["error"]["type"] == "ReplicaError"
    assert "the reader of this replica group (dp=0 tp=0) failed" in receiver["error"]["message"]
    assert "shard-000002.tar" in receiver["error"]["message"]
    assert len(receiver["steps"]) == len(reader["steps"]), "the receiver got every batch read before"


@pytest.mark.timeout(300)
def test_a_first_stage_that_fails_tells_its_middle_stage(data, tmp_path, http_server):
    """replicas="read", pp3 from process groups (Megatron style: pp_group=) over HTTP with a shard
    that answers 404: the first and last stages raise the storage error themselves; the middle
    stage, which reads nothing, raises ReplicaError naming its first stage and the error, after as
    many steps as the first stage took."""
    import shutil

    root, _ = data
    shutil.copytree(root, http_server.root / "ds")
    http_server.faults.add("*/shard-000002.tar", "status_permanent", status=404)
    url = http_server.url_for("ds").rstrip("/")
    args = ["--data", url, "--layout", "dp1pp3", "--groups", "--workers", "0"]
    first, middle, last = sorted(torchrun(3, tmp_path / "out", *args), key=lambda r: r["coords"]["pp"])
    for end in (first, last):
        assert end["error"]["type"] in ("NotFoundError", "StorageError"), end
    assert middle["error"]["type"] == "ReplicaError", middle
    assert "the reader of this replica group (dp=0 replica=0) failed" in middle["error"]["message"]
    assert "shard-000002.tar" in middle["error"]["message"]
    assert len(middle["steps"]) == len(first["steps"]), "the middle stage stepped with its first stage"


@pytest.mark.timeout(400)
def test_dp2_tp2_cp2_on_eight_processes(data, tmp_path):
    """8 processes: the 4 tensor x context peers of each data-parallel rank hold one batch (the
    two tensor peers the same slice, the two context peers its halves)."""
    root, expect = data
    reports = torchrun(8, tmp_path / "out", "--data", str(root), "--layout", "dp2tp2cp2", "--replicas", "broadcast")
    assert all("error" not in r for r in reports), [r.get("error") for r in reports]
    for peers in _peers(reports, differ_in="tp"):
        assert peers[0]["steps"] == peers[1]["steps"], "tensor-parallel peers hold the same slice"
    for peers in _peers(reports, differ_in="cp"):
        assert [s["docs"] for s in peers[0]["steps"]] == [s["docs"] for s in peers[1]["steps"]]
        assert peers[0]["steps"][0]["ranges"] != peers[1]["steps"][0]["ranges"]
    _check_epoch_once(reports, expect, 2)


@pytest.mark.timeout(400)
def test_replica_peers_agree_in_every_batching_mode_a_mixture_and_raw_text(tmp_path, shakespeare, gpt2_json):
    """Two tensor peers, read and broadcast: the same batches in every mode, packed rows, a
    mixture and raw text; a run saved after 2 batches and resumed equals the epoch, and the
    resumed pass is checked; peers that saved at different steps get ReplicaMismatchError at the
    first batch of the resumed pass."""
    write_dataset(tmp_path / "docs", [11, 7, 9], max_len=30, seed=1)
    write_dataset(tmp_path / "other", [8, 6], max_len=20, seed=2)
    write_dataset(tmp_path / "rows", [5, 6, 4], mode="packed", seq_len=16, max_len=9, seed=3)
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join(shakespeare.read_text().splitlines()[:120]) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    args = ["--docs", str(tmp_path / "docs"), "--other", str(tmp_path / "other"), "--rows", str(tmp_path / "rows")]
    args += ["--raw", str(raw), "--tokenizer", str(gpt2_json), "--out", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(_free_port()), str(SCRIPT.parent / "parallel_modes.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stderr[-5000:]
    a, b = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    for rep in (a, b):  # peers that saved at different steps: both refuse their first batch, naming the field
        mismatch = rep.pop("state_mismatch")
        assert mismatch and "different batches (epoch 0, batch 0 of this pass)" in mismatch, mismatch
        assert re.search(r"first difference is field '\w+'", mismatch), mismatch
    assert len(a) == 14
    for case, got in a.items():
        assert got == b[case], f"{case}: the tensor peers differ"
        assert got["full"], case
        assert got["resumed"] == got["full"], f"{case}: the resumed run differs from the epoch"
        assert got["checks"] >= 1, f"{case}: the resumed pass was not checked"
    for name in ("fixed", "pack", "rows", "mixture", "raw"):
        assert a[f"{name}/read"]["full"] == a[f"{name}/broadcast"]["full"], f"{name}: broadcast changes the batches"
