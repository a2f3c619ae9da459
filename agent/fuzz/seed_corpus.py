#!/usr/bin/env python3
"""Writes the fuzz seed corpus: every payload of the recorded vLLM stream and of
event_batches.json (../shared/fixtures), one file each, into the directory given."""

import json
import pathlib
import sys

fixtures = pathlib.Path(__file__).resolve().parents[3] / "shared" / "fixtures"
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
n = 0
for line in (fixtures / "vllm-0.32.0-capture.jsonl").read_text().splitlines():
    rec = json.loads(line)
    if rec.get("kind") == "frames":
        (out / f"capture-{rec['seq']:04}").write_bytes(bytes.fromhex(rec["payload"]))
        n += 1
for i, batch in enumerate(json.loads((fixtures / "event_batches.json").read_text())["batches"]):
    (out / f"batch-{i:02}").write_bytes(bytes.fromhex(batch["hex"]))
    n += 1
print(f"{n} seeds in {out}")
