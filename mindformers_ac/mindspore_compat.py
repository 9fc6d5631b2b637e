"""The one door to MindSpore's internals: the releases this package runs on, and every private name it uses.

The engines rely on APIs that appeared in MindSpore 2.9.0: ``MsDispatchMode``
(op interception), the ``mindspore.graph`` package, and the PyNative
executor's ``new_empty_graph`` (the recompute's throw-away graph). An older
MindSpore fails at import with a message naming the release needed, instead
of an AttributeError deep inside a training step.

Private MindSpore names are imported here and nowhere else
(``tests/test_layout.py`` checks it), so a MindSpore upgrade is audited in
this one file:

* ``pynative_executor``: ``mindspore.graph.api._pynative_executor`` (grad
  flags, the recompute's empty graph, ``requires_grad``, saved-tensor hook
  state, ``sync``);
* ``no_grad``: ``mindspore._no_grad``, a context that records no graph;
* ``MixedPrecisionType``: from ``mindspore._c_expression``, the type
  ``Cell.__call__`` pushes on the executor for ``to_float`` / amp O2-O3.
"""
import mindspore
from mindspore._c_expression import MixedPrecisionType  # noqa: F401  (re-exported: the door)

try:   # a too-old MindSpore lacks it: require_mindspore() says so before any engine uses it
    from mindspore.graph.api import _pynative_executor as pynative_executor
except ImportError:
    pynative_executor = None

no_grad = mindspore._no_grad   # pylint: disable=protected-access

MIN_MINDSPORE = "2.9.0"


def require_mindspore():
    """Raise ImportError naming ``MIN_MINDSPORE`` when the installed MindSpore lacks what the engines use."""
    try:
        from mindspore.utils import MsDispatchMode  # noqa: F401
        from mindspore.graph.api import _pynative_executor
        _pynative_executor.new_empty_graph   # noqa: B018  (the attribute is the check)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"mindformers-ac needs MindSpore >= {MIN_MINDSPORE}, found {mindspore.__version__} "
                          f"({exc}); upgrade with: pip install 'mindspore>={MIN_MINDSPORE}'") from None
