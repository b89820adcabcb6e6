#!/usr/bin/env python3
"""Summarizes runs of bench_collectives: per op and size, the median over the runs of each
line's numbers; then, per op, what the issue tracker and the README report: the added latency
at 8 B - 1 KB (weave - MPI) with the guard and without it, the guard's own cost, and the worst
weave / MPI ratio at 64 KB and above.

  for i in 1 2 3; do mpirun -np 2 bench_collectives 9 > run$i.txt; done
  python3 bench/distributed/collectives_summary.py run1.txt run2.txt run3.txt
"""
import re
import statistics
import sys
from collections import defaultdict


def read(paths):
    table = defaultdict(lambda: defaultdict(list))  # (op, check, bytes) -> field -> values
    for path in paths:
        with open(path) as f:
            for line in f:
                fields = dict(re.findall(r"(\w+)=(\S+)", line))
                if "op" not in fields or "check" not in fields:
                    continue
                key = (fields["op"], fields["check"], int(fields["bytes"]))
                for name in ("weave_us", "mpi_us", "ratio", "guard_us"):
                    if name in fields:
                        table[key][name].append(float(fields[name]))
    return table


def main(paths):
    table = read(paths)
    median = {k: {n: statistics.median(v) for n, v in f.items()} for k, f in table.items()}
    ops = list(dict.fromkeys(op for op, _, _ in median))  # in the order they ran
    print(f"{len(paths)} runs; medians per line")
    print("op | added at <=1KB, guard (us) | added at <=1KB, off (us) | guard's own (us) "
          "| worst ratio >=64KB, guard (at) | worst ratio >=64KB, off")
    worst_all, latency_all = 0.0, 0.0
    for op in ops:
        def rows(check, small):
            return [(b, m) for (o, c, b), m in median.items()
                    if o == op and c == check and ((b <= 1024) if small else (b >= 65536))]
        added = [m["weave_us"] - m["mpi_us"] for _, m in rows("guard", True)]
        added_off = [m["weave_us"] - m["mpi_us"] for _, m in rows("off", True)]
        own = [m["guard_us"] for _, m in rows("guard", True)]
        big = rows("guard", False)
        worst_b, worst = max(((b, m["ratio"]) for b, m in big), key=lambda x: x[1])
        worst_off = max(m["ratio"] for _, m in rows("off", False))
        worst_all, latency_all = max(worst_all, worst), max(latency_all, max(added))
        print(f"{op} | {min(added):+.2f} to {max(added):+.2f} | {min(added_off):+.2f} to "
              f"{max(added_off):+.2f} | {min(own):.2f}-{max(own):.2f} | {worst:.3f} "
              f"({worst_b} B) | {worst_off:.3f}")
    print(f"overall: worst ratio >=64KB {worst_all:.3f}, most added at <=1KB {latency_all:+.2f} us")


if __name__ == "__main__":
    main(sys.argv[1:])
