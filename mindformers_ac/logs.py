"""Where the package's messages go: warnings once per owner and key, and the one summary a user must see.

``OnceLogger`` keeps warnings that would repeat every step to one per owner
(the engines' owners are process-wide: see ``OnceLogger``).
``report_summary`` is how ``apply_ac`` says what it applied, once per call,
following the host framework's conventions (see its docstring).
"""
import logging
import sys
import threading

PACKAGE_LOGGER = "mindformers_ac"


class OnceLogger:
    """``warning(key, msg, *args)`` logs the first time ``key`` is seen by this object only.

    Who owns one decides how often a warning is seen. A ``StepMeter`` (and
    a ``SavedTensorMeter`` given none) has its own, so each new meter warns
    afresh. The two engines keep theirs process-wide, beside their other
    process-wide state: ``SwapManager`` is a singleton (its ``reset()``
    calls ``reset()`` here), and the recompute engine's is
    ``recompute.state.ENGINE.warnings``, so a recompute warning is logged
    once per process and key (a key names the warning and, where it has
    one, the target or op: ``("random_output", "MLP.act")``, ``"must_swap"``)
    and nothing but a test resets it.
    ``reset()`` forgets the keys seen.
    """

    def __init__(self, logger):
        self.logger = logger
        self._seen = set()
        self._lock = threading.Lock()   # hooks may warn from the copy worker thread

    def warning(self, key, msg, *args):
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        self.logger.warning(msg, *args)

    def reset(self):
        with self._lock:
            self._seen.clear()


def mindformers_logger():
    """MindFormers' logger (``mindformers.tools.logger.logger``) when MindFormers is loaded, else None.

    Only a MindFormers the process already imported counts: importing it here
    would cost seconds, needs its own MindSpore version, and its logger
    creates log folders on first use; a trainer that calls ``apply_ac`` from
    MindFormers has imported it long before.
    """
    if "mindformers" not in sys.modules:
        return None
    try:
        from mindformers.tools.logger import logger  # pylint: disable=import-outside-toplevel
    except Exception:  # pylint: disable=broad-exception-caught  # any failure: use our own logger
        return None
    return logger if callable(getattr(logger, "info", None)) else None


def _unconfigured(logger):
    """True when nobody configured where ``logger``'s records go: no handler on the way to the root, no
    level set on the package's loggers, logging not disabled."""
    if logger.hasHandlers() or logger.disabled or logging.root.manager.disable >= logging.INFO:
        return False
    node = logger
    while node is not None and node is not logging.root:
        if node.level != logging.NOTSET:
            return False
        node = node.parent
    return True


def report_summary(message, logger_name=PACKAGE_LOGGER):
    """Log ``message`` (one block, INFO) where a user sees it.

    * MindFormers loaded: through MindFormers' logger, as MindFormers' own
      ``apply_ac`` reports (its handlers print INFO to stdout and its log files).
    * Else the ``mindformers_ac`` logger, so an application's logging config
      decides (level, handlers, format); a level set on it, or a handler
      anywhere above it, is respected.
    * When logging is not configured at all, that record would vanish (the root
      level is WARNING, and Python's last-resort handler shows warnings only), and
      a library must not configure logging for its user (``basicConfig``, or a
      handler left on its logger, would change every later record). So this one
      record is handed to a stderr handler made for it alone: the user sees one
      line per ``apply_ac``, nothing else changes, and the first logging config
      the application makes takes over.
    """
    mf_logger = mindformers_logger()
    if mf_logger is not None:
        try:
            mf_logger.info(message)
            return
        except Exception:  # pylint: disable=broad-exception-caught  # a broken host logger must not fail apply_ac
            pass
    logger = logging.getLogger(logger_name)
    if not _unconfigured(logger):
        logger.info(message, stacklevel=2)   # the record names the caller (apply_ac), not this helper
        return
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, message, (), None)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
    handler.handle(record)
