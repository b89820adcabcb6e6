# Sourced by the GPT test scripts: reading a run's held-out loss and checking it against
# `reference` within `tolerance` (absolute, in nats); a failed check sets status=1. check_run
# runs the script's $gpt with its ${args[@]} under ${mpirun[@]}.
held() { grep -o 'heldout_loss=[0-9.]*' | cut -d= -f2; }
status=0
check() {  # name, then the held-out loss the run printed
  if [ -z "$2" ] || ! awk -v a="$2" -v b="$reference" -v t="$tolerance" \
                          'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= t) }'; then
    echo "FAIL: $1: heldout_loss='$2', reference $reference (tolerance $tolerance)"
    status=1
  else
    echo "ok: $1: heldout_loss=$2"
  fi
}
check_run() {  # name, ranks, then the run's flags beyond args: its held-out loss, checked
  local name=$1 ranks=$2
  shift 2
  last_heldout=$("${mpirun[@]}" -np "$ranks" "$gpt" "${args[@]}" "$@" | held)
  check "$name" "$last_heldout"
}
# check_run, and the held-out loss must repeat `expected` (a run's last_heldout) to the last digit:
# for a flag that changes where values are kept, not how they are computed (activation
# checkpointing recomputes the same operations in the same order).
check_repeats() {  # name, expected, ranks, then the run's flags beyond args
  local name=$1 expected=$2
  shift 2
  check_run "$name" "$@"
  if [ -z "$expected" ] || [ "$last_heldout" != "$expected" ]; then
    echo "FAIL: $name: heldout_loss='$last_heldout', the same run without it printed '$expected'"
    status=1
  fi
}
