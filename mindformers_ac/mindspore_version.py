"""The MindSpore releases this package runs on, checked once at import.

The engines rely on APIs that appeared in MindSpore 2.9.0: ``MsDispatchMode``
(op interception), the ``mindspore.graph`` package, and the PyNative
executor's ``new_empty_graph`` (the recompute's throw-away graph). An older
MindSpore fails at import with a message naming the release needed, instead
of an AttributeError deep inside a training step.
"""

MIN_MINDSPORE = "2.9.0"


def require_mindspore():
    """Raise ImportError naming ``MIN_MINDSPORE`` when the installed MindSpore lacks what the engines use."""
    import mindspore
    try:
        from mindspore.utils import MsDispatchMode  # noqa: F401
        from mindspore.graph.api import _pynative_executor
        _pynative_executor.new_empty_graph   # noqa: B018  (the attribute is the check)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"mindformers-ac needs MindSpore >= {MIN_MINDSPORE}, found {mindspore.__version__} "
                          f"({exc}); upgrade with: pip install 'mindspore>={MIN_MINDSPORE}'") from None
