"""``wdsllm stats``: the length histogram, and the padding each batching mode would give."""

from __future__ import annotations

import click

from ..errors import WdsllmError
from .inspect import histogram_lines
from .options import COUNT, POSITIVE, json_option
from .output import echo, fail, to_json


@click.command()
@click.argument("dataset")
@click.option(
    "--batch-size", type=POSITIVE, default=32, show_default=True, help="Documents per batch (random and bucket)."
)
@click.option(
    "--max-tokens",
    type=POSITIVE,
    default=65536,
    show_default=True,
    help="Padded tokens per batch (bucket with a token budget).",
)
@click.option(
    "--seq-len",
    type=POSITIVE,
    default=2048,
    show_default=True,
    help="Row length (pack, concat) and the length cap of the other modes.",
)
@click.option("--window", type=POSITIVE, default=10_000, show_default=True, help="Documents per bucket/pack window.")
@click.option("--pad-to-multiple-of", type=POSITIVE, help="Round padded lengths up.")
@click.option("--seed", type=COUNT, default=0, show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Also draw the length histogram to this PNG (needs matplotlib: pip install wdsllm[plot]).",
)
@click.option(
    "--sample",
    type=COUNT,
    default=None,
    help="Runs of windows to simulate (0: the whole stream) [default: the whole stream up to 5,000,000 "
    "documents, else 400 runs].",
)
@click.option(
    "--schedule",
    help="A batch-size schedule as JSON (as BatchOptions.schedule): steps per epoch under it, e.g. "
    "'{\"batch_size\": [[0, 32], [1000, 64]]}'.",
)
@click.option(
    "--state",
    type=click.Path(exists=True, dir_okay=False),
    help="A loader state_dict() saved as JSON: its epoch, the weights and exclusions the run took (steering.md).",
)
@json_option("Print the figures as JSON.")
def stats(
    dataset, batch_size, max_tokens, seq_len, window, pad_to_multiple_of, seed, plot, sample, schedule, state, as_json
):
    """Length histogram, and the padding and truncation each batching mode would give.

    Simulated from the index and lengths.npy over the documents one worker sees in epoch 0 (the
    shard plan and the shuffle buffer included); no shard is read. DATASET may be a mixture file
    (.yaml): each source's size, quota and repeats or subset come first, and --plot draws the
    planned share of each source over the run, schedule included. Longer documents are split at
    --seq-len, except in the "random, truncated" line, which shows what capping would cut. A large
    dataset is simulated on a seeded sample of its windows (it says so, with confidence bounds).
    Packed data (a dataset, or a mixture of packed datasets) has its rows fixed: stats shows its
    rows, the padding of each source's short last rows, and how many documents run on from one
    row into the next (cut).

    \b
    Examples:
      wdsllm stats out/wiki --max-tokens 65536 --seq-len 2048
      wdsllm stats out/wiki --plot hist.png --json
      wdsllm stats mix.yaml --plot shares.png
    """
    from ..load import stats as statsmod
    from ..load.sources.open import open_source

    costs, sample, packed, steered = [], None, None, None
    try:
        source = open_source(dataset)
        steered = _steered(source, state)
        if source.index is None:
            raise click.ClickException(f"{dataset}: stats need a dataset with index.json and lengths.npy")
        if source.mode == "docs":
            costs, sample = statsmod.all_modes(
                source,
                batch_size=batch_size,
                max_tokens=max_tokens,
                seq_len=seq_len,
                window=window,
                multiple=pad_to_multiple_of,
                seed=seed,
                sample=sample,
            )
        else:
            packed = _packed_rows(source, dataset)
        mix = _mixture(source, steered["epoch"] if steered else 0)
        if schedule:
            _schedule_steps(costs, schedule, batch_size, max_tokens, seq_len)
    except (WdsllmError, OSError, ValueError) as exc:  # storage/format errors name the file
        fail(exc)
    hist = source.index.doc_lengths or {}
    if as_json:
        echo(to_json({**_stats_json(hist, costs, sample, mix, packed), "steering": steered}, indent=1))
    else:
        if steered:
            echo(_steering_lines(steered))
        _print_stats(hist, costs, sample, mix, source, packed)
    if plot:
        if mix is not None:
            _plot_shares(source, plot, dataset)
        else:
            _plot_histogram(hist, plot, dataset)
        if not as_json:
            echo(f"\n{'planned shares' if mix is not None else 'histogram'} drawn to {plot}")


def _mixture(source, epoch: int = 0) -> list[dict] | None:
    """Each source's size and ``epoch``'s quota, for a mixture; None for a single dataset."""
    if source.mixing is None:
        return None
    from ..load.mixstats import mixture_summary

    return mixture_summary(source, epoch)


def _steered(source, state: str | None) -> dict | None:
    """What a saved state says the run changed while it trained, applied to ``source``'s plans."""
    if state is None:
        return None
    import json

    from ..errors import StateError
    from ..load.state import LoaderState
    from ..load.steer.plans import steer_plans

    with open(state, "rb") as f:
        data = f.read(64 << 20)
    try:
        st = LoaderState.load(json.loads(data))
    except ValueError as exc:
        raise StateError(f"{state}: not a loader state ({exc})") from None
    if st.steering is None:
        return {"epoch": st.epoch, "planned_step": None, "changes": []}
    if source.mixing is not None:
        source.mix_planner()
        steer_plans(st.steering.log, source)
    changes = [c.to_json() for c in st.steering.log.changes]
    pending = [c.to_json() for c in st.steering.pending]
    out = {"epoch": st.epoch, "planned_step": st.steering.planned, "skipped": st.steering.skipped}
    return {**out, "changes": changes, "pending": pending}


def _steering_lines(steered: dict) -> str:
    lines = [f"state: epoch {steered['epoch']}, planned step {steered['planned_step']}"]
    for change in steered["changes"]:
        what = {k: v for k, v in change.items() if k not in ("kind", "at")}
        lines.append(f"  from planned step {change['at']}: {change['kind']} {what}")
    for change in steered.get("pending", []):
        what = {k: v for k, v in change.items() if k not in ("kind", "at", "epoch", "point")}
        lines.append(f"  pending, from planned step {change['at']}: {change['kind']} {what}")
    return "\n".join(lines) + "\n"


def _schedule_steps(costs, text: str, batch_size: int, max_tokens: int, seq_len: int) -> None:
    """Each mode's steps per epoch under a schedule (its batches taken several to a step)."""
    import json

    from ..load.steer.schedule import Schedule, resolve

    schedule = Schedule.from_json(json.loads(text))
    for c in costs:
        budget = c.mode.startswith("bucket") and "budget" in c.settings
        if (schedule.name == "max_tokens") != budget:
            continue
        base = max_tokens if budget else batch_size
        per_item = 1 if schedule.unit != "tokens" else (1 if budget else seq_len)
        c.steps = resolve(schedule, base, base * per_item if schedule.unit != "steps" else 1).steps_for(0, c.batches)


def _packed_rows(source, name: str) -> list:
    """What the rows of packed data hold, per source of a mixture."""
    from ..load.stats import packed_rows

    if source.mixing is None:
        return [packed_rows(name, source.index, source.lengths())]
    return [packed_rows(p.name, p.source.index, p.source.lengths()) for p in source.parts]


def _stats_json(hist: dict, costs, sample, mix, packed) -> dict:
    return {
        "doc_lengths": hist,
        "modes": [
            {
                "mode": c.mode,
                "settings": c.settings,
                "batches": c.batches,
                "tokens": c.tokens,
                "padded": c.padded,
                "padding_pct": round(c.padding_pct, 4),
                "truncated": c.truncated,
                "truncation_pct": round(c.truncation_pct, 4),
                "small_batches": c.small_batches,
                "padding_ci_pct": None if c.padding_ci is None else round(c.padding_ci, 4),
                "steps": c.steps,
            }
            for c in costs
        ],
        "sample": None if sample is None else vars(sample),
        **({"mixture": mix} if mix is not None else {}),
        **({"packed": [{**vars(r), "padding_pct": round(r.padding_pct, 4)} for r in packed]} if packed else {}),
    }


def _print_stats(hist: dict, costs, sample, mix, source, packed) -> None:
    if mix is not None:
        echo(_mixture_table(mix, source.mixture.unit))
    else:
        for text in histogram_lines(hist):
            echo(text)
    echo("")
    if packed:
        echo(_packed_table(packed))
        return
    if sample is not None:
        echo(
            f"simulated on a seeded sample: {sample.runs:,} runs of windows, {sample.documents:,} of "
            f"{sample.total_documents:,} documents; batches extrapolated, padding ± its 95% confidence bound"
        )
    scheduled = any(c.steps is not None for c in costs)
    steps_head = f" {'steps':>11}" if scheduled else ""
    echo(f"{'mode':<20} {'settings':<30} {'batches':>11}{steps_head} {'padding':>16} {'truncated':>10}")
    for c in costs:
        padding = f"{c.padding_pct:.2f}%" + (f" ± {c.padding_ci:.2f}" if c.padding_ci is not None else "")
        steps = (f" {c.steps:>11,}" if c.steps is not None else f" {'-':>11}") if scheduled else ""
        echo(f"{c.mode:<20} {c.settings:<30} {c.batches:>11,}{steps} {padding:>16} {c.truncation_pct:>9.2f}%")


def _packed_table(rows: list) -> str:
    """Packed rows are fixed: their count, the padding of each source's short last rows, and the
    documents that run on from one row into the next."""
    lines = [
        "packed rows are fixed when packed: no batching mode changes them; padding is that of the short last rows",
        f"{'source':<16} {'seq_len':>8} {'rows':>12} {'tokens':>14} {'short rows':>10} {'padding':>16} "
        f"{'documents':>12} {'cut':>12}",
    ]
    for r in rows:
        padding = f"{r.padding:,} ({r.padding_pct:.2f}%)"
        cut = "-" if r.documents_cut is None else f"{r.documents_cut:,}"
        lines.append(
            f"{r.source:<16} {r.seq_len:>8,} {r.rows:>12,} {r.tokens:>14,} {r.short_rows:>10,} {padding:>16} "
            f"{r.documents:>12,} {cut:>12}"
        )
    return "\n".join(lines)


def _mixture_table(rows: list[dict], unit: str) -> str:
    """Each source's size, its epoch quota and whether that repeats it or takes a subset."""
    lines = [f"{'source':<16} {'items':>12} {'tokens':>14} {'weight':>7} {'quota (' + unit + ')':>16} {'epoch':>16}"]
    for r in rows:
        took = f"x{r['repeats']:.2f} (repeats)" if r["repeats"] is not None else f"{100 * r['subset']:.1f}% subset"
        lines.append(
            f"{r['source']:<16} {r['items']:>12,} {r['tokens']:>14,} {r['weight']:>7.3f} {r['quota']:>16,} {took:>16}"
        )
    return "\n".join(lines)


def _plot_shares(catalog, path: str, title: str) -> None:
    """The planned share of each source over the run (schedule included), stacked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install wdsllm[plot]") from None
    from ..load.mixstats import planned_shares

    planner = catalog.planner
    last = max((p for p, _ in planner.phases()), default=0)
    epochs = min(100, max(1, -(-(last + 1) // planner.epoch) + 1 if last else 1))
    xs, shares = planned_shares(catalog, epochs)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    ax.stackplot(xs, shares.T, labels=catalog.mixture.names, step="post")
    for e in range(1, epochs):
        ax.axvline(e * planner.epoch, color="k", lw=0.5, ls=":")
    ax.set_xlabel(f"{catalog.mixture.unit} into the run (dotted: epochs)")
    ax.set_ylabel("planned share")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper right", fontsize=7)
    ax.set_title(f"Mixture: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def _plot_histogram(hist: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install wdsllm[plot]") from None
    edges, counts = hist.get("edges", []), hist.get("counts", [])
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    labels = [f"{edges[i]:,}" for i in range(len(counts))]
    ax.bar(range(len(counts)), counts, color="#4c72b0")
    ax.set_xticks(range(len(counts)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("document length in tokens (bucket start, powers of two)")
    ax.set_ylabel("documents")
    ax.set_title(f"Document lengths: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
