"""The runs a torchrun script's command line names, separated by ``--then``: one launch (one start
of the processes, each importing torch) checks several things, one run after the other."""


def split_runs(argv: list[str]) -> list[list[str]]:
    """``a --then b c`` -> ``[[a], [b, c]]``; without ``--then``, the one run."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs
