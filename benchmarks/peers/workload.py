"""The matched workload of the peer benchmark: one set of id arrays for every framework.

Stdlib + NumPy only: every framework's worker imports it from its own
virtualenv. `generate` draws the ids once and saves them as .npy files;
each worker `load`s the same files.

Per variant (`single`: one id per feature and row; `multi`: 1-5 ids,
uniform), `DIR/<variant>/`:

* `ids.npy`: int64 `[rows, features, max_ids]`, padded with -1 (ids are in
  `[0, vocab)`, so -1 never is an id).
* `labels.npy`: float32 `[rows]`, a label the ids partly predict.
* `meta.json`: the sizes, and `distinct_keys`: distinct ids per feature over
  all rows (what a dynamic table holds after one pass).

Ids: Zipf(`zipf_a`) ranks folded into `[0, vocab)` (`rank mod vocab`), then
mapped through a fixed random permutation of `[0, vocab)` shifted per
feature, so hot ids are scattered over the table and differ by feature.
"""

import json
import os

import numpy as np

# The optimizer every framework uses on tables and the dense layer: Adagrad,
# lr `learning_rate`, accumulators starting at `adagrad_initial_accumulator`,
# update `lr * g / (sqrt(acc) + adagrad_epsilon)` (fbgemm's EXACT_ADAGRAD,
# torch, TF's ApplyAdagradV2); Keras's form `lr * g / sqrt(acc + eps)` gets
# `eps = adagrad_epsilon**2`, the same update to float32 precision. Rows and
# the dense kernel start Uniform(-init_range, init_range) / Glorot uniform.
OPTIMIZER = {"learning_rate": 0.05, "adagrad_initial_accumulator": 0.0,
             "adagrad_epsilon": 1e-8, "init_range": 0.05}
FULL = {"features": 26, "dim": 16, "batch": 4096, "vocab": 1_000_000, "zipf_a": 1.1,
        "batches": 8, **OPTIMIZER}
QUICK = {"features": 4, "dim": 8, "batch": 256, "vocab": 10_000, "zipf_a": 1.1,
         "batches": 3, **OPTIMIZER}
MAX_IDS = {"single": 1, "multi": 5}
VARIANTS = tuple(MAX_IDS)


def generate(out_dir, config, seed=0):
    """Draws and saves both variants under `out_dir`; returns their metas.
    Existing files with the same meta are kept (generation is deterministic)."""
    metas = {}
    for variant in VARIANTS:
        d = os.path.join(out_dir, variant)
        meta_path = os.path.join(d, "meta.json")
        want = dict(config, variant=variant, max_ids=MAX_IDS[variant], seed=seed)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            if {k: meta.get(k) for k in want} == want:
                metas[variant] = meta
                continue
        os.makedirs(d, exist_ok=True)
        rng = np.random.default_rng([seed, MAX_IDS[variant]])
        rows = config["batch"] * config["batches"]
        feats, vocab, max_ids = config["features"], config["vocab"], MAX_IDS[variant]
        perm = rng.permutation(vocab).astype(np.int64)
        ids = np.full((rows, feats, max_ids), -1, np.int64)
        lengths = rng.integers(1, max_ids + 1, (rows, feats)) if max_ids > 1 else \
            np.ones((rows, feats), np.int64)
        distinct = []
        for f in range(feats):
            n = int(lengths[:, f].sum())
            ranks = (rng.zipf(config["zipf_a"], n) - 1) % vocab
            values = (perm[ranks] + f * 7919) % vocab
            mask = np.arange(max_ids)[None, :] < lengths[:, f:f + 1]
            ids[:, f, :][mask] = values
            distinct.append(int(np.unique(values).size))
        # Label: parity of the hottest feature's first id, 10% flipped.
        labels = ((ids[:, 0, 0] % 2) ^ (rng.random(rows) < 0.1)).astype(np.float32)
        np.save(os.path.join(d, "ids.npy"), ids)
        np.save(os.path.join(d, "labels.npy"), labels)
        meta = dict(want, rows=rows, ids_total=int(lengths.sum()), distinct_keys=distinct,
                    distinct_keys_total=int(sum(distinct)))
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=1)
        metas[variant] = meta
    return metas


def load(data_dir, variant):
    """(ids [rows, features, max_ids] int64, labels [rows] float32, meta)."""
    d = os.path.join(data_dir, variant)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    return np.load(os.path.join(d, "ids.npy")), np.load(os.path.join(d, "labels.npy")), meta


def batches(ids, labels, batch):
    """List of (ids [batch, features, max_ids], labels [batch]) slices."""
    return [(ids[i:i + batch], labels[i:i + batch])
            for i in range(0, len(ids) - batch + 1, batch)]
