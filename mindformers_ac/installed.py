"""Where ``apply_ac`` keeps what it installed on a model, read by everything that measures or undoes it.

Apart from ``apply`` so that the measuring side (``accounting``) does not
import the installing side, which reaches the memory-budget controller, which
measures.
"""

STATE_ATTR = "_mindformers_ac"


def ac_state(model):
    """The ``AcState`` of a model ``apply_ac`` was applied to, else None."""
    return model.__dict__.get(STATE_ATTR)
