# Sourced by the finetune test scripts: with $finetune, $mpirun, $work and ${base[@]} set, run
# NAME RANKS ARGS... runs finetune with base's and ARGS into $work/NAME.out (a failure sets
# status=1), final NAME reads that run's final loss, and agrees NAME checks it within `tolerance`
# (relative; 1e-3 unless set) of $reference, ddp's.
status=0
run() {  # name, ranks, args...
  local name=$1 n=$2
  shift 2
  "${mpirun[@]}" -np "$n" "$finetune" "${base[@]}" "$@" >"$work/$name.out" 2>&1 ||
    { echo "FAIL: $name"; cat "$work/$name.out"; status=1; }
}
final() { sed -n 's/^final_loss=//p' "$work/$1.out"; }
agrees() {  # run name: its final loss within ${tolerance:-1e-3} (relative) of $reference
  local got
  got=$(final "$1")
  awk -v a="$got" -v b="$reference" -v t="${tolerance:-1e-3}" \
    'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= t * b) }' ||
    { echo "FAIL: $1 final_loss=$got, ddp's $reference"; status=1; }
  echo "$1 final_loss=$got (ddp $reference)"
}
