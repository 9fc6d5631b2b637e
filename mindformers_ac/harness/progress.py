"""The status line ``mindformers-ac train`` shows for each run."""
import sys

from ..tensors import MiB


class Progress:
    """One status line per run on stderr: rewritten in place on a terminal, every few steps otherwise."""

    def __init__(self, label, total, stream=sys.stderr):
        self.label, self.total, self.stream = label, total, stream
        self.tty = stream.isatty()

    def update(self, step, loss, seconds, act_bytes):
        done = step + 1
        width = 20
        bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
        line = (f"[{self.label:>8}] {done:>3}/{self.total} [{bar}] loss {loss:.4f}  "
                f"{seconds * 1000:6.1f} ms/step  act {act_bytes / MiB:7.2f} MiB")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done == self.total else ""))
        elif done == self.total or done == 1 or done % max(1, self.total // 4) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()
