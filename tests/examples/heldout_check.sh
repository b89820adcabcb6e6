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
  check "$name" "$("${mpirun[@]}" -np "$ranks" "$gpt" "${args[@]}" "$@" | held)"
}
