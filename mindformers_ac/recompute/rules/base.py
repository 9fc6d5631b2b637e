"""What every rule object shares: its region and why the light path can't reproduce what it decided."""
import weakref


class Rule:
    """One rule's state in one intercepting region. ``region`` is a weak proxy: a region is freed by reference
    counting when its graph lets go of it (a cycle would hold its bytes until a collection). ``reasons``: key -> why
    this call's signature must stay intercepted (the light path can't reproduce what the rule decided), collected by
    ``Region.intercept``."""

    __slots__ = ("region", "reasons")

    def __init__(self, region):
        self.region, self.reasons = weakref.proxy(region), {}

    def keeps_intercepted(self, key, reason):
        self.reasons.setdefault(key, reason)
