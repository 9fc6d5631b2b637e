#!/usr/bin/env bash
# Run a script on N local ranks with msrun: free port, timeout watchdog, fast failure, clean kill.
# Shell twin of mindformers_ac/launch.py (read its docstring for what msrun does on failure).
#
#   scripts/launch_tp.sh [-n NPROC] [-t TIMEOUT_S] [-l LOG_DIR] SCRIPT [ARGS...]
#   scripts/launch_tp.sh -n 2 -t 240 scripts/tp_worker.py --tp 2 --steps 3 --out /tmp/tp
#
# Exit code: msrun's; 124 on timeout; 1 when a rank failed and msrun did not return within
# FAIL_GRACE_S (default 3) seconds. Logs: LOG_DIR/worker_{rank}.log, scheduler.log, msrun.log.
# PYTHON (default: python3 on PATH) picks the interpreter whose bin dir holds msrun; that dir is
# put first on PATH because msrun starts the workers as a bare 'python'.
set -u
NPROC=2; TIMEOUT=600; LOG_DIR=""; FAIL_GRACE_S=${FAIL_GRACE_S:-3}
while getopts "n:t:l:h" opt; do
  case $opt in
    n) NPROC=$OPTARG ;; t) TIMEOUT=$OPTARG ;; l) LOG_DIR=$OPTARG ;;
    *) sed -n '2,11p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n '2,11p' "$0"; exit 2; }

PY=${PYTHON:-$(command -v python3)}
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH" PYTHONUNBUFFERED=1
MSRUN="$BIN/msrun"; [ -x "$MSRUN" ] || MSRUN=$(command -v msrun) || { echo "msrun not found" >&2; exit 127; }
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/msrun_XXXXXX)}
mkdir -p "$LOG_DIR"; LOG_DIR=$(cd "$LOG_DIR" && pwd)
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
CTO=$(( TIMEOUT < 120 ? (TIMEOUT < 30 ? 30 : TIMEOUT) : 120 ))

# setsid: msrun and its scheduler get their own process group (workers setsid themselves).
setsid "$MSRUN" --worker_num "$NPROC" --local_worker_num "$NPROC" --master_addr 127.0.0.1 \
  --master_port "$PORT" --join True --cluster_time_out "$CTO" --log_dir "$LOG_DIR" "$@" \
  > "$LOG_DIR/msrun.log" 2>&1 &
MS_PID=$!

descendants() {  # all descendants of $1, deepest last
  local kids; kids=$(pgrep -P "$1" 2>/dev/null) || return 0
  for k in $kids; do echo "$k"; descendants "$k"; done
}
kill_all() {
  local pids groups p
  pids="$MS_PID $(descendants "$MS_PID")"
  groups=$(for p in $pids; do ps -o pgid= -p "$p" 2>/dev/null; done | sort -u)
  for sig in TERM KILL; do
    for g in $groups; do [ "$g" = "$(ps -o pgid= -p $$ | tr -d ' ')" ] || kill -"$sig" -- "-$g" 2>/dev/null; done
    for p in $pids; do kill -"$sig" "$p" 2>/dev/null; done
    [ $sig = TERM ] && sleep 2
  done
}
trap 'kill_all; exit 130' INT TERM

START=$(date +%s); FAIL_AT=""; RC=""
while kill -0 "$MS_PID" 2>/dev/null; do
  NOW=$(date +%s)
  if [ $((NOW - START)) -ge "$TIMEOUT" ]; then RC=124; break; fi
  if [ -z "$FAIL_AT" ] && grep -qE "exit with exception|kill all other workers" "$LOG_DIR/msrun.log"; then
    FAIL_AT=$NOW
  fi
  if [ -n "$FAIL_AT" ] && [ $((NOW - FAIL_AT)) -ge "$FAIL_GRACE_S" ]; then RC=1; break; fi
  sleep 0.5
done
if [ -n "$RC" ]; then
  kill_all; wait "$MS_PID" 2>/dev/null
else
  wait "$MS_PID"; RC=$?
fi
echo "[launch_tp.sh] rc=$RC elapsed=$(( $(date +%s) - START ))s logs=$LOG_DIR" >&2
exit "$RC"
