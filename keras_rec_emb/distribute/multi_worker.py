"""`multi_worker_strategy`: a MultiWorkerMirroredStrategy whose workers end
in bounded time when one of them is lost."""

import math

import tensorflow as tf

from keras_rec_emb.backend.tensorflow import compat as _compat

DEFAULT_LOST_WORKER_TIMEOUT = 10.0


def multi_worker_strategy(lost_worker_timeout=DEFAULT_LOST_WORKER_TIMEOUT,
                          cluster_resolver=None, communication_options=None):
    """A `tf.distribute.MultiWorkerMirroredStrategy` whose workers end with
    an error naming a lost worker within `lost_worker_timeout` seconds.

    Call it before anything else starts TensorFlow's runtime. See
    docs/distributed.md, 'Running on several machines'.


    Args:
        lost_worker_timeout: seconds (a positive number, at most one day)
            a worker may miss heartbeats before its peers fail (10 s by
            default).
        cluster_resolver: passed to the strategy (default: `TF_CONFIG`'s).
        communication_options: passed to the strategy.

    Returns:
        The `tf.distribute.MultiWorkerMirroredStrategy`.

    Example:

    >>> import keras_rec_emb as kre
    >>> strategy = kre.distribute.multi_worker_strategy(lost_worker_timeout=30)
    >>> strategy.num_replicas_in_sync  # without TF_CONFIG: this process alone
    1

    ```python
    # On every worker, with TF_CONFIG set:
    strategy = keras_rec_emb.distribute.multi_worker_strategy(lost_worker_timeout=30)
    with strategy.scope():
        model = build_model()
    model.fit(dataset, epochs=10,
              callbacks=[keras.callbacks.BackupAndRestore("/local/backup")])
    ```
    """
    if isinstance(lost_worker_timeout, bool) or not isinstance(lost_worker_timeout, (int, float)):
        raise TypeError("`lost_worker_timeout` must be a number of seconds. Received: "
                        f"lost_worker_timeout={lost_worker_timeout!r} of type "
                        f"{type(lost_worker_timeout).__name__}")
    if not math.isfinite(lost_worker_timeout) or not 0 < lost_worker_timeout <= 86400:
        raise ValueError("`lost_worker_timeout` must be more than 0 and at most 86400 "
                         f"seconds. Received: lost_worker_timeout={lost_worker_timeout!r}")
    resolver = cluster_resolver or tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    if spec.jobs:
        configured = _compat.coordination_heartbeat_timeout_ms()
        if configured is not None and configured != int(lost_worker_timeout * 1000):
            raise ValueError(
                "TensorFlow's coordination service is already configured in this process "
                f"(heartbeat timeout {configured / 1000:g} s): call multi_worker_strategy "
                "before any other strategy is created. Received: "
                f"lost_worker_timeout={lost_worker_timeout!r}")
        if configured is None:
            _compat.configure_lost_worker_timeout(spec, lost_worker_timeout)
    return tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=cluster_resolver, communication_options=communication_options)
