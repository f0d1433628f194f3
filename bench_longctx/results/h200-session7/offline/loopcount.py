"""Instruction mix of the hottest loop (the largest backward-branch body) of a SASS dump."""
import re, sys, collections
lines = open(sys.argv[1]).read().splitlines()
ins = []
for ln in lines:
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
best = None
for i, (addr, text) in enumerate(ins):
    m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)|BRA\s+`\(\.(L_x_\d+)\)", text)
    if "BRA" in text:
        t = re.search(r"0x([0-9a-f]+)", text)
        if t:
            target = int(t.group(1), 16)
            if target < addr:
                body = [x for a, x in ins if target <= a <= addr]
                if best is None or len(body) > len(best):
                    best = body
if best is None:
    print("no loop found"); sys.exit()
ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
print(sys.argv[1].split("/")[-1], "loop body", len(best), ops.most_common(30))
