"""The peers' side of tools/bench_mix.py, run in the virtualenv it makes (litdata, mosaic streaming).

    BENCH_MIX_WORK=bench-out peers-venv/bin/python tools/bench_mix_peers.py '{"a": 0.5, ...}'

Reads each source's documents (peer-TAG-NAME.npz, written by bench_mix.py from our shards), writes them
in each peer's format once, and prints as JSON the largest deviation of token shares from the
weights over windows of 10 batches of 64, for litdata's ``CombinedStreamingDataset(weights=...)``
and mosaic's ``Stream(proportion=...)``. Peers weigh samples, so they get the token weights
divided by each source's mean document length (renormalised).
"""

import json
import os
import shutil
import sys

import numpy as np

WORK = os.environ.get("BENCH_MIX_WORK", "bench-out")
TAG = os.environ.get("BENCH_MIX_TAG", "full")  # which sources (--quick or not): each has its own peer files
_cache: dict = {}


def docs(name):
    if name not in _cache:
        d = np.load(os.path.join(WORK, f"peer-{TAG}-{name}.npz"))
        _cache[name] = [d[k] for k in sorted(d.files, key=int)]
    return _cache[name]


def sample(item):  # litdata's optimize runs this in spawned workers: module level, picklable
    name, source, j = item
    return {"tokens": docs(name)[j], "source": source}


def windows(per_batch, weights, window=10):
    arr = np.asarray(per_batch, np.float64)
    sums = np.cumsum(np.vstack([np.zeros(arr.shape[1]), arr]), axis=0)
    win = sums[window:] - sums[:-window]
    shares = win / win.sum(axis=1, keepdims=True)
    return float(np.abs(shares - np.asarray(weights)).max())


def batches(ds, k, batch=64, count=300):
    per_batch, cur = [], np.zeros(k)
    for i, item in enumerate(ds):
        cur[int(item["source"])] += len(item["tokens"])
        if (i + 1) % batch == 0:
            per_batch.append(cur)
            cur = np.zeros(k)
        if len(per_batch) >= count:
            break
    return per_batch


def _written(root):
    path = os.path.join(root, "index.json")
    return os.path.exists(path) and json.load(open(path)).get("chunks") != []


def main():
    weights = json.loads(sys.argv[1])
    names = list(weights)
    target = [weights[n] for n in names]
    means = {n: np.mean([len(x) for x in docs(n)]) for n in names}
    sample_w = {n: weights[n] / means[n] for n in names}
    total = sum(sample_w.values())
    sample_w = {n: v / total for n, v in sample_w.items()}
    out = {"sample_weights": sample_w}
    try:
        import litdata as ld

        roots = {}
        for i, n in enumerate(names):
            root = os.path.join(WORK, f"peer-{TAG}-litdata-{n}")
            if not _written(root):
                shutil.rmtree(root, ignore_errors=True)
                items = [(n, i, j) for j in range(len(docs(n)))]
                ld.optimize(fn=sample, inputs=items, output_dir=root, chunk_bytes="16MB", num_workers=1)
            roots[n] = root
        streams = [ld.StreamingDataset(roots[n], shuffle=True, seed=0) for n in names]
        ds = ld.CombinedStreamingDataset(streams, weights=[sample_w[n] for n in names], seed=0, iterate_over_all=False)
        out["litdata"] = windows(batches(ds, len(names)), target)
    except Exception as exc:
        out["litdata_error"] = repr(exc)[:300]
    try:
        from streaming import MDSWriter, Stream, StreamingDataset

        streams = []
        for i, n in enumerate(names):
            root = os.path.join(WORK, f"peer-{TAG}-mds-{n}")
            if not os.path.exists(os.path.join(root, "index.json")):
                shutil.rmtree(root, ignore_errors=True)
                with MDSWriter(out=root, columns={"tokens": "ndarray:int32", "source": "int"}) as w:
                    for d in docs(n):
                        w.write({"tokens": d, "source": i})
            streams.append(Stream(local=root, proportion=sample_w[n]))
        ds = StreamingDataset(streams=streams, batch_size=64, shuffle=True, shuffle_seed=0, epoch_size=300 * 64)
        out["mosaic"] = windows(batches(ds, len(names)), target)
    except Exception as exc:
        out["mosaic_error"] = repr(exc)[:300]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
