#!/usr/bin/env bash
# Drive the real ninfer-chat (real default model) in tmux and print what the screen showed:
# ask -> streaming + live panel -> toggle spec/penalties -> ask again and stop with Esc -> regenerate -> export.
#
#   scripts/tui_tmux_check.sh [extra ninfer-chat args...]      (e.g. --backend cuda)
#
# Uses a private config/data dir (never yours). Needs tmux (installed with apt-get when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
command -v tmux >/dev/null || { apt-get install -y tmux >/dev/null 2>&1 || { echo "tmux missing"; exit 2; }; }

WORK=$(mktemp -d /tmp/ninfer-tmux.XXXXXX)
export NINFER_DATA_DIR=$WORK/data NINFER_CONFIG_DIR=$WORK/config NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-2}
S=ninfer-check-$$
W=140 H=45
cleanup() { tmux kill-session -t "$S" 2>/dev/null || true; }
trap cleanup EXIT

screen() { tmux capture-pane -p -t "$S"; }
chatcol() { screen | cut -c1-100 | sed 's/[[:space:]]*$//' | grep -av '^$' || true; }
panel() { screen | cut -c103- | sed 's/[[:space:]]*$//' | grep -av '^$' || true; }
replies() {  # number of saved assistant messages (each is committed when its reply completes)
  "$PY" - "$NINFER_DATA_DIR/transcripts.db" <<'EOF'
import sqlite3, sys, os
p = sys.argv[1]
print(sqlite3.connect(p).execute("select count(*) from messages where role='assistant'").fetchone()[0]
      if os.path.exists(p) else 0)
EOF
}
wait_replies() {  # wait until N replies are saved (timeout $2 s)
  local n=$1 t=${2:-300} i=0
  while [ "$(replies)" -lt "$n" ]; do
    sleep 0.5; i=$((i + 1))
    if [ $i -gt $((t * 2)) ]; then echo "TIMEOUT waiting for reply $n"; screen; exit 1; fi
  done
}
wait_text() {  # wait until the screen shows $1 (timeout $2 s)
  local t=${2:-300} i=0
  until screen | grep -q -- "$1"; do
    sleep 0.5; i=$((i + 1))
    if [ $i -gt $((t * 2)) ]; then echo "TIMEOUT waiting for '$1'"; screen; exit 1; fi
  done
}
ask() { tmux send-keys -t "$S" -l "$1"; sleep 0.3; tmux send-keys -t "$S" Enter; }
section() { echo; echo "=== $* ==="; }

mkdir -p "$NINFER_CONFIG_DIR"
printf '[thinking]\nbudget_step = 16\n' > "$NINFER_CONFIG_DIR/config.toml"  # F6 -> a 16-token budget

tmux new-session -d -s "$S" -x $W -y $H \
  "cd '$ROOT' && PYTHONPATH='$ROOT' '$PY' -m ninfer_tui --max-new 64 --temperature 0 $* ; sleep 600"
T0=$(date +%s)
section "loading (status line)"
sleep 2; screen | head -1
wait_text "F1 help" 600
echo "ready after $(( $(date +%s) - T0 )) s: $(screen | head -1 | sed 's/[[:space:]]*$//')"

section "1. ask; mid-stream"
ask "Write a short poem about the sea."
sleep 3
chatcol | tail -12
echo "--- panel while streaming ---"; panel | sed -n '1,16p'
wait_replies 1
section "1. reply finished: chat + panel"
chatcol | tail -14
echo "--- panel ---"; panel | sed -n '1,40p'

section "2. F2 (spec cycle) + F3 (penalties)"
tmux send-keys -t "$S" F2; sleep 0.5; tmux send-keys -t "$S" F3; sleep 0.7
panel | grep -aE "SPECULATIVE|unavailable|penalties|presence" || true
screen | grep -aE "speculative decoding|penalties (on|off)" | sed 's/[[:space:]]*$//' || true

section "3. ask again and stop with Esc after ~2 s"
ask "List ten facts about the moon, with details."
sleep 2.5
tmux send-keys -t "$S" Escape
wait_replies 2
sleep 0.5
chatcol | tail -10
panel | grep -aE "finish|tokens out|last reply|acceptance|tok/round|ms/round|draft|verify" || true

section "4. regenerate (ctrl+r)"
tmux send-keys -t "$S" C-r
wait_replies 3
sleep 0.5
chatcol | tail -12
panel | grep -aE "finish|tokens out|last reply|acceptance|tok/round" || true

section "5. export (ctrl+s)"
tmux send-keys -t "$S" C-s; sleep 1
screen | grep -o "exported to [^ ]*" | head -1 || true
f=$(ls "$NINFER_DATA_DIR"/exports/* 2>/dev/null | head -1)
if [ -n "$f" ]; then echo "--- $f (head) ---"; head -24 "$f"; else echo "NO EXPORT FILE"; fi

section "6. thinking budget (F6: prompted thinking, budget 16) on a new chat (ctrl+n)"
tmux send-keys -t "$S" C-n; sleep 0.5; tmux send-keys -t "$S" F6; sleep 0.5
ask "Why is the sky blue?"
wait_replies 4
sleep 0.5
chatcol | tail -12
panel | grep -aE "THINKING|reasoning|close forced" || true

section "7. transcripts (--list, outside the TUI)"
PYTHONPATH=$ROOT "$PY" -m ninfer_tui --list
tmux send-keys -t "$S" C-q; sleep 1
echo; echo "tmux check done (work dir $WORK)"
