"""``wdsllm explain``: which documents step N holds on rank r, from the plan, without a model."""

from __future__ import annotations

import dataclasses
import json

import click

from ..errors import ConfigError, WdsllmError
from .options import COUNT, json_option
from .output import echo, fail, to_json

#: a state file is two short strings; anything far larger is not one
MAX_STATE_BYTES = 64 << 20


def _option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"--option {text!r}: write it as name=value (a loader option, as in docs/loader.md)")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value  # a word: "pack", "split"


@click.command()
@click.argument("source")
@click.option("--step", type=COUNT, required=True, help="The step (0-based) of the pass, or after --state.")
@click.option("--rank", type=COUNT, default=0, show_default=True)
@click.option("--world-size", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--num-workers", type=COUNT, default=0, show_default=True, help="As in the run.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--epoch", type=COUNT, help="The epoch (set_epoch); default: the first, or the state's.")
@click.option("--state", type=click.Path(exists=True, dir_okay=False), help="A loader state_dict() saved as JSON.")
@click.option("--option", "options", multiple=True, help="Any other loader option as name=value (repeatable).")
@json_option("Print the documents as a JSON list.")
def explain(source, step, rank, world_size, num_workers, seed, epoch, state, options, as_json):
    """Print the documents of step N on rank r: source, shard, ordinal, piece and tokens.

    The loader's own stages make the batch again in this process, from the epoch's start or from
    a saved state (step 0 is then the first batch after it), with the run's settings: the same
    plan gives the same documents. Reading up to the step costs reading those batches, so start
    from the checkpoint before it.

    \b
    Examples:
      wdsllm explain out/wiki --step 1200 --rank 3 --world-size 8 --num-workers 4 --option batch_size=16
      wdsllm explain mix.yaml --state ckpt/loader_rank3.json --step 17 --rank 3 --world-size 8 --json
    """
    from ..observe.explain import explain_step

    try:
        kw = dict(_option(text) for text in options)
        kw.update(rank=rank, world_size=world_size, num_workers=num_workers, seed=seed)
        loaded = None
        if state is not None:
            with open(state, "rb") as f:
                data = f.read(MAX_STATE_BYTES + 1)
            if len(data) > MAX_STATE_BYTES:
                raise ConfigError(f"{state}: larger than {MAX_STATE_BYTES:,} bytes, not a loader state")
            loaded = json.loads(data)
        docs = explain_step(source, step, state=loaded, epoch=epoch, **kw)
    except (WdsllmError, OSError, ValueError) as exc:
        fail(exc)
    if as_json:
        echo(to_json([dataclasses.asdict(d) for d in docs], indent=1))
        return
    echo("row  source  shard  ordinal  piece  tokens  url")
    for d in docs:
        tokens = "" if d.tokens is None else f"{d.tokens[0]}-{d.tokens[1]}"
        echo(f"{d.row:>3}  {d.source or '-'}  {d.shard:>5}  {d.ordinal:>7}  {d.piece:>5}  {tokens:>6}  {d.url}")
