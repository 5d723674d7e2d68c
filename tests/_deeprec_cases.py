"""DeepRec's optimizer cases shared by the TensorFlow tests
(tests/test_deeprec_parity.py, tests/optimizers/test_deeprec_optimizers.py)
and tests/test_deeprec_training.py (both backends): DeepRec's
inputs and expected numbers, and the NumPy references. No TensorFlow here:
the JAX child imports it."""

import numpy as np

# -- DeepRec's test graph: emb = lookup(ids); loss = sum(emb * 2) ----------------

# embedding_variable_ops_test.py: testEmbeddingVariableForAdagradDecayV2
# (AdagradDecayOptimizerV2(0.1, gs, accumulator_decay_step=2), ones
# initializer, dim 3): the loss of each of five runs.
ADAGRAD_DECAY_IDS = [0, 1, 2, 5, 6, 7]
ADAGRAD_DECAY_LOSSES = [36.0, 32.444176, 29.847788, 27.74195, 25.852505]


def deeprec_adagrad_decay_expected(grad, init, rate, steps, start, decay_at=2):
    """adagrad_decay_test.py's own expectation loop (lr = 1.0): the value and
    accumulator of an element after `steps` updates by `grad`."""
    v, acc = start, init
    for step in range(steps):
        if step == decay_at:
            acc = max(acc * rate, init)
        acc = acc + grad * grad
        v = v - 1.0 / np.sqrt(acc) * grad
    return v, acc


# embedding_variable_ops_test.py: testEmbeddingVariableForL2FeatureEviction
# (Ftrl(0.1, l1=2.0, l2=1e-5), L2WeightEvict(0.9), ids [0,0,0,1,1,2], one
# step, save (evicts), restore, read): key 2 evicted reads the initializer.
FTRL_EVICT_IDS = [0, 0, 0, 1, 1, 2]
FTRL_EVICT_ROWS = [[0.8282884] * 3] * 3 + [[0.7927219] * 3] * 2 + [[1.0] * 3]


def ftrl_element_wise_one_step(g, var=1.0, acc=0.1, lr=0.1, l1=2.0, l2=1e-5):
    """Keras's element-wise FTRL for one element after one gradient `g`
    (keras/src/optimizers/ftrl.py, written out)."""
    new_acc = acc + g * g
    lin = g - (np.sqrt(new_acc) - np.sqrt(acc)) / lr * var
    quad = np.sqrt(new_acc) / lr + 2 * l2
    return (np.clip(lin, -l1, l1) - lin) / quad


# embedding_variable_ops_test.py: _RecordFreqTestTemplate (TF_RECORD_FREQ=1,
# ids [1,1,1,2,2,3], two runs of lookup + train op).
RECORD_FREQ_IDS = [1, 1, 1, 2, 2, 3]
RECORD_FREQ_EXPECTED = {1: 6, 2: 4, 3: 2}

# weight_decay_optimizers_test.py: AdamWOptimizerTest (testBasic, testSparse):
# two variables, their starts and the gradient of each of three steps.
WEIGHT_DECAY = 0.01
ADAMW_STARTS = ([1.0, 2.0], [3.0, 4.0])
ADAMW_GRADS = ([0.1, 0.1], [0.01, 0.01])


def adamw_update_numpy(param, g_t, t, m, v, lr=0.001, beta1=0.9, beta2=0.999,
                       epsilon=1e-8, scaled=False):
    # weight_decay_optimizers_test.py's adamw_update_numpy (scaled=False).
    lr_t = lr * np.sqrt(1 - beta2**t) / (1 - beta1**t)
    m_t = beta1 * m + (1 - beta1) * g_t
    v_t = beta2 * v + (1 - beta2) * g_t * g_t
    decay = param * WEIGHT_DECAY * (lr if scaled else 1.0)
    return param - lr_t * m_t / (np.sqrt(v_t) + epsilon) - decay, m_t, v_t


# -- Step-by-step NumPy references (AdamAsync, AdagradDecay, AdamW) ----------------
# 25 steps of given gradients on a dense variable `w`, a dense embedding
# matrix `e` read through ids (repeats; some rows idle) and a table whose
# keys first appear at different steps.

DIM, VOCAB, DVD, STEPS = 3, 10, 5, 25
OFFSET = 10**12
rng = np.random.default_rng(5)
W0 = rng.normal(size=(4, DIM)).astype(np.float32)
E0 = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
T0 = rng.normal(size=(DVD, DIM)).astype(np.float32)  # EV-initializer rows


def make_gradients():
    steps = []
    for t in range(STEPS):
        gw = rng.normal(size=(4, DIM)).astype(np.float32)
        e_idx = rng.integers(0, VOCAB // 2 + t % 5, size=6)        # repeats; some rows idle
        e_val = rng.normal(size=(6, DIM)).astype(np.float32)
        known = t // 4 + 2                                          # new keys over time
        t_keys = rng.integers(0, known, size=5) * OFFSET + 7
        t_val = rng.normal(size=(5, DIM)).astype(np.float32)
        steps.append((gw, e_idx, e_val, t_keys, t_val))
    return steps


GRADS = make_gradients()


def sum_rows(idx, val):
    rows = np.unique(idx)
    return rows, np.stack([val[idx == r].sum(axis=0) for r in rows]).astype(np.float64)


def default_row(key):
    return T0[key % DVD].astype(np.float64)


def ref_adam_async(lr=0.05, b1=0.9, b2=0.99, eps=1e-7, nesterov=False, rmsprop=False):
    def step_rows(var, m, v, p1, p2, g):
        """Adam with given powers on rows; returns new (var, m, v)."""
        alpha = lr * np.sqrt(1 - p2) / (1 - p1)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        s = (1 - b1) * g + b1 * m if nesterov else m
        return var - s * alpha / (np.sqrt(v) + eps), m, v

    def rms_rows(var, m, v, g):
        v = b2 * v + (1 - b2) * g * g
        m = b1 * m + lr * g / np.sqrt(v + eps)
        return var - m, m, v

    w, e = W0.astype(np.float64), E0.astype(np.float64)
    wm, wv, wp = np.zeros_like(w), np.zeros_like(w), [b1, b2]
    em, ev_, ep = np.zeros_like(e), np.zeros_like(e), [b1, b2]
    table = {}  # key -> [row, m, v, p1, p2]
    for gw, e_idx, e_val, t_keys, t_val in GRADS:
        w, wm, wv = step_rows(w, wm, wv, wp[0], wp[1], gw)
        wp = [wp[0] * b1, wp[1] * b2]
        rows, g = sum_rows(e_idx, e_val)
        if rmsprop:
            e[rows], em[rows], ev_[rows] = rms_rows(e[rows], em[rows], ev_[rows], g)
        else:
            e[rows], em[rows], ev_[rows] = step_rows(e[rows], em[rows], ev_[rows], ep[0], ep[1], g)
            ep = [ep[0] * b1, ep[1] * b2]
        keys, g = sum_rows(t_keys, t_val)
        for k, gk in zip(keys, g):
            r = table.setdefault(int(k), [default_row(k), np.zeros(DIM), np.zeros(DIM), b1, b2])
            if rmsprop:
                r[0], r[1], r[2] = rms_rows(r[0], r[1], r[2], gk)
            else:
                r[0], r[1], r[2] = step_rows(r[0], r[1], r[2], r[3], r[4], gk)
                r[3], r[4] = r[3] * b1, r[4] * b2
    return w, e, {k: r[0] for k, r in table.items()}


def ref_adagrad_decay(lr=0.3, init=0.1, period_len=3, rate=0.5, eps=1e-7):
    """DeepRec's rule (training_ali_ops.cc, *ApplyAdagradDecay): period =
    (step + 1) // period_len; a row (the dense variable as a whole for a
    dense gradient) whose decay count is below it decays once, floored at
    init, and its count grows by one."""
    w, e = W0.astype(np.float64), E0.astype(np.float64)
    wa, ea = np.full_like(w, init), np.full_like(e, init)
    w_count, e_count = 0, np.zeros(len(e))
    table, tacc, tcount = {}, {}, {}
    for t, (gw, e_idx, e_val, t_keys, t_val) in enumerate(GRADS):
        period = (t + 1) // period_len
        if period > w_count:
            wa, w_count = np.maximum(wa * rate, init), w_count + 1
        wa += gw * gw
        w -= lr * gw / np.sqrt(wa + eps)
        rows, g = sum_rows(e_idx, e_val)
        for r, gr in zip(rows, g):
            if period > e_count[r]:
                ea[r], e_count[r] = np.maximum(ea[r] * rate, init), e_count[r] + 1
            ea[r] += gr * gr
            e[r] -= lr * gr / np.sqrt(ea[r] + eps)
        keys, g = sum_rows(t_keys, t_val)
        for k, gk in zip(keys, g):
            k = int(k)
            table.setdefault(k, default_row(k))
            tacc.setdefault(k, np.full(DIM, init))
            tcount.setdefault(k, 0)
            if period > tcount[k]:
                tacc[k], tcount[k] = np.maximum(tacc[k] * rate, init), tcount[k] + 1
            tacc[k] += gk * gk
            table[k] = table[k] - lr * gk / np.sqrt(tacc[k] + eps)
    return w, e, table


def ref_adamw(wd=0.05, lr=0.02, b1=0.9, b2=0.999, eps=1e-7):
    """Decay (whole dense variable; touched rows for sparse), then Keras's
    Adam: global-step bias correction; dense m/v for dense variables (zero
    gradient for untouched Embedding rows), lazy rows for the table."""
    w, e = W0.astype(np.float64), E0.astype(np.float64)
    wm, wv, em, ev_ = (np.zeros_like(w), np.zeros_like(w), np.zeros_like(e), np.zeros_like(e))
    table = {}
    for t, (gw, e_idx, e_val, t_keys, t_val) in enumerate(GRADS):
        alpha = lr * np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))

        def adam(var, m, v, g):
            m = m + (g - m) * (1 - b1)
            v = v + (g * g - v) * (1 - b2)
            return var - m * alpha / (np.sqrt(v) + eps), m, v

        w = w - w * wd * lr
        w, wm, wv = adam(w, wm, wv, gw)
        rows, g = sum_rows(e_idx, e_val)
        e[rows] -= e[rows] * wd * lr
        dense_g = np.zeros_like(e)
        dense_g[rows] = g
        e, em, ev_ = adam(e, em, ev_, dense_g)
        keys, g = sum_rows(t_keys, t_val)
        for k, gk in zip(keys, g):
            r = table.setdefault(int(k), [default_row(k), np.zeros(DIM), np.zeros(DIM)])
            r[0] = r[0] - r[0] * wd * lr
            r[0], r[1], r[2] = adam(r[0], r[1], r[2], gk)
    return w, e, {k: r[0] for k, r in table.items()}


# (optimizer class name, its arguments, the reference, the reference's arguments)
CASES = [
    ("AdamAsync", dict(learning_rate=0.05, beta_2=0.99, epsilon=1e-7), ref_adam_async, {}),
    ("AdamAsync", dict(learning_rate=0.05, beta_2=0.99, epsilon=1e-7, use_nesterov=True),
     ref_adam_async, dict(nesterov=True)),
    ("AdamAsync", dict(learning_rate=0.05, beta_2=0.99, epsilon=1e-7, apply_sparse_rmsprop=True),
     ref_adam_async, dict(rmsprop=True)),
    ("AdagradDecay", dict(learning_rate=0.3, accumulator_decay_step=3, accumulator_decay_rate=0.5),
     ref_adagrad_decay, {}),
    ("AdamW", dict(weight_decay=0.05, learning_rate=0.02, epsilon=1e-7), ref_adamw, {}),
]
CASE_IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


# -- AdagradDecay: an idle row decays once when next updated --------------------
# KvSparseApplyAdagradDecay: accum_decay_power += 1 per update, however many
# periods the row missed. AdagradDecay(0.1, initial_accumulator_value=0.1,
# accumulator_decay_step=2, accumulator_decay_rate=0.5), a gradient of 3.0
# per element at each of 9 steps on the key IDLE_ROW_KEY(step): key 5 at
# steps 0 and 8 (period 4 > its count 0 at step 8: one decay, not four).
def idle_row_key(step):
    return 5 if step in (0, 8) else 6


IDLE_ROW_ACCUMULATOR = max((0.1 + 9.0) * 0.5, 0.1) + 9.0
