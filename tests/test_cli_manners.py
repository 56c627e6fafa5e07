"""CLI manners (issue #17): a closed pipe ends quietly with status 0, Ctrl-C during a pack exits
130 with the command that continues it, --json output parses, `python -m wdsllm` works, every
command's --help has an example, and errors are one line, never a traceback or a blank message."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time

import pytest
from pack_helpers import GPT2, REPO, SHAKESPEARE, WIKI, cached, cli, pack_api

COMMANDS = ["pack", "info", "verify", "head", "merge", "count", "stats"]


def _dataset():
    def build(d):
        text = d / "head.txt"
        text.write_bytes(SHAKESPEARE.read_bytes()[:200_000])
        pack_api([text], d / "ds", shard_size=64 << 10)
        return d / "ds"

    return cached("cli-manners", build)


def wdsllm(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wdsllm", *map(str, args)], cwd=REPO, **kw)


@pytest.mark.parametrize(
    "args", [("head", "-n", "5000"), ("head", "-n", "5000", "--json"), ("info", "--json")], ids=" ".join
)
def test_a_closed_pipe_ends_quietly_with_status_0(args):
    """`wdsllm head ds | head`: the reader goes away after a little output."""
    proc = wdsllm(args[0], _dataset(), *args[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(200)
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert err.decode() == ""


def _interruptible() -> None:
    """A job started in the background by a non-interactive shell (a CI runner) inherits SIGINT
    ignored, and Python then keeps it ignored: the pack under test gets the default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_pack_exits_130_and_prints_the_resume_command(tmp_path):
    out = tmp_path / "out"
    # two files: on a loaded machine the first shard of one file can appear near the pack's end
    proc = wdsllm(
        "pack", *WIKI[:2], "-o", out, "-t", GPT2, "--shard-size", "4KiB", "-j", "1",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    while not list(out.glob("shard-*.tar")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the pack ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    command = stderr.strip().splitlines()[-1].strip()
    args = shlex.split(command)
    assert args[0] == "wdsllm" and args[-1] == "--resume" and str(out) in args
    resumed = cli(*args[1:], "-q")
    assert resumed.returncode == 0
    assert json.loads(cli("verify", out, "--json").stdout)["ok"] is True


def test_json_output_parses(tmp_path):
    text = tmp_path / "in.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:20_000])
    packed = json.loads(cli("pack", text, "-o", tmp_path / "ds", "-t", GPT2, "-j", "1", "--json").stdout)
    assert packed["documents"] > 100 and packed["shards"] == 1 and packed["output"].endswith("ds")
    report = json.loads(cli("verify", tmp_path / "ds", "--json").stdout)
    assert report == {
        "dataset": str(tmp_path / "ds"),
        "ok": True,
        "shards": 1,
        "documents": packed["documents"],
        "tokens": packed["tokens"],
        "bad_shards": 0,
        "failures": [],
    }
    index = json.loads(cli("info", tmp_path / "ds", "--json").stdout)
    assert index["totals"]["documents"] == packed["documents"]
    shard = tmp_path / "ds" / "shard-000000.tar"
    shard.write_bytes(shard.read_bytes()[:-2048])
    bad = cli("verify", tmp_path / "ds", "--json", check=False)
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and report["bad_shards"] == 1 and report["failures"]


def test_python_dash_m_and_examples_in_every_help():
    version = subprocess.run([sys.executable, "-m", "wdsllm", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("wdsllm")
    for command in ["", *COMMANDS]:
        out = cli(*([command] if command else []), "--help").stdout
        assert "Examples:" in out and "wdsllm " in out.split("Examples:")[1], command


@pytest.mark.parametrize(
    "edit",
    [
        lambda idx: idx["shards"][0].update(documents="12"),  # a count as a string
        lambda idx: idx.update(shards=None),
        lambda idx: idx.update(tokenizer={}),
    ],
    ids=["string-count", "no-shards", "empty-tokenizer"],
)
@pytest.mark.parametrize("command", ["info", "verify", "head"])
def test_errors_are_one_line_never_a_traceback(tmp_path, edit, command):
    ds = tmp_path / "ds"
    ds.mkdir()
    index = json.loads((_dataset() / "index.json").read_text())
    edit(index)
    (ds / "index.json").write_text(json.dumps(index))
    result = cli(command, ds, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and len(errors[0]) > len("Error: ") + 10, result.stderr
