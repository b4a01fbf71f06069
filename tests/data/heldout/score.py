import csv, json, subprocess, sys, re
from datetime import datetime
D = str(__import__("pathlib").Path(__file__).resolve().parent)
dfo = sys.argv[1] if len(sys.argv) > 1 else ".venv/bin/dfo"
def ts(s): return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
for row in csv.DictReader(open(f"{D}/labels.csv")):
    f = row["file"]; level = float(row["level_tok_s"]); hold = int(row["holds_from_step"])
    m = re.search(r"early level (\d+) until step (\d+)", row["what the plot shows"])
    early = (float(m.group(1)), int(m.group(2))) if m else None
    first_ts = None
    for line in open(f"{D}/{f}"):
        if "event=step" in line:
            first_ts = ts(line.split()[0][3:]); break
    out = subprocess.run([dfo, "replay", f"{D}/{f}", "--timeline", "--json"], capture_output=True, text=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.strip().startswith("{")]
    changes = []
    for d in rows:
        if d.get("decision") == "steady":
            s = ts(d["at_ts"]) - first_ts; st = d["at_step"]; v = d["steady_tok_s"]
            ref = early[0] if early and st is not None and st <= early[1] + 5 else level
            changes.append(f"{s:5.0f}s st{st} {v:8.0f} ({v/ref-1:+.1%})")
    fin = rows[-1] if rows else {}
    fe = (fin.get("steady_tok_s") or 0) / level - 1 if fin.get("steady_tok_s") else None
    print(f"{f:34s} first: {changes[0] if changes else '-':32s} n_steady_changes={len(changes)} final={fin.get('decision')} {fin.get('steady_tok_s') or 0:.0f} ({fe:+.1%})" if fe is not None else f"{f:34s} first: {changes[0] if changes else '-'} final={fin.get('decision')}")
    for c in changes[1:]:
        print(" " * 36, "then", c)
