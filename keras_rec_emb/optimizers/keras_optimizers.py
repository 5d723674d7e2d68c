"""SGD, Adagrad, Adam and Ftrl that also update embedding tables.

Each accepts exactly the arguments of its Keras namesake and updates dense
variables exactly as Keras does. Embedding tables are updated by one fused
kernel per table and step, with the same per-row formula, on the rows with
a gradient in the step only ("lazy" updates, as in DeepRec: a table's rows
are not enumerable each step).
"""

import inspect

import keras

from keras_rec_emb import _backend
from keras_rec_emb._checks_core import check_hyper_arguments

if _backend.is_jax():
    from keras_rec_emb.backend.jax.optimizers import TableOptimizer as _Tables
else:
    from keras_rec_emb.backend.tensorflow.optimizer import TableOptimizer as _Tables

ops = keras.ops
_register = keras.saving.register_keras_serializable(package="keras_rec_emb")


class TableOptimizer(_Tables):
    """The base of this package's optimizers, placed before a Keras
    optimizer class: the running backend's table plumbing (`_Tables`) and
    the hyper-parameter checks of both backends (Keras itself accepts e.g.
    a learning rate of -1).

    Subclasses implement `_table_update(learning_rate, step)` returning
    `(rule, hyper)`: a rule of `_update_rules.RULES` and a dict of its
    hyper-parameters by name, in `keras.ops` (`learning_rate` and `decay`
    are filled in by the backend; the rule declares the order and slots).
    """

    def __init__(self, *args, **kwargs):
        base_init = super().__init__
        check_hyper_arguments(base_init, args, kwargs, self.check_learning_rate)
        base_init(*args, **kwargs)

    def load_own_variables(self, store):
        if getattr(self, "_kre_table_own", False) and self.variables and not store.keys():
            # A table's own optimizer is saved at `<layer path>/optimizer`;
            # the TensorFlow layer of 0.2.0 saved it at its other attribute,
            # `table_optimizer`. A file without the first: Keras loads the
            # same object again from the other path when this one fails.
            raise ValueError(f"The file holds no variables of '{self.name}' at this path")
        super().load_own_variables(store)

    def __init_subclass__(cls, **kwargs):
        # A subclass that takes its Keras base's arguments through
        # `*args, **kwargs` gets that base's signature (inspect.signature,
        # help(), docs), with its own keyword arguments before `**kwargs`.
        super().__init_subclass__(**kwargs)
        own_init = vars(cls).get("__init__")
        if own_init is None and cls.__init__ is not TableOptimizer.__init__:
            return  # inherits a signature (a class of ours, or its own)
        own = inspect.signature(own_init) if own_init is not None else None
        if own is not None and not any(p.kind is p.VAR_POSITIONAL
                                       for p in own.parameters.values()):
            return  # a signature of its own
        keras_base = next((c for c in cls.__mro__
                           if not issubclass(c, TableOptimizer) and "__init__" in vars(c)),
                          None)
        if keras_base is None:
            return
        params = list(inspect.signature(keras_base.__init__).parameters.values())
        extra = [p for p in (own.parameters.values() if own else ())
                 if p.kind is p.KEYWORD_ONLY]
        var_kw = [p for p in params if p.kind is p.VAR_KEYWORD]
        params = [p for p in params if p.kind is not p.VAR_KEYWORD] + extra + var_kw
        call = own_init or TableOptimizer.__init__

        def __init__(self, *args, **kwargs):
            call(self, *args, **kwargs)

        __init__.__signature__ = inspect.Signature(params)
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__module__ = cls.__module__
        __init__.__doc__ = call.__doc__
        cls.__init__ = __init__


def example(optimizer):
    """The `Example:` of an optimizer's docstring: a model with a table
    compiled with `keras_rec_emb.optimizers.<optimizer>` and trained."""
    return f"""

    Example:

    >>> ids = keras.Input(shape=(2,), dtype="int32")
    >>> x = keras_rec_emb.layers.EmbeddingVariable(4, combiner="sum")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(x))
    >>> model.compile(optimizer=keras_rec_emb.optimizers.{optimizer}, loss="mse")
    >>> history = model.fit(np.array([[1, 10**6], [7, 1]]), np.ones((2, 1)),
    ...                     verbose=0)
    """


def _namesake(rule, args):
    """Registers one of ours named as the Keras optimizer it subclasses, with
    its docstring: `rule`, the table's update; `args`, the example's."""
    def decorate(cls):
        name = cls.__name__
        cls.__doc__ = (
            f"`keras.optimizers.{name}` that also updates embedding tables.\n\n"
            f"    Dense variables follow Keras's {name} exactly. A table's rows\n"
            f"    are updated in place by one fused kernel per step (under JAX, in the\n"
            f"    backward pass of the lookup): {rule}\n"
            "    Slots live inside the table and are saved with it.\n\n"
            f"    Its arguments are those of `keras.optimizers.{name}`."
            + example(f"{name}({args})"))
        return _register(cls)
    return decorate


@_namesake("equal keys summed, then `row -= lr * g` (or the momentum /\n"
           "    Nesterov update with a per-row `momentum` slot).", "0.1")
class SGD(TableOptimizer, keras.optimizers.SGD):
    def _table_update(self, learning_rate, step):
        if self.momentum == 0:
            return "sgd", {}
        return "momentum", {"momentum": self.momentum, "nesterov": float(self.nesterov)}


@_namesake("`accumulator += g**2; row -= lr * g / sqrt(accumulator +\n    epsilon)`.", "0.1")
class Adagrad(TableOptimizer, keras.optimizers.Adagrad):
    def _table_update(self, learning_rate, step):
        return "adagrad", {"epsilon": self.epsilon}


@_namesake("Keras's Adam formula with the bias correction of the\n"
           "    optimizer's step (`iterations + 1`), on per-row `momentum`\n"
           "    and `velocity` (and `velocity_hat` with `amsgrad`) slots.", "0.01")
class Adam(TableOptimizer, keras.optimizers.Adam):
    def _table_update(self, learning_rate, step):
        t = ops.cast(step + 1, "float32")
        beta_1_power = ops.power(ops.cast(self.beta_1, "float32"), t)
        beta_2_power = ops.power(ops.cast(self.beta_2, "float32"), t)
        alpha = learning_rate * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        return "adam", {"alpha": alpha, "beta_1": self.beta_1, "beta_2": self.beta_2,
                        "epsilon": self.epsilon, "amsgrad": float(self.amsgrad)}


_TABLE_RULES = ("keras", "deeprec")


@_register
class Ftrl(TableOptimizer, keras.optimizers.Ftrl):
    __doc__ = """`keras.optimizers.Ftrl` that also updates embedding tables.

    Dense variables follow Keras's Ftrl exactly. A table's rows are updated
    in place by one fused kernel per step, on per-row `accumulator` and
    `linear` slots, by one of two rules:

    * `table_rule="keras"` (default): Keras's element-wise FTRL-proximal
      formula, as for dense variables (each element is 0 while
      `|linear| <= l1`).
    * `table_rule="deeprec"`: DeepRec's `KvSparseApplyFtrl` for
      EmbeddingVariables, where L1/L2 shrinkage acts on the row as a group:
      the row is 0 while `||linear||_2 <= l1`, otherwise
      `(l1 - ||linear||) / ((accum**-lr_power / lr + 2 * l2) * ||linear||)
      * linear`. A DeepRec model's embedding numbers reproduce with it.
      (DeepRec uses this rule for EVs only; its dense variables use the
      element-wise one, as here.)

    Where it differs from DeepRec: Keras's `beta` (default 0) adds
    `beta / (2 * lr)` to l2 in both rules; DeepRec has no `beta`. Slots
    live inside the table and are saved with it.

    Args:
        table_rule: `"keras"` or `"deeprec"`, the rule for embedding
            tables. Defaults to `"keras"`.
        **kwargs: the arguments of `keras.optimizers.Ftrl`.""" + example(
        'Ftrl(0.1, l1_regularization_strength=0.01, table_rule="deeprec")')

    def __init__(self, *args, table_rule: str = "keras", **kwargs):
        if table_rule not in _TABLE_RULES:
            raise ValueError(f"`table_rule` must be one of {_TABLE_RULES}. Received: "
                             f"table_rule={table_rule!r}")
        super().__init__(*args, **kwargs)
        self.table_rule = table_rule

    def get_config(self):
        config = super().get_config()
        config["table_rule"] = self.table_rule
        return config

    def _table_update(self, learning_rate, step):
        l2 = self.l2_regularization_strength + self.beta / (2.0 * learning_rate)
        rule = "ftrl_group" if self.table_rule == "deeprec" else "ftrl"
        return rule, {"learning_rate_power": self.learning_rate_power,
                      "l1": self.l1_regularization_strength, "l2_plus_beta": l2,
                      "l2_shrinkage": self.l2_shrinkage_regularization_strength}


if _backend.is_jax():
    from keras_rec_emb.backend.jax.optimizers import NAMESAKE_UPDATES

    # A table given Keras's own optimizer takes the rule of our namesake.
    NAMESAKE_UPDATES.update({cls.__name__: cls._table_update  # pylint: disable=protected-access
                             for cls in (SGD, Adagrad, Adam, Ftrl)})


# What only the model's optimizer can do: a table's own optimizer sees one
# table's gradient, before the model's clips, accumulates, averages or unscales.
_MODEL_ONLY = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "loss_scale_factor",
               "gradient_accumulation_steps")


def _table_optimizer_classes():
    """Our optimizers by lower-case class name (`"adagrad"`, `"adamasync"`)."""
    out, todo = {}, [TableOptimizer]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("keras_rec_emb.optimizers"):
                out[sub.__name__.lower()] = sub
            todo.append(sub)
    return out


def table_optimizer(identifier):
    """The optimizer of this package that trains one table on its own
    (`EmbeddingVariable(optimizer=...)`, `TableConfig(optimizer=...)`), under
    either backend: from one of ours (returned as it is), Keras's SGD,
    Adagrad, Adam or Ftrl (ours of that name, same config), a name
    (`"adagrad"`, `"AdamAsync"`) or a config saved by either backend; None
    (the model's optimizer) stays None. Refuses what only the model's
    optimizer can do (clipping, loss scaling, EMA, gradient accumulation)."""
    if identifier is None:
        return None
    classes = _table_optimizer_classes()
    if isinstance(identifier, str):
        cls = classes.get(identifier.lower())
        if cls is None:
            raise ValueError(
                "`optimizer` must be None, an optimizer of keras_rec_emb.optimizers, "
                f"or the name of one of {sorted(classes)}. Received: optimizer={identifier!r}")
        optimizer = cls()
    elif isinstance(identifier, dict):
        name = str(identifier.get("class_name", "")).lower()
        if name not in classes:
            raise ValueError(
                "`optimizer` config must be that of an optimizer of keras_rec_emb.optimizers "
                f"({', '.join(sorted(classes))}). Received: optimizer={identifier!r}")
        optimizer = classes[name].from_config(identifier.get("config") or {})
    else:
        optimizer = identifier
    keras_namesake = (isinstance(optimizer, keras.optimizers.Optimizer)
                      and not isinstance(optimizer, TableOptimizer)
                      and type(optimizer) in (keras.optimizers.SGD, keras.optimizers.Adagrad,
                                              keras.optimizers.Adam, keras.optimizers.Ftrl))
    if keras_namesake:
        optimizer = classes[type(optimizer).__name__.lower()].from_config(optimizer.get_config())
    if not isinstance(optimizer, TableOptimizer) or type(optimizer).__name__ == "LossScaleOptimizer":
        raise TypeError(
            "`optimizer` of a table must be None, an optimizer of keras_rec_emb.optimizers "
            "(SGD, Adagrad, Adam, Ftrl, AdamAsync, AdagradDecay, AdamW), Keras's SGD, Adagrad, "
            f"Adam or Ftrl, or the name of one of ours. Received: optimizer={identifier!r}")
    config = optimizer.get_config()
    model_only = sorted(name for name in _MODEL_ONLY if config.get(name) not in (None, False))
    if model_only:
        raise ValueError(
            f"A table's optimizer cannot set {model_only} (the model's optimizer "
            "clips, accumulates, averages and unscales every gradient, tables' included): set "
            f"them on the model's optimizer. Received: optimizer={identifier!r}")
    return optimizer
