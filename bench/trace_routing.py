#!/usr/bin/env python3
"""Where each tenant's requests went in a bench-routing run, and which router decided how.

Run the bench with the routers' `routed` lines on, then point this at its output directory:

    LLMGW_BENCH_RUST_LOG=warn,llmgw::router=debug target/release/llmgw-bench-routing \\
        --out-dir target/trace --policies llmgw_precise --tenants 12 --rate 20 --routers 2
    python3 bench/trace_routing.py target/trace

The bench writes `requests-POLICY.csv` (every request: when it was sent, its conversation, turn,
tenant, the replica that served it and whether it bypassed the routers) and, with
`LLMGW_BENCH_RUST_LOG` set, each router's log to `router-POLICY-N.log`. A request is matched to
the first unused `routed` line, of any router, that picked its replica from 50 ms before it was
sent (clock skew) to a second after (the replicas' addresses are learned from the matches); a
request that bypassed the routers (`--bypass-every`) is matched to none and shown as
`bypassed`. Per tenant it prints its home (the replica that served most of its requests), then
every first turn, every request served away from home and every decision not made by the KV
index outright: the time into the run, conversation, turn, replica, the router that decided, its
tier, reason and outcome, and the blocks matched of the prompt's. A placement of a prompt no
replica held adds `cache_footprint`'s view: its decision, then per candidate (in the routers'
replica order) `footprint:placements:score`, the footprint in blocks, the prompts placed there
lately and the score it gave. A load override (of affinity or of a placement) adds the
decision's scores (with `--scores`, every line shown does): the scorers that counted, then per
candidate its weighted mean and each scorer's score, `/`-separated. Candidates are the
replicas the filters left: a saturated replica is missing from both lists, and every decision
a filter took a replica out of is shown with `filtered out: FILTER=REPLICA`.
"""

import argparse
import bisect
import collections
import csv
import datetime
import pathlib
import re
import signal
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FIELD = re.compile(r'(\w+)=("[^"]*"|[^\s}]+)')


def routed_lines(path, router):
    """(unix time, router, fields) of each `routed` line of one router's log."""
    lines = []
    for line in path.open(errors="replace"):
        line = ANSI.sub("", line)
        if " routed " not in line:
            continue
        stamp, _, rest = line.partition(" ")
        try:
            at = datetime.datetime.fromisoformat(stamp.rstrip("Z")).replace(
                tzinfo=datetime.timezone.utc
            )
        except ValueError:
            continue
        span = rest.split(": llmgw::router:")[0]
        fields = {k: v.strip('"') for k, v in FIELD.findall(span)}
        lines.append((at.timestamp(), router, fields))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=pathlib.Path)
    parser.add_argument("--policy", default="llmgw_precise")
    parser.add_argument("--scores", action="store_true",
                        help="show the decision's scores on every line, not only load overrides")
    args = parser.parse_args()

    requests_path = args.run_dir / f"requests-{args.policy}.csv"
    requests = sorted(
        csv.DictReader(requests_path.open()), key=lambda r: float(r["sent_unix_s"])
    )
    logs = []
    for path in sorted(args.run_dir.glob(f"router-{args.policy}-*.log")):
        logs.extend(routed_lines(path, path.stem.rsplit("-", 1)[1]))
    if not logs:
        sys.exit(f"no routed lines in {args.run_dir}/router-{args.policy}-*.log: "
                 "run the bench with LLMGW_BENCH_RUST_LOG=warn,llmgw::router=debug")
    logs.sort(key=lambda entry: entry[0])
    times = [entry[0] for entry in logs]

    def near(request):
        sent = float(request["sent_unix_s"])
        return bisect.bisect_left(times, sent - 0.05), sent + 1.0

    def bypassed(request):
        return request.get("bypassed") == "1"

    # Replica index -> address: the pick of the line nearest after each request, by majority.
    votes = collections.Counter()
    for request in filter(lambda r: not bypassed(r), requests):
        i, until = near(request)
        if i < len(logs) and logs[i][0] < until:
            votes[(request["replica"], logs[i][2].get("pick"))] += 1
    address = {}
    for (replica, pick), _ in votes.most_common():
        if replica not in address and pick not in address.values():
            address[replica] = pick

    used = set()
    by_tenant = collections.defaultdict(list)
    unmatched = 0
    for request in requests:
        if bypassed(request):
            by_tenant[int(request["tenant"])].append((request, None))
            continue
        i, until = near(request)
        decided = None
        while i < len(logs) and logs[i][0] < until:
            if i not in used and logs[i][2].get("pick") == address.get(request["replica"]):
                used.add(i)
                decided = logs[i]
                break
            i += 1
        unmatched += decided is None
        by_tenant[int(request["tenant"])].append((request, decided))

    for tenant in sorted(by_tenant):
        served = collections.Counter(r["replica"] for r, _ in by_tenant[tenant])
        home = served.most_common(1)[0][0]
        spread = ", ".join(f"{replica}: {n}" for replica, n in sorted(served.items()))
        print(f"t{tenant}: home {home} ({spread})")
        for request, decided in by_tenant[tenant]:
            fields = decided[2] if decided else {}
            by_index = fields.get("tier") == "index" and fields.get("prefix_outcome") == "hit"
            away = request["replica"] != home
            filtered = fields.get("filtered_out")
            if (request["turn"] != "0" and not away and not filtered
                    and (by_index or bypassed(request))):
                continue
            how = "bypassed" if bypassed(request) else "no routed line"
            if decided:
                how = (
                    f"router {decided[1]} {fields.get('tier', '?')}"
                    f"/{fields.get('tier_reason', '')}/{fields.get('prefix_outcome', '')}"
                    f" {fields.get('matched_blocks', '-')}/{fields.get('prompt_blocks', '-')}"
                )
                if "placement" in fields:
                    how += f"  {fields['placement']}"
                overridden = "load_override" in (
                    fields.get("prefix_outcome"), fields.get("placement", "").split("|")[0]
                )
                if "scores" in fields and (args.scores or overridden):
                    how += f"  {fields['scores']}"
                if filtered:
                    replica_of = {a: r for r, a in address.items()}
                    named = []
                    for out in filtered.split(","):
                        name, _, addr = out.partition("=")
                        named.append(f"{name}={replica_of.get(addr, addr)}")
                    how += f"  filtered out: {','.join(named)}"

            print(
                f"  {'*' if away else ' '}{float(request['sent_s']):7.2f} s"
                f"  c{request['conversation']:>4} turn {request['turn']}"
                f" -> {request['replica']}  {how}"
            )
    if unmatched:
        routed = sum(not bypassed(r) for r in requests)
        print(f"{unmatched} of {routed} routed requests matched no routed line")


if __name__ == "__main__":
    # Piped into `head` or `less`: end quietly when the reader stops.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
