"""Optimizers that update distributed variables: ``SGD``, ``Adam``, ``AdamW``, ``Adagrad``
and ``RMSprop``.

``await opt.apply_gradients(grads_and_vars)`` from every replica sums the gradients across
replicas in one packed all-reduce, clips them if asked (``clipnorm``, ``clipvalue`` or
``global_clipnorm``), decays the variables if asked (``weight_decay``), and updates every copy
of every variable, all or nothing. See ``help(aioreplica._optimizers)`` for the design.
"""

from ._optimizers import SGD as SGD
from ._optimizers import Adagrad as Adagrad
from ._optimizers import Adam as Adam
from ._optimizers import AdamW as AdamW
from ._optimizers import Optimizer as Optimizer
from ._optimizers import RMSprop as RMSprop

__all__ = ["SGD", "Adagrad", "Adam", "AdamW", "Optimizer", "RMSprop"]


def _fixup_module_metadata() -> None:
    for name in __all__:
        globals()[name].__module__ = __name__


_fixup_module_metadata()
del _fixup_module_metadata
