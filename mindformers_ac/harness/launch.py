"""Run a script on N local ranks with ``msrun``, bounded in time, never leaving processes behind.

    from mindformers_ac.harness.launch import launch_msrun
    res = launch_msrun(["scripts/tp_worker.py", "--tp", "2", "--out", "/tmp/o"], nproc=2, timeout_s=240)
    res.returncode, res.log_dir          # worker_0.log ... worker_{N-1}.log, scheduler.log, msrun.log

    python -m mindformers_ac.harness.launch [--nproc 2] [--timeout 600] [--log-dir DIR] script.py args...

What ``msrun`` (MindSpore 2.10, ``--join True``, CPU/mccl) does, found here:

* It starts a scheduler (``MS_ROLE=MS_SCHED``, in msrun's own process group)
  and one process per worker, each worker in a NEW session
  (``preexec_fn=os.setsid``). Killing msrun's process group does therefore
  not kill the workers: the launcher snapshots msrun's descendants and kills
  each one's process group too.
* It spawns the bare name ``python`` from ``PATH``; if the venv is not on
  ``PATH`` the workers die with ``ModuleNotFoundError: mindspore``. The
  launcher puts ``dirname(sys.executable)`` first on ``PATH``.
* It polls the workers once a second; when one exits non-zero it prints
  ``Worker process PID exit with exception`` and ``There's worker exits with
  exception, kill all other workers.``, SIGKILLs the other workers' groups,
  then WAITS FOR THE SCHEDULER. How long that takes depends on when the rank
  failed:
    - rank raised after ``init()`` (cluster built): the scheduler notices the
      lost node by heartbeat and exits; msrun returned 1 after ~46 s here
      (2 ranks, the other rank blocked in an AllReduce).
    - rank raised before ``init()`` (it never registered): the scheduler keeps
      retrying ``BuildCluster`` ("Topology build timed out, retry(n/1200)")
      for ``--cluster_time_out`` seconds (default 600): msrun hangs ~10 min.
* A successful 2-rank job returns 0; msrun alone costs ~10-20 s of
  start/teardown on 2 cores.

So the launcher (1) passes ``--cluster_time_out`` (default: min(timeout, 120)
s), (2) reads msrun's output and, once the "exit with exception" line
appears, gives msrun ``fail_grace_s`` (3 s) to finish and then kills
everything, (3) kills everything at ``timeout_s`` (return code 124), and
(4) starts msrun with ``start_new_session=True`` and, on any kill, SIGTERMs
then SIGKILLs msrun's group, every descendant's group and every descendant
(snapshot taken with psutil before killing), so no scheduler/worker/tail
process survives. The scheduler's own stdout/stderr (which msrun echoes)
goes to ``LOG_DIR/msrun.log``.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

FAIL_MARKERS = ("exit with exception", "kill all other workers")


class LaunchResult(NamedTuple):
    returncode: int      # msrun's exit code; 124 on timeout; 1 if killed after a rank failed
    log_dir: str         # per-rank logs: worker_{i}.log, scheduler.log, msrun.log
    timed_out: bool
    rank_failed: bool    # msrun reported a worker exiting with an exception
    elapsed_s: float
    port: int

    def worker_logs(self):
        return sorted(os.path.join(self.log_dir, f) for f in os.listdir(self.log_dir)
                      if f.startswith("worker_") and f.endswith(".log"))


def free_port(host="127.0.0.1"):
    """A TCP port that was free on ``host`` a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def _msrun_path():
    candidate = os.path.join(os.path.dirname(sys.executable), "msrun")
    if os.path.exists(candidate):
        return candidate
    from shutil import which
    found = which("msrun")
    if not found:
        raise FileNotFoundError("msrun not found next to the interpreter nor on PATH")
    return found


def _descendants(pid):
    try:
        import psutil
        return psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - process already gone or psutil missing
        return []


def kill_tree(proc, term_wait_s=3.0):
    """SIGTERM, then SIGKILL, msrun's group, each descendant's group and each descendant."""
    kids = _descendants(proc.pid)
    groups = {proc.pid}
    for kid in kids:
        try:
            groups.add(os.getpgid(kid.pid))
        except OSError:
            pass
    groups.discard(os.getpgid(0))  # never our own group

    def send(sig):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass
        for kid in kids:
            try:
                kid.send_signal(sig)
            except Exception:  # noqa: BLE001
                pass

    send(signal.SIGTERM)
    deadline = time.monotonic() + term_wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(k) for k in kids):
            break
        time.sleep(0.1)
    send(signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for kid in kids:  # reap if they were ours; otherwise wait for them to vanish
        try:
            kid.wait(timeout=5)
        except Exception:  # noqa: BLE001
            pass


def _alive(ps_proc):
    try:
        return ps_proc.is_running() and ps_proc.status() != "zombie"
    except Exception:  # noqa: BLE001
        return False


def launch_msrun(argv_of_script, nproc=2, timeout_s=600, log_dir=None, master_port=None,
                 cluster_time_out=None, fail_grace_s=3.0, env=None, echo=False, node=None):
    """Run ``msrun ... <script> <args>`` on ``nproc`` local ranks; returns a ``LaunchResult``.

    ``argv_of_script``: ``[script, *args]``. ``log_dir``: where msrun writes
    ``worker_{rank}.log`` / ``scheduler.log`` (default: a new temp dir), plus
    this launcher's ``msrun.log``. ``env``: extra environment variables.
    ``echo``: also print msrun's output lines. ``node``: ``(node_rank, worker_num)``
    when this msrun is one node of a job of ``worker_num`` ranks (``launch_nodes``).
    """
    argv_of_script = [str(a) for a in argv_of_script]
    log_dir = os.path.abspath(log_dir or tempfile.mkdtemp(prefix="msrun_"))
    os.makedirs(log_dir, exist_ok=True)
    port = int(master_port or free_port())
    if cluster_time_out is None:
        cluster_time_out = int(max(30, min(timeout_s, 120)))
    node_rank, worker_num = node or (0, nproc)
    cmd = [_msrun_path(), "--worker_num", str(worker_num), "--local_worker_num", str(nproc),
           "--node_rank", str(node_rank),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "--join", "True",
           "--cluster_time_out", str(cluster_time_out), "--log_dir", log_dir, *argv_of_script]
    run_env = dict(os.environ)
    run_env.update(env or {})
    bindir = os.path.dirname(sys.executable)
    run_env["PATH"] = bindir + os.pathsep + run_env.get("PATH", "")  # msrun spawns bare 'python'
    run_env["PYTHONUNBUFFERED"] = "1"

    failed = threading.Event()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=run_env,
                            start_new_session=True)

    def pump():
        with open(os.path.join(log_dir, "msrun.log"), "w", encoding="utf-8", errors="replace") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                log.write(line)
                log.flush()
                if echo:
                    sys.stdout.write(line)
                if any(m in line for m in FAIL_MARKERS):
                    failed.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out, rc, fail_seen_at = False, None, None
    try:
        while True:
            rc = proc.poll()
            if rc is not None:
                break
            now = time.monotonic()
            if now - start > timeout_s:
                timed_out = True
                break
            if failed.is_set():
                fail_seen_at = fail_seen_at or now
                if now - fail_seen_at > fail_grace_s:
                    break
            time.sleep(0.2)
    finally:
        if rc is None:
            kill_tree(proc)
            rc = 124 if timed_out else 1
        else:
            # msrun is gone; make sure nothing it started survives (workers are setsid'd).
            leftovers = [k for k in _descendants(proc.pid)]
            if leftovers:
                kill_tree(proc)
        reader.join(timeout=5)
        if proc.stdout:
            proc.stdout.close()
    return LaunchResult(returncode=rc, log_dir=log_dir, timed_out=timed_out,
                        rank_failed=failed.is_set(), elapsed_s=round(time.monotonic() - start, 2),
                        port=port)


def launch_nodes(argv_of_script, nodes=2, nproc_per_node=1, log_dir=None, **kwargs):
    """One job of ``nodes`` x ``nproc_per_node`` ranks as ``nodes`` msrun processes on this host, as on several
    machines (``--node_rank``, ``--local_worker_num``, ``--worker_num``, master ``127.0.0.1``, one port): a
    ``LaunchResult`` per node, its logs in ``LOG_DIR/node{n}``. ``kwargs``: ``launch_msrun``'s."""
    log_dir = os.path.abspath(log_dir or tempfile.mkdtemp(prefix="msrun_nodes_"))
    port = kwargs.pop("master_port", None) or free_port()
    results = [None] * nodes

    def run(n):
        results[n] = launch_msrun(argv_of_script, nproc=nproc_per_node, log_dir=os.path.join(log_dir, f"node{n}"),
                                  master_port=port, node=(n, nodes * nproc_per_node), **kwargs)
    threads = [threading.Thread(target=run, args=(n,)) for n in range(nodes)]
    threads[0].start()
    # on one host every node's msrun starts a scheduler (the master address is local to each): node 0's must
    # hold the port first, or another's takes it and node 0's fails
    wait_for_listener(port, timeout_s=kwargs.get("timeout_s", 600), alive=threads[0].is_alive)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def wait_for_listener(port, timeout_s, alive, host="127.0.0.1"):
    """Return once something accepts connections on ``host:port``, ``alive()`` turns false, or ``timeout_s``
    passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.2)


def main(argv=None):
    p = argparse.ArgumentParser(description="msrun with a free port, a timeout and clean kills")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    res = launch_msrun([args.script, *args.script_args], nproc=args.nproc, timeout_s=args.timeout,
                       log_dir=args.log_dir, echo=not args.quiet)
    print(f"[launch] rc={res.returncode} timed_out={res.timed_out} rank_failed={res.rank_failed} "
          f"elapsed={res.elapsed_s}s logs={res.log_dir}", file=sys.stderr)
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
