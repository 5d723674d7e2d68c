"""Peer-benchmark worker for TorchRec 1.9.2 + fbgemm-gpu-cpu 1.9.0 (`.venv-torchrec`).

`--impl`:

* `tbe`: fbgemm's `SplitTableBatchedEmbeddingBagsCodegen` over the 26
  tables (static `vocab`-row tables, `EmbeddingLocation.HOST`,
  `ComputeDevice.CPU`, sum pooling, `EXACT_ADAGRAD` fused into the
  backward, lr 0.05). Ids index rows directly (they are in `[0, vocab)`).
* `dmp`: TorchRec's `EmbeddingBagCollection` with the same tables, Adagrad
  applied in the backward (`apply_optimizer_in_backward`), wrapped in
  `DistributedModelParallel` on one gloo rank (CPU), fed
  `KeyedJaggedTensor`s.

Then `Linear(26*16, 1)` -> sigmoid BCE (`binary_cross_entropy_with_logits`),
`torch.optim.Adagrad` for the dense layer (Glorot-uniform kernel, zero bias,
as Keras's Dense); every Adagrad with the workload's `OPTIMIZER` settings. Inputs (indices/offsets or
KeyedJaggedTensors) are built once per batch before timing, as the other
workers' `tf.data` caches do. Training: a Python loop of forward, backward,
dense step. Forward lookup: the embedding module alone under
`torch.no_grad()`. Threads: `torch.set_num_threads(T)`,
`torch.set_num_interop_threads(1)`.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import protocol
import workload


def make_worker(args):
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    ids, labels, meta = workload.load(args.data, args.variant)
    return TorchWorker(args.impl, ids, labels, meta)


def jagged(batch_ids):
    """[B, F, L] padded ids -> (values, lengths) in feature-major order."""
    import numpy as np

    x = np.ascontiguousarray(batch_ids.transpose(1, 0, 2))  # [F, B, L]
    mask = x >= 0
    return x[mask], mask.sum(-1).reshape(-1)


class TorchWorker:
    def __init__(self, impl, ids, labels, meta):
        import numpy as np
        import torch

        if impl not in ("tbe", "dmp"):
            raise ValueError(f"--impl must be tbe or dmp; got {impl!r}")
        torch.manual_seed(0)
        self.torch, self.meta, self.impl = torch, meta, impl
        self.rss_before_model = protocol.rss_bytes()
        F, dim, vocab, lr = meta["features"], meta["dim"], meta["vocab"], meta["learning_rate"]
        eps, r = meta["adagrad_epsilon"], meta["init_range"]
        acc0 = meta["adagrad_initial_accumulator"]
        B = meta["batch"]
        raw = workload.batches(ids, labels, B)
        self.batches = []
        if impl == "tbe":
            from fbgemm_gpu.split_embedding_configs import EmbOptimType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
                EmbeddingLocation, PoolingMode)
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

            self.emb = SplitTableBatchedEmbeddingBagsCodegen(
                [(vocab, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * F,
                optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=lr, eps=eps,
                pooling_mode=PoolingMode.SUM)
            self.emb.init_embedding_weights_uniform(-r, r)
            with torch.no_grad():  # EXACT_ADAGRAD's accumulators start at 0
                for state in self.emb.split_optimizer_states():
                    for t in state:
                        t.fill_(acc0)
            for x, y in raw:
                values, lengths = jagged(x)
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                self.batches.append(((torch.from_numpy(values), torch.from_numpy(offsets)),
                                     torch.from_numpy(y)[:, None]))
            self.forward_emb = lambda inp: self.emb(*inp)
        else:
            import torch.distributed as dist
            from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
            from torchrec.distributed.model_parallel import DistributedModelParallel
            from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            dist.init_process_group("gloo", rank=0, world_size=1)
            ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name=f"t{j}", embedding_dim=dim, num_embeddings=vocab, feature_names=[f"f{j}"],
                init_fn=lambda t: torch.nn.init.uniform_(t, -r, r))
                for j in range(F)], device=torch.device("meta"))
            if acc0 != 0:  # TorchRec passes no initial value on to fbgemm
                raise ValueError("TorchRec's fused Adagrad starts its accumulators at 0; "
                                 f"got adagrad_initial_accumulator={acc0}")
            apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(),
                                        {"lr": lr, "eps": eps})
            self.emb = DistributedModelParallel(ebc, device=torch.device("cpu"))
            keys = [f"f{j}" for j in range(F)]
            for x, y in raw:
                values, lengths = jagged(x)
                kjt = KeyedJaggedTensor.from_lengths_sync(
                    keys=keys, values=torch.from_numpy(values),
                    lengths=torch.from_numpy(lengths.astype(np.int64)))
                self.batches.append((kjt, torch.from_numpy(y)[:, None]))
            self.forward_emb = lambda kjt: self.emb(kjt).values()
        self.dense = torch.nn.Linear(F * dim, 1)
        with torch.no_grad():  # Keras's Dense defaults: Glorot uniform, zero bias
            torch.nn.init.xavier_uniform_(self.dense.weight)
            self.dense.bias.zero_()
        self.opt = torch.optim.Adagrad(self.dense.parameters(), lr=lr, eps=eps,
                                       initial_accumulator_value=acc0)
        self.i = 0
        loss_initial = self.eval_loss()
        self.train(len(self.batches))  # as FitRounds: batches + 1 steps
        self.lookup(3)
        self.loss_check = {"loss_initial": loss_initial, "loss_after_warmup": self.eval_loss()}
        import fbgemm_gpu
        import torchrec

        self.info = {"impl": impl, **self.loss_check, "framework_versions": {
            "torch": torch.__version__, "torchrec": torchrec.__version__,
            "fbgemm_gpu": fbgemm_gpu.__version__}}

    def step(self):
        torch = self.torch
        inp, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        logits = self.dense(self.forward_emb(inp))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y)
        self.opt.zero_grad()
        loss.backward()  # the embedding tables update here (fused optimizer)
        self.opt.step()
        return loss

    def train(self, steps):
        """Times `steps` steps after one untimed one; the loss is their mean,
        as Keras's `fit` reports it."""
        losses = [self.step().detach()]
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            losses.append(self.step().detach())
        seconds = time.perf_counter() - t0
        self.cpu_s = time.process_time() - cpu0
        return seconds, float(sum(float(x) for x in losses) / len(losses))

    def eval_loss(self):
        """Binary cross-entropy on the first batch (no update), as `protocol.bce`."""
        inp, y = self.batches[0]
        with self.torch.no_grad():
            p = self.torch.sigmoid(self.dense(self.forward_emb(inp)))[:, 0].double().numpy()
        return protocol.bce(p, y[:, 0].double().numpy())

    def lookup(self, n):
        with self.torch.no_grad():
            t0 = time.perf_counter()
            for i in range(n):
                self.forward_emb(self.batches[i % len(self.batches)][0])
            return time.perf_counter() - t0

    def stats(self):
        m = self.meta
        rows = m["features"] * m["vocab"]
        # Static tables: rows x dim floats plus EXACT_ADAGRAD's per-element state.
        return {"table_rows": rows, "table_bytes": 2 * rows * m["dim"] * 4}


if __name__ == "__main__":
    protocol.serve(make_worker)
