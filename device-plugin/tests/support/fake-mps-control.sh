#!/bin/bash
# A stand-in for nvidia-cuda-mps-control, for tests/mps.rs: the same command interface, no GPU.
#
# `-d`: starts the "daemon" (a sleeping process) in the background, writes its PID to
#   $CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid, appends the environment it was given to
#   $CUDA_MPS_LOG_DIRECTORY/standin-starts.log and a start line to control.log, and returns.
#   Refuses while one runs, as the real one does.
# Client mode (no argument): fails with the real daemon's message when no daemon runs; otherwise
#   reads commands on stdin, one a line, appends each to $CUDA_MPS_PIPE_DIRECTORY/commands.log and
#   answers `get_server_list` from $CUDA_MPS_PIPE_DIRECTORY/servers (one PID a line). `quit` stops
#   the daemon. Every other command answers nothing, as the real `set_*` commands do.
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
log="${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}"
pidfile="$pipe/nvidia-cuda-mps-control.pid"
alive() { [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

if [ "$1" = "-d" ]; then
  if alive; then
    echo "An instance of this daemon is already running" >&2
    exit 1
  fi
  rm -f "$pidfile"
  echo "start CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log" >>"$log/standin-starts.log"
  # bounded, so a test that fails before its cleanup leaves nothing running for long
  bash -c 'echo $$ >"$1.tmp" && mv "$1.tmp" "$1"; exec sleep 300' _ "$pidfile" </dev/null >/dev/null 2>&1 &
  for _ in $(seq 200); do
    [ -s "$pidfile" ] && break
    sleep 0.01
  done
  echo "[$(date '+%F %T').000 Control $(cat "$pidfile")] Starting control daemon using socket $pipe/control" >>"$log/control.log"
  exit 0
fi

if ! alive; then
  echo "Cannot find MPS control daemon process" >&2
  exit 1
fi
while IFS= read -r line; do
  echo "$line" >>"$pipe/commands.log"
  case "$line" in
    get_server_list) [ -f "$pipe/servers" ] && cat "$pipe/servers" ;;
    quit) kill "$(cat "$pidfile")" && rm -f "$pidfile" ;;
  esac
done
exit 0
