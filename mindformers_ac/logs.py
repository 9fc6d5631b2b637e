"""Warnings that would repeat every step are logged once per owner and key."""
import threading


class OnceLogger:
    """``warning(key, msg, *args)`` logs the first time ``key`` is seen by this object only.

    Each engine object owns one, so a new manager or model warns afresh
    (nothing process-wide); ``reset()`` forgets the keys seen.
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
