"""Hostile mixture files and numbers (#31): a named error in bounded memory, never a value printed
whole, a duplicate key, a file that names itself, an overflowing weight or epoch, or an epoch whose
plan would outgrow memory (bounded before anything is planned)."""

from __future__ import annotations

import tracemalloc

import pytest
from synth import write_dataset

import wdsllm
from wdsllm.errors import MixtureError
from wdsllm.load.mixture import (
    MAX_EPOCH_ITEMS,
    MAX_EPOCH_TOKENS,
    MAX_FILE_BYTES,
    MAX_PHASES,
    Mixture,
    load_mixture_file,
)


def _file(tmp_path, text: str, name: str = "mix.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_aliases_that_expand_to_gigabytes_are_refused_in_bounded_memory(tmp_path):
    levels = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    text = "\n".join(levels) + "\nsources: {x: data}\nweights: {x: *a9}\n"
    assert len(text) < 1000
    tracemalloc.start()
    try:
        with pytest.raises(MixtureError, match=r"mix\.yaml: expands to more than 100000 values") as exc:
            load_mixture_file(_file(tmp_path, text))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20 and len(str(exc.value)) < 300


def test_a_value_is_never_printed_whole(tmp_path):
    text = "sources: {x: data}\nweights: {x: &w [" + ", ".join(["1"] * 5000) + "]}\nepoch_tokens: *w\n"
    with pytest.raises(
        MixtureError, match=r"epoch_tokens' must be an integer from 1 to \d+, not \[1, 1, 1, 1, \.\.\.\]"
    ) as exc:
        load_mixture_file(_file(tmp_path, text))
    assert len(str(exc.value)) < 300
    with pytest.raises(MixtureError) as exc:
        Mixture({"x": "data"}, weights={"x": "w" * 1_000_000})
    assert len(str(exc.value)) < 300


def test_a_key_given_twice_is_refused_by_line(tmp_path):
    with pytest.raises(MixtureError, match=r"mix\.yaml: not valid YAML at line 1, column \d+: key 'a' is given twice"):
        load_mixture_file(_file(tmp_path, "sources: {a: x, a: y}\n"))
    with pytest.raises(MixtureError, match=r"line 3.*key 'sources' is given twice"):
        load_mixture_file(_file(tmp_path, "sources: {a: x}\nweights: {a: 1}\nsources: {a: y}\n"))


def test_a_file_that_names_itself_or_another_mixture_is_refused_by_name(tmp_path):
    with pytest.raises(MixtureError, match=r"mix\.yaml: key 'sources\.me' names this mixture file itself"):
        load_mixture_file(_file(tmp_path, "sources: {me: mix.yaml, b: data}\n"))
    _file(tmp_path, "sources: {back: outer.yaml}\n", "inner.yaml")
    with pytest.raises(MixtureError, match=r"key 'sources\.in' names a mixture .*inner\.yaml.*do not nest"):
        load_mixture_file(_file(tmp_path, "sources: {in: inner.yaml}\n", "outer.yaml"))


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"a": 1e308, "b": 1e308}, r"weights\.a' must be a number from 0 to 1e\+18, not 1e\+308"),
        ({"a": 10**400, "b": 1}, r"weights\.a' must be a number from 0 to 1e\+18, not 1000000"),
        ({"a": float("nan"), "b": 1}, r"weights\.a' must be a number"),
        ({"a": -1, "b": 1}, r"weights\.a' must be a number"),
    ],
)
def test_weights_are_bounded_before_use(weights, message):
    with pytest.raises(MixtureError, match=message) as exc:
        Mixture({"a": "x", "b": "y"}, weights=weights)
    assert len(str(exc.value)) < 300


def test_large_but_sane_weights_still_normalise():
    assert Mixture({"a": "x", "b": "y"}, weights={"a": 9e17, "b": 3e17}).base_weights == (0.75, 0.25)


def test_epochs_and_schedule_positions_are_bounded(tmp_path):
    with pytest.raises(MixtureError, match=r"epoch_items' must be an integer from 1 to 1099511627776"):
        Mixture({"a": "x"}, unit="items", epoch_items=10**20)
    with pytest.raises(MixtureError, match=r"epoch_tokens' must be an integer from 1 to"):
        load_mixture_file(_file(tmp_path, f"sources: {{a: x}}\nepoch_tokens: {10**400}\n"))
    schedule = [{"at_tokens": 10**30, "weights": {"a": 1}}]
    with pytest.raises(MixtureError, match=r"schedule\[0\]\.at_tokens' must be an integer from 0 to"):
        Mixture({"a": "x"}, schedule=schedule)


def test_a_huge_file_is_not_read_whole(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("sources: {a: x}\n#" + "x" * (MAX_FILE_BYTES + 10) + "\n")
    with pytest.raises(MixtureError, match=rf"big\.yaml: more than {MAX_FILE_BYTES} bytes"):
        load_mixture_file(str(path))


# ----------------------------------------------------------------------------------------------
# The plan's allocations, bounded before use


@pytest.fixture(scope="module")
def small_sources(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("hostile-plan")
    write_dataset(d / "a", [100], seed=1)
    write_dataset(d / "b", [100], seed=2)
    return {"a": str(d / "a"), "b": str(d / "b")}


@pytest.mark.parametrize(
    "body, message",
    [
        (f"unit: items\nepoch_items: {MAX_EPOCH_ITEMS}\n", r"key 'epoch_items': an epoch of 1,099,511,627,776 items"),
        (f"epoch_tokens: {MAX_EPOCH_TOKENS}\n", r"key 'epoch_tokens': an epoch of 72,057,594,037,927,936 tokens"),
        (
            "unit: items\nepoch_items: 20000000\nweights: {a: 1, b: 0}\n"
            "schedule: [{at_items: 5, weights: {a: 0, b: 1}}]\n",
            r"can take source 'a' \(100 items\) about 200,000 times over",
        ),
    ],
)
def test_an_epoch_far_larger_than_its_sources_is_refused_before_planning(small_sources, tmp_path, body, message):
    """An epoch of 2^40 items over sources of 100 would plan (and walk) 10^10 passes."""
    text = f"sources: {{a: {small_sources['a']}, b: {small_sources['b']}}}\n" + body
    wdsllm.loader(Mixture(small_sources), batch_size=8, num_workers=0).close()  # imports made outside the count
    tracemalloc.start()
    try:
        with pytest.raises(MixtureError, match=message) as exc:
            wdsllm.loader(_file(tmp_path, text), batch_size=8, num_workers=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "mix.yaml" in str(exc.value) and peak < 256 << 20  # a sane file's peak is 64 MiB (a read buffer)


def test_more_shuffle_blocks_than_a_plan_holds_are_refused(small_sources, tmp_path):
    mix = Mixture(small_sources, unit="items", epoch_items=6_000_000)
    with pytest.raises(MixtureError, match=r"shuffle blocks of 2 .* larger shuffle_buffer"):
        wdsllm.loader(mix, batch_size=8, num_workers=0, shuffle_buffer=2)
    wdsllm.loader(mix, batch_size=8, num_workers=0).close()  # the default shuffle block plans it


def test_a_schedule_of_too_many_phases_is_refused():
    schedule = [{"at_tokens": i, "weights": {"a": 1}} for i in range(MAX_PHASES + 1)]
    with pytest.raises(MixtureError, match=rf"key 'schedule' has 1,025 phases; at most {MAX_PHASES}"):
        Mixture({"a": "x"}, schedule=schedule)
