"""Shared fixtures: paths to the real tokenizers and corpora in ../shared/data."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
TOKENIZERS = SHARED_DATA / "tokenizers"
CORPORA = SHARED_DATA / "corpora"
WIKI = sorted((CORPORA / "wiki").glob("wiki-*.jsonl.gz"))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cloud_fixtures import *  # noqa: E402, F403 - GCS and Azure emulators, a fake Hub, a fault proxy
from remote_fixtures import *  # noqa: E402, F403 - fixtures for real HTTP and S3 servers on 127.0.0.1

# Keep tokenizer threads from oversubscribing the 2-core CI machine inside test processes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def gpt2_json() -> Path:
    return TOKENIZERS / "gpt2.json"


@pytest.fixture(scope="session")
def llama_json() -> Path:
    return TOKENIZERS / "openllama.json"


@pytest.fixture(scope="session")
def neox_json() -> Path:
    return TOKENIZERS / "gpt-neox-20b.json"


@pytest.fixture(scope="session")
def wiki_files() -> list[Path]:
    return WIKI


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return CORPORA / "tinyshakespeare.txt"


@pytest.fixture(scope="session")
def wikitext() -> Path:
    return CORPORA / "wikitext-2-valid.txt"


#: what the session's servers put in the environment (their fixtures install it once, for every
#: later test): a test that leaves one of them changed breaks the tests after it, far from itself
SESSION_ENVIRONMENT = (
    "STORAGE_EMULATOR_HOST",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AZURE_STORAGE_CONNECTION_STRING",
    "HF_ENDPOINT",
)


@pytest.fixture(autouse=True)
def _session_environment_kept(request):
    """Fail the test that changed a variable a session fixture had set, naming it (a lazily
    started server may set one during the test: only what was set before is watched)."""
    before = {k: os.environ[k] for k in SESSION_ENVIRONMENT if k in os.environ}
    yield
    changed = sorted(k for k, v in before.items() if os.environ.get(k) != v)
    assert not changed, f"{request.node.nodeid} left the session's {', '.join(changed)} changed"
