"""Sums unread_study.py's JSON files into one table per variant: trials (needle, q head) pairs holding >= 5% of the
dense weight, how many rank outside the fine pass's candidates (rank >= 251 of the first level's estimate: 256 minus
the protected blocks), the worst rank, and the worst rank per file. Usage: python aggregate.py FILE.json ..."""
import json
import sys

totals = {}
for path in sys.argv[1:]:
    data = json.load(open(path))
    for name, s in data["summary"].items():
        t = totals.setdefault(name, {"trials": 0, "outside_251": 0, "worst": 0, "per_file": {}})
        t["trials"] += s["trials"]
        t["outside_251"] += s["trials"] - s["within_251"]
        t["worst"] = max(t["worst"], s["worst_rank"])
        t["per_file"][path] = s["worst_rank"]
for name, t in sorted(totals.items(), key=lambda kv: int(kv[0][1:].split("_")[0])):
    print(f"{name:12s} trials {t['trials']:4d}  outside the candidates {t['outside_251']:2d}  worst rank {t['worst']:5d}  "
          f"per file {list(t['per_file'].values())}")
