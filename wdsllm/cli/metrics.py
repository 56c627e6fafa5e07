"""``wdsllm metrics``: a run's loader metrics (a JSONL file of ``observe.MetricsLog``), summed up
and drawn: the data wait over steps, where the workers spent their time, and a mixture's drift."""

from __future__ import annotations

import os

import click

from ..errors import WdsllmError
from .options import json_option
from .output import echo, fail, to_json

STAGE_COLORS = ("#c44e52", "#dd8452", "#937860", "#8172b3", "#da8bc3", "#4c72b0", "#55a868", "#8c8c8c")


@click.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    help="Draw the data wait, the stages and the drift to this PNG (needs matplotlib: pip install wdsllm[plot]).",
)
@json_option("Print the summary as JSON.")
def metrics(path, plot, as_json):
    """Summarise (and --plot) the loader metrics a run wrote as JSON lines.

    \b
    Examples:
      wdsllm metrics run/data.jsonl
      wdsllm metrics run/data.jsonl --plot data.png --json
    """
    from ..observe.export import read_metrics
    from ..observe.stages import STAGES

    try:
        records = read_metrics(path)
    except (WdsllmError, OSError) as exc:
        fail(exc)
    if not records:
        fail(WdsllmError(f"{path}: no metrics lines"))
    summary = _summary(records, STAGES)
    if as_json:
        echo(to_json(summary, indent=1))
    else:
        _print(summary)
    if plot:
        _plot(records, STAGES, plot, os.path.basename(path))
        if not as_json:
            echo(f"\ndrawn to {plot}")


def _summary(records: list[dict], stages: tuple[str, ...]) -> dict:
    last = records[-1]
    shares = [r["data_wait_share"] for r in records if r.get("data_wait_share") is not None]
    out = {
        "lines": len(records),
        "steps": last["step"],
        "data_wait_total_s": last.get("data_wait_total_s"),
        "data_wait_share_mean": sum(shares) / len(shares) if shares else None,
        "data_wait_share_max": max(shares) if shares else None,
        "stages_s": {s: last.get(f"stage_{s}_s") for s in stages if last.get(f"stage_{s}_s") is not None},
        "slowest_worker": last.get("slowest_worker"),
        "mix_drift_max": max((r["mix_drift_max"] for r in records if r.get("mix_drift_max") is not None), default=None),
    }
    if out["stages_s"]:
        out["slowest_stage"] = max(out["stages_s"], key=out["stages_s"].get)
    return out


def _print(summary: dict) -> None:
    echo(f"{summary['lines']} lines, up to step {summary['steps']}")
    if summary["data_wait_share_mean"] is not None:
        echo(
            f"data wait: {summary['data_wait_share_mean']:.1%} of step time on average, "
            f"{summary['data_wait_share_max']:.1%} at most; {summary['data_wait_total_s'] or 0:.1f} s in all"
        )
    if summary["stages_s"]:
        parts = ", ".join(f"{s} {v:.1f} s" for s, v in summary["stages_s"].items() if v)
        echo(f"stages: {parts}; slowest: {summary['slowest_stage']}")
    if summary["slowest_worker"] is not None:
        echo(f"slowest worker: {int(summary['slowest_worker'])}")
    if summary["mix_drift_max"] is not None:
        echo(f"largest mixture drift over a window: {summary['mix_drift_max']:.4f}")


def _plot(records: list[dict], stages: tuple[str, ...], path: str, title: str) -> None:
    """Three panels in the style of ``wdsllm stats --plot``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install wdsllm[plot]") from None
    steps = [r["step"] for r in records]
    fig, (wait, parts, drift) = plt.subplots(3, 1, figsize=(7, 8), dpi=110)
    wait.plot(steps, [(r.get("data_wait_s") or 0) * 1e3 for r in records], color="#4c72b0", lw=0.8, label="step")
    wait.plot(steps, [(r.get("data_wait_p95_s") or 0) * 1e3 for r in records], color="#c44e52", lw=0.8, label="p95")
    wait.set_ylabel("data wait (ms)")
    share = wait.twinx()
    share.plot(steps, [r.get("data_wait_share") or 0 for r in records], color="k", lw=0.6, ls=":", label="share")
    share.set_ylim(0, 1)
    share.set_ylabel("share of step time (dotted)")
    wait.legend(loc="upper left", fontsize=7)
    wait.set_title(f"Data wait: {title}", fontsize=9)
    seconds = [[r.get(f"stage_{s}_s") or 0 for r in records] for s in stages]
    parts.stackplot(steps, seconds, labels=stages, colors=STAGE_COLORS[: len(stages)])
    parts.set_ylabel("stage seconds (cumulative)")
    parts.legend(loc="upper left", fontsize=7, ncol=4)
    drifts = [r.get("mix_drift_max") for r in records]
    if any(d is not None for d in drifts):
        drift.plot(steps, [d or 0 for d in drifts], color="#55a868", lw=0.8)
        drift.set_ylabel("largest source drift (share)")
    else:
        drift.text(0.5, 0.5, "no mixture", ha="center", va="center", transform=drift.transAxes)
    drift.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
