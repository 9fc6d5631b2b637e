"""Process peak RSS (VmHWM): the sanity figure ``train`` prints beside the saved-tensor accounting."""


def _status_field(name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{name} not found in /proc/self/status (Linux only)")


def vm_hwm():
    """Peak resident set size (VmHWM) in bytes since start or the last ``reset_hwm()``. Linux only."""
    return _status_field("VmHWM")


def reset_hwm():
    """Reset VmHWM to the current RSS (writes 5 to /proc/self/clear_refs). Linux only."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
