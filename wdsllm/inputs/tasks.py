"""Dividing the work of a pack between tasks (``--num-tasks``/``--task-index``) by input bytes.

The inputs, in order, are one sequence of ``T`` bytes; task ``t`` of ``K`` takes the units that
start in bytes ``[T*t//K, T*(t+1)//K)`` of it. A unit is a line of an uncompressed text file (a
part takes the lines that start in its byte range), a row group of a Parquet file, a record batch
of an Arrow file, or a whole file for everything that must be read from its start (compressed
streams, `--split paragraph`/`file`, tars, Arrow streams); a whole file goes to the task that
holds its middle byte. So 8 tasks over 3 large files share the work evenly, and the tasks' outputs,
in task order, hold the documents in the order a single-task pack writes them (which is what
makes ``wdsllm merge`` equal to a single-task pack up to shard boundaries).

The split depends only on the input list, the file sizes and the files' own metadata (Parquet
footers), so every task computes the same one without talking to the others; only the files
that straddle a task boundary are opened to plan it.
"""

from __future__ import annotations

from .registry import reader_for
from .sources import InputFile, ParseOptions, Part


def _owner(x: int, total: int, tasks: int) -> int:
    """The task whose byte range holds byte ``x`` of the whole input."""
    if total <= 0:
        return 0
    t = min(tasks - 1, x * tasks // total)
    while t + 1 < tasks and total * (t + 1) // tasks <= x:
        t += 1
    while t > 0 and total * t // tasks > x:
        t -= 1
    return t


def _split_file(inp: InputFile, g: int, total: int, tasks: int, opts: ParseOptions) -> dict[int, Part]:
    """Task -> its part of one input that straddles a task boundary."""
    units = reader_for(inp.kind).units(inp, opts)
    if units is None or units.starts == []:
        return {_owner(g + inp.size // 2, total, tasks): Part(inp, size=inp.size)}
    parts: dict[int, Part] = {}
    if units.starts is None:  # bytes: each task's range, clipped to the file
        first, last = _owner(g, total, tasks), _owner(g + inp.size - 1, total, tasks)
        for t in range(first, last + 1):
            lo = max(total * t // tasks - g, 0)
            hi = min(total * (t + 1) // tasks - g, inp.size)
            if hi > lo:
                parts[t] = Part(inp, units.name, lo, hi, hi - lo)
        return parts
    owners = [_owner(g + start, total, tasks) for start in units.starts]
    bounds = [*units.starts[1:], inp.size]
    for t in sorted(set(owners)):
        members = [j for j, o in enumerate(owners) if o == t]
        lo, hi = members[0], members[-1] + 1
        parts[t] = Part(inp, units.name, lo, hi, max(0, bounds[hi - 1] - units.starts[lo]))
    return parts


def assign_tasks(inputs: list[InputFile], num_tasks: int, opts: ParseOptions | None = None) -> list[list[Part]]:
    """Every task's parts of the inputs, each list in input order."""
    opts = opts or ParseOptions()
    parts: list[list[Part]] = [[] for _ in range(num_tasks)]
    total = sum(i.size for i in inputs)
    g = 0
    for inp in inputs:
        first = _owner(g, total, num_tasks)
        last = _owner(g + max(inp.size - 1, 0), total, num_tasks)
        if first == last or num_tasks == 1:
            parts[first if num_tasks > 1 else 0].append(Part(inp, size=inp.size))
        else:
            for t, part in _split_file(inp, g, total, num_tasks, opts).items():
                parts[t].append(part)
        g += inp.size
    return parts
