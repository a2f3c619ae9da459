#!/usr/bin/env python3
"""A model of bench-routing's chat workload on the simulator's caches, to screen placement rules
in seconds instead of bench runs.

The simulator's prefix cache is an LRU over 16-token blocks, and bench-routing's prompts are a
tenant's system prompt followed by its conversation so far. So a replay of the requests in order,
each touching its prompt's blocks in one LRU per replica, gives about the hit rate the sims
count: over 123 measured runs, 0.45 points under on average with tenants drawn (sd 0.5) and 1.3
over with tenants in turn (sd 0.8), never more than 1.9 apart
(docs/results/2026-12-06-tenant-draws.md). The offset is about constant within a workload, so
the model ranks placements better than it matches hit rates. It leaves out the blocks running
requests pin, the sims' timing, load, and the routers' load scorers and splits.

    python3 bench/placement_model.py check OUT_DIR...
        replays each run's requests-POLICY.csv (the replicas it records) beside the hit rate
        the run measured (report.json)
    python3 bench/placement_model.py rules [--seeds 8] [--in-turn]
        places each tenant on its first request by each rule below, for 12 tenants drawn (or
        in turn) at 20 req/s on four caches of 160 blocks, over seeds 1..N
    python3 bench/placement_model.py optimum --seed S [--in-turn]
        the best fixed tenant -> replica assignment a local search finds, knowing every request
        in advance: what placement could reach with hindsight
    python3 bench/placement_model.py assignments --seed S [--in-turn]
        the hit rates of random fixed assignments (three tenants per cache; two or more)
    python3 bench/placement_model.py move --seed S [--at 10] [--in-turn]
        after packing, the one move of one tenant at that second that gains most (hindsight)
    python3 bench/placement_model.py shapes [--seeds 12] [--in-turn]
        fixed assignments built from each tenant's conversation count over the whole run
        (hindsight of the rates, not of the timing) in three shapes, beside packing, and
        2/2/4/4 built online: by arrival, then swapped by rates measured as the run goes
    python3 bench/placement_model.py splits RUN_DIR...
        each policy's split of the tenants in one run (bench-routing's OUT/run-N), replayed
        fixed on each policy's requests as that run sent them: the split's share of a gap
        between policies, apart from the timing's
    python3 bench/placement_model.py restart [--seeds 12]
        the restart scenario (8 tenants in turn, replica 0 down 12-15 s and back empty) with
        the down replica's two tenants waiting together on one survivor or on two

The workload is rebuilt here from the bench's own definitions (integration/src/workload.rs:
SplitMix64 arrivals, tenants in turn or drawn by a hash of the conversation's id and the seed,
five turns); the turns are spaced by a fixed reply time. Only `check` reads a run. When the
bench's workload changes, `workload` here must follow; `check` on a fresh run shows whether
the model still matches.
"""

import argparse
import collections
import csv
import json
import math
import os
import random
import sys

# Blocks of a conversation's first prompt (the system prompt and the first question), what
# each turn adds (question and reply), blocks per cache, seconds between turns.
FIRST_PROMPT_BLOCKS = 66
BLOCKS_PER_TURN = 2
CACHE_BLOCKS = 160
TURN_GAP_S = 0.085
WARMUP_S = 5.0
REPLICAS = 4

MASK = (1 << 64) - 1
TENANT_STREAM = 0x2545F4914F6CDD1D


def splitmix(x):
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def workload(seed, drawn, tenants=12, rate=20.0, turns=5, seconds=30.0):
    """The bench's requests: dicts of sent_s, tenant, conversation, turn, in sending order."""
    state, now, requests = seed, 0.0, []
    for conversation in range(1 << 20):
        z = splitmix(state)
        state = (state + 0x9E3779B97F4A7C15) & MASK
        uniform = ((z >> 11) + 1) / float(1 << 53)
        now += -math.log(uniform) / (rate / turns)
        if now >= seconds:
            break
        if drawn:
            tenant = splitmix(conversation ^ splitmix(seed ^ TENANT_STREAM)) % tenants
        else:
            tenant = conversation % tenants
        for turn in range(turns):
            requests.append(
                {"sent_s": now + turn * TURN_GAP_S, "tenant": tenant,
                 "conversation": conversation, "turn": turn})
    requests.sort(key=lambda r: r["sent_s"])
    return requests


def decayed(value, at, now, time_constant):
    return value * math.exp(-(now - at) / time_constant)


class Cache:
    """One replica's LRU, with what llmgw's `cache_footprint` reads of it: blocks held, blocks
    computed again within 10 s of their eviction (decayed, 10 s), placements (decayed, 300 s);
    and, for rules to try, its tenants and how many first turns found their system prompt
    (decayed, 10 s)."""

    def __init__(self):
        self.blocks = collections.OrderedDict()
        self.evicted_at = {}
        self.rebuilt, self.rebuilt_at = 0.0, 0.0
        self.placed, self.placed_at = 0.0, 0.0
        self.tenants = []
        self.first_turns, self.first_found, self.first_at = 0.0, 0.0, 0.0
        self.asked, self.asked_at = 0.0, 0.0

    def first_turns_found(self, now):
        """First turns lately, and how many of them found their system prompt here."""
        return (decayed(self.first_turns, self.first_at, now, 10.0),
                decayed(self.first_found, self.first_at, now, 10.0))

    def touch(self, block, now):
        """Whether `block` was cached; it is afterwards."""
        if block in self.blocks:
            self.blocks.move_to_end(block)
            return True
        if now - self.evicted_at.get(block, -1e9) < 10.0:
            self.rebuilt = decayed(self.rebuilt, self.rebuilt_at, now, 10.0) + 1
            self.rebuilt_at = now
        self.blocks[block] = True
        if len(self.blocks) > CACHE_BLOCKS:
            old, _ = self.blocks.popitem(last=False)
            self.evicted_at[old] = now
        return False

    def footprint(self, now):
        return len(self.blocks) + decayed(self.rebuilt, self.rebuilt_at, now, 10.0)

    def placements(self, now):
        return decayed(self.placed, self.placed_at, now, 300.0)


def serve(cache, request, now):
    """Blocks of `request`'s prompt found in `cache`, and blocks asked."""
    tenant, conversation, turn = request["tenant"], request["conversation"], request["turn"]
    if turn == 0:
        turns, found = cache.first_turns_found(now)
        cache.first_turns, cache.first_at = turns + 1, now
        cache.first_found = found + (("system", tenant, 0) in cache.blocks)
    prompt = [("system", tenant, i) for i in range(FIRST_PROMPT_BLOCKS - 1)]
    prompt += [("conversation", conversation, i) for i in range(BLOCKS_PER_TURN * turn + 1)]
    hits = sum(cache.touch(block, now) for block in prompt)
    cache.asked, cache.asked_at = decayed(cache.asked, cache.asked_at, now, 10.0) + len(prompt), now
    for i in range(BLOCKS_PER_TURN * turn + 1, BLOCKS_PER_TURN * (turn + 1) + 1):
        cache.touch(("conversation", conversation, i), now)  # the reply
    return hits, len(prompt)


def replay(requests, replica_of):
    """Hit rate (%) of the requests sent after the warm-up, each served where `replica_of`
    says (a negative replica: not served)."""
    caches = [Cache() for _ in range(REPLICAS)]
    hits = asked = 0
    for request in requests:
        replica = replica_of(request, caches)
        if replica < 0:
            continue
        h, a = serve(caches[replica], request, request["sent_s"])
        if request["sent_s"] >= WARMUP_S:
            hits, asked = hits + h, asked + a
    return 100.0 * hits / max(asked, 1)


def placing(rule, uncounted=3, move=None):
    """A `replica_of` that places each tenant on its first request by `rule(caches, now)` and
    keeps it there. The first `uncounted` placements are not counted, as llmgw's tree places
    them before any engine has reported a block. `move` (tenant, replica, seconds) sends a
    placed tenant elsewhere from then on."""
    home = {}

    def replica_of(request, caches):
        tenant, now = request["tenant"], request["sent_s"]
        if move and tenant == move[0] and now >= move[2] and tenant in home:
            home[tenant] = move[1]
        if tenant not in home:
            home[tenant] = rule(caches, now)
            cache = caches[home[tenant]]
            cache.tenants.append(tenant)
            if len(home) > uncounted:
                cache.placed, cache.placed_at = cache.placements(now) + 1, now
        return home[tenant]

    return replica_of


def packing(fill=0.9, max_share=1.5, pick=None):
    """llmgw's `cache_footprint`: the emptiest cache with room for the prompt; once none has,
    the fullest (by footprint, or by the blocks of the prompts placed there where those are
    more) whose footprint and placements stay within `max_share` times an even share
    (`pick` chooses among those instead, given the caches, now, footprints and candidates)."""

    def rule(caches, now):
        footprints = [c.footprint(now) for c in caches]
        with_room = [i for i, f in enumerate(footprints)
                     if f + FIRST_PROMPT_BLOCKS <= fill * CACHE_BLOCKS]
        if with_room:
            return min(with_room, key=lambda i: footprints[i])
        limit = max_share * (sum(footprints) + FIRST_PROMPT_BLOCKS) / len(caches)
        placed = [c.placements(now) for c in caches]
        placed_limit = max(1.0, max_share * (sum(placed) + 1) / len(caches))
        within = [i for i in range(len(caches))
                  if footprints[i] + FIRST_PROMPT_BLOCKS <= limit and placed[i] + 1 <= placed_limit]
        if not within:
            return min(range(len(caches)), key=lambda i: footprints[i])
        if pick:
            return pick(caches, now, footprints, within)
        # As full as its footprint, or as the prompts placed there where those are more.
        return max(within, key=lambda i: max(footprints[i], placed[i] * FIRST_PROMPT_BLOCKS))

    return rule


def emptiest(caches, now):
    return min(range(len(caches)), key=lambda i: caches[i].footprint(now))


def fewest_tenants(caches, now, footprints, within):
    return min(within, key=lambda i: (len(caches[i].tenants), -footprints[i]))


def spread_while_prompts_survive(threshold=0.5, least_first_turns=3.0):
    """Packing's choice, unless the caches holding three tenants or more show that first
    turns mostly still find their system prompt there (over `threshold` of at least
    `least_first_turns` lately): prompts then come back at random, not in a cycle, and a cache
    with fewer tenants loses less by one more. Until that is seen, it packs: in bench-routing's
    in-turn workload every tenant arrives before it is, so there it is packing."""

    def pick(caches, now, footprints, within):
        crowded = [caches[i].first_turns_found(now) for i in range(len(caches))
                   if len(caches[i].tenants) >= 3]
        turns, found = sum(t for t, _ in crowded), sum(f for _, f in crowded)
        if turns >= least_first_turns and found > threshold * turns:
            return fewest_tenants(caches, now, footprints, within)
        return max(within, key=lambda i: footprints[i])

    return pick


def spread_while_churn_is_low(threshold=0.1, least_asked=3 * FIRST_PROMPT_BLOCKS):
    """The same switch with what llmgw's index counts instead of first turns: spread while the
    caches of three tenants or more rebuild under `threshold` of the blocks asked of them
    lately (once `least_asked` blocks were), pack otherwise."""

    def pick(caches, now, footprints, within):
        crowded = [c for c in caches if len(c.tenants) >= 3]
        rebuilt = sum(decayed(c.rebuilt, c.rebuilt_at, now, 10.0) for c in crowded)
        asked = sum(decayed(c.asked, c.asked_at, now, 10.0) for c in crowded)
        if asked >= least_asked and rebuilt < threshold * asked:
            return fewest_tenants(caches, now, footprints, within)
        return max(within, key=lambda i: footprints[i])

    return pick


RULES = {
    "packing (llmgw's default)": packing(),
    "packing, share 1.25": packing(max_share=1.25),
    "packing onto the fewest tenants": packing(pick=fewest_tenants),
    "spreading while prompts survive": packing(pick=spread_while_prompts_survive()),
    "spreading while churn is low": packing(pick=spread_while_churn_is_low()),
    "emptiest (packing off)": emptiest,
}


def recorded(path):
    """A run's requests (requests-POLICY.csv) in sending order, with the replica each went to."""
    with open(path) as f:
        rows = [{"sent_s": float(r["sent_s"]), "tenant": int(r["tenant"]),
                 "conversation": int(r["conversation"]), "turn": int(r["turn"]),
                 "replica": int(r["replica"])} for r in csv.DictReader(f)]
    rows.sort(key=lambda r: r["sent_s"])
    return rows


def split_of(requests):
    """Each tenant's replica: the one most of its requests went to."""
    counts = collections.defaultdict(collections.Counter)
    for r in requests:
        counts[r["tenant"]][r["replica"]] += 1
    return {tenant: c.most_common(1)[0][0] for tenant, c in counts.items()}


def splits(run_dirs):
    """Separates where a run's tenants went from the run's timing: each policy's split (every
    tenant on the replica most of its requests went to), replayed fixed on the requests as each
    policy's run sent them. The sims' turns wait for the replies, so a policy whose caches
    compute more also spaces its turns differently; the diagonal is each policy as it ran,
    less the requests it sent away from a tenant's replica."""
    for run_dir in run_dirs:
        runs = {}
        for name in sorted(os.listdir(run_dir)):
            if name.startswith("requests-") and name.endswith(".csv"):
                runs[name[len("requests-"):-len(".csv")]] = recorded(os.path.join(run_dir, name))
        if not runs:
            print(f"{run_dir}: no requests-POLICY.csv, not a bench-routing run directory",
                  file=sys.stderr)
            continue
        print(run_dir)
        for policy, requests in runs.items():
            split = split_of(requests)
            groups = [" ".join(f"t{t}" for t in sorted(split) if split[t] == replica)
                      for replica in range(REPLICAS)]
            print(f"  {policy:24s} as routed {replay(requests, lambda r, _: r['replica']):5.2f} %"
                  f"  split {' | '.join(groups)}")
            for timing, timed in runs.items():
                fixed = replay(timed, lambda r, _: split.get(r["tenant"], -1))
                print(f"    {'fixed, on ' + timing + ' timing':40s} {fixed:5.2f} %")


def check(directories):
    for directory in directories:
        report_path = os.path.join(directory, "report.json")
        if not os.path.isfile(report_path):
            print(f"{directory}: no report.json, not a bench-routing output directory",
                  file=sys.stderr)
            continue
        with open(report_path) as f:
            report = json.load(f)
        for entry in report:
            run_dir = directory
            if os.path.isdir(os.path.join(directory, f"run-{entry.get('run', 1)}")):
                run_dir = os.path.join(directory, f"run-{entry['run']}")
            path = os.path.join(run_dir, f"requests-{entry['policy']}.csv")
            if not os.path.exists(path):
                continue
            model = replay(recorded(path), lambda r, _: r["replica"])
            measured = 100.0 * entry["hit_rate"]
            print(f"{run_dir}  {entry['policy']:24s} measured {measured:5.1f} %  "
                  f"model {model:5.1f} %  ({model - measured:+.1f})")


def rules(seeds, drawn):
    print(f"12 tenants {'drawn' if drawn else 'in turn'}, seeds 1-{seeds}: hit rate (%) per seed")
    for name, rule in RULES.items():
        results = [replay(workload(s, drawn), placing(rule)) for s in range(1, seeds + 1)]
        print(f"  {name:34s} mean {sum(results) / len(results):5.2f} | "
              + " ".join(f"{r:.1f}" for r in results))


def optimum(seed, drawn, tenants=12, starts=2):
    requests = workload(seed, drawn)

    def score(assignment):
        return replay(requests, lambda r, _: assignment[r["tenant"]])

    rng = random.Random(seed)
    best = None
    for _ in range(starts):
        assignment = [t % REPLICAS for t in range(tenants)]
        rng.shuffle(assignment)
        current = score(assignment)
        improved = True
        while improved:
            improved = False
            moves = [(t, r) for t in range(tenants) for r in range(REPLICAS)]
            swaps = [(t, u) for t in range(tenants) for u in range(t + 1, tenants)]
            for t, r in moves:
                if assignment[t] != r:
                    trial = assignment[:]
                    trial[t] = r
                    s = score(trial)
                    if s > current + 1e-9:
                        assignment, current, improved = trial, s, True
            for t, u in swaps:
                if assignment[t] != assignment[u]:
                    trial = assignment[:]
                    trial[t], trial[u] = trial[u], trial[t]
                    s = score(trial)
                    if s > current + 1e-9:
                        assignment, current, improved = trial, s, True
        if best is None or current > best[0]:
            best = (current, assignment)
    groups = collections.defaultdict(list)
    for tenant, replica in enumerate(best[1]):
        groups[replica].append(f"t{tenant}")
    shape = " | ".join(" ".join(g) for _, g in sorted(groups.items()))
    print(f"seed {seed}, {'drawn' if drawn else 'in turn'}: {best[0]:.1f} %  ({shape})")


def assignments(seed, drawn, samples=150, tenants=12):
    """The hit rates of random fixed assignments: `samples` with three tenants per cache, and
    `samples` with two or more per cache."""
    requests = workload(seed, drawn)
    rng = random.Random(0)

    def rate(assignment):
        return replay(requests, lambda r, _: assignment[r["tenant"]])

    even = []
    for _ in range(samples):
        assignment = [t % REPLICAS for t in range(tenants)]
        rng.shuffle(assignment)
        even.append(rate(assignment))
    uneven = []
    while len(uneven) < samples:
        assignment = [rng.randrange(REPLICAS) for _ in range(tenants)]
        counts = collections.Counter(assignment)
        if len(counts) == REPLICAS and min(counts.values()) >= 2:
            uneven.append(rate(assignment))
    for name, rates in (("3/3/3/3", even), ("two or more per cache", uneven)):
        print(f"seed {seed}, {name}: min {min(rates):.1f} mean {sum(rates) / len(rates):.1f} "
              f"max {max(rates):.1f} %")
    packed = replay(requests, placing(RULES["packing (llmgw's default)"]))
    print(f"seed {seed}, packing: {packed:.1f} %")


def best_move(seed, drawn, at=10.0, tenants=12):
    """After packing, the one move of one tenant at `at` s that gains most, with hindsight."""
    requests = workload(seed, drawn)
    rule = RULES["packing (llmgw's default)"]
    homes = {}

    def record(request, caches, place=placing(rule)):
        replica = place(request, caches)
        homes[request["tenant"]] = replica
        return replica

    base = replay(requests, record)
    at_time = dict(homes)
    best = max((replay(requests, placing(rule, move=(t, r, at))), t, r)
               for t in range(tenants) for r in range(REPLICAS) if r != at_time.get(t))
    print(f"seed {seed}, {'drawn' if drawn else 'in turn'}: packing {base:.1f} %, best move at "
          f"{at:g} s t{best[1]} -> {best[2]}: {best[0]:.1f} %")


SHAPES = {
    # The eight busiest two to a cache (busiest with the least busy of them), the other four
    # one to a cache.
    "3/3/3/3, the busiest paired": lambda order: {
        t: (i if i < 4 else 7 - i) if i < 8 else i - 8 for i, t in enumerate(order)},
    # The four busiest two to a cache on two caches, the other eight four to a cache.
    "2/2/4/4, the busiest alone": lambda order: {
        t: i // 2 if i < 4 else 2 + i % 2 for i, t in enumerate(order)},
    # The six busiest two to a cache, the other six on the last cache.
    "2/2/2/6": lambda order: {t: min(i // 2, 3) for i, t in enumerate(order)},
}


def pairs_then_swaps(margin=2.0, start=6.0, every=2.0):
    """Online: the first four tenants two to a cache on two caches, the others four to a cache
    on the other two; then, at a conversation's first turn (at most every `every` s, from
    `start` s on), the least busy tenant of a pair trades places with the busiest sharing
    tenant seen on three first turns or more, if that one's first turns per second (measured
    since its first request, over 3 s at least) are over `margin` times its own."""
    home, first_seen, first_turns, last_plan = {}, {}, collections.Counter(), [0.0]

    def rate(tenant, now):
        return first_turns[tenant] / max(now - first_seen[tenant], 3.0)

    def replica_of(request, caches):
        tenant, now = request["tenant"], request["sent_s"]
        first_seen.setdefault(tenant, now)
        if request["turn"] == 0:
            first_turns[tenant] += 1
        if tenant not in home:
            placed = len(home)
            home[tenant] = placed // 2 if placed < 4 else 2 + placed % 2
        if request["turn"] == 0 and now >= start and now - last_plan[0] >= every:
            last_plan[0] = now
            groups = collections.defaultdict(list)
            for t, replica in home.items():
                groups[replica].append(t)
            paired = [t for ts in groups.values() if len(ts) <= 2 for t in ts]
            sharing = [t for ts in groups.values() if len(ts) > 2 for t in ts
                       if first_turns[t] >= 3]
            if paired and sharing:
                quiet = min(paired, key=lambda t: rate(t, now))
                busy = max(sharing, key=lambda t: rate(t, now))
                if rate(busy, now) > margin * rate(quiet, now):
                    home[quiet], home[busy] = home[busy], home[quiet]
        return home[tenant]

    return replica_of


def shapes(seeds, drawn, tenants=12):
    """Assignments that know each tenant's share of the conversations in advance: what
    placement could gain from measuring tenants' rates, if measuring cost nothing."""
    print(f"12 tenants {'drawn' if drawn else 'in turn'}, seeds 1-{seeds}: hit rate (%) per seed")
    results = collections.defaultdict(list)
    for seed in range(1, seeds + 1):
        requests = workload(seed, drawn)
        conversations = collections.Counter(r["tenant"] for r in requests if r["turn"] == 0)
        order = sorted(range(tenants), key=lambda t: -conversations[t])
        results["packing (llmgw's default)"].append(
            replay(requests, placing(RULES["packing (llmgw's default)"])))
        for name, shape in SHAPES.items():
            assignment = shape(order)
            results[name].append(replay(requests, lambda r, _: assignment[r["tenant"]]))
        results["2/2/4/4 by arrival, no hindsight"].append(
            replay(requests, pairs_then_swaps(margin=math.inf)))
        results["the same, swapped by measured rates"].append(
            replay(requests, pairs_then_swaps()))
    packed = results["packing (llmgw's default)"]
    for name, rates in results.items():
        under = sum(r < p for r, p in zip(rates, packed))
        print(f"  {name:36s} mean {sum(rates) / len(rates):5.2f} | "
              + " ".join(f"{r:.1f}" for r in rates)
              + ("" if rates is packed else f"  (under packing on {under})"))


def failover(seed, refuges, tenants=8, down_s=12.0, up_s=15.0):
    """Hit rate (%) of the restart scenario with tenant t at home on replica t % 4, replica 0
    down from `down_s` to `up_s` and back empty: a conversation of a tenant whose home is down
    goes to `refuges[tenant]` and stays there to its end; new conversations go home."""
    caches = [Cache() for _ in range(REPLICAS)]
    replica_of_conversation, restarted = {}, False
    hits = asked = 0
    for request in workload(seed, False, tenants=tenants):
        now, tenant = request["sent_s"], request["tenant"]
        if now >= up_s and not restarted:
            caches[0], restarted = Cache(), True
        down = down_s <= now < up_s
        conversation = request["conversation"]
        if request["turn"] == 0:
            replica_of_conversation[conversation] = tenant % REPLICAS
        if down and replica_of_conversation[conversation] == 0:
            replica_of_conversation[conversation] = refuges[tenant]
        h, a = serve(caches[replica_of_conversation[conversation]], request, now)
        if now >= WARMUP_S:
            hits, asked = hits + h, asked + a
    return 100.0 * hits / max(asked, 1)


def restart(seeds):
    """Where the tenants of a replica that goes down wait: both on one survivor (as the bench's
    `pinned_failover` does) or one on each of two."""
    print(f"8 tenants in turn, replica 0 (t0, t4) down 12-15 s, seeds 1-{seeds}: hit rate (%)")
    for name, refuges in [("both on replica 1", {0: 1, 4: 1}),
                          ("both on replica 2", {0: 2, 4: 2}),
                          ("on replicas 1 and 2", {0: 1, 4: 2}),
                          ("on replicas 2 and 3", {0: 2, 4: 3}),
                          ("on replicas 1 and 3", {0: 1, 4: 3})]:
        rates = [failover(seed, refuges) for seed in range(1, seeds + 1)]
        print(f"  {name:20s} mean {sum(rates) / len(rates):5.2f} | "
              + " ".join(f"{r:.1f}" for r in rates))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="replay bench-routing runs beside their measured hit rate")
    c.add_argument("directories", nargs="+")
    r = sub.add_parser("rules", help="the placement rules over synthetic seeds")
    r.add_argument("--seeds", type=int, default=8)
    r.add_argument("--in-turn", action="store_true")
    o = sub.add_parser("optimum", help="the best fixed assignment with hindsight")
    o.add_argument("--seed", type=int, required=True)
    o.add_argument("--in-turn", action="store_true")
    a = sub.add_parser("assignments", help="hit rates of random fixed assignments")
    a.add_argument("--seed", type=int, required=True)
    a.add_argument("--in-turn", action="store_true")
    m = sub.add_parser("move", help="the best single move of a tenant, with hindsight")
    m.add_argument("--seed", type=int, required=True)
    m.add_argument("--at", type=float, default=10.0)
    m.add_argument("--in-turn", action="store_true")
    h = sub.add_parser("shapes", help="fixed assignments that know the tenants' rates")
    h.add_argument("--seeds", type=int, default=12)
    h.add_argument("--in-turn", action="store_true")
    s = sub.add_parser("splits", help="each policy's tenant split, replayed on each run's timing")
    s.add_argument("run_dirs", nargs="+")
    f = sub.add_parser("restart", help="a restarted replica's tenants: together or apart")
    f.add_argument("--seeds", type=int, default=12)
    args = parser.parse_args()
    if args.command == "check":
        check(args.directories)
    elif args.command == "splits":
        splits(args.run_dirs)
    elif args.command == "rules":
        rules(args.seeds, not args.in_turn)
    elif args.command == "assignments":
        assignments(args.seed, not args.in_turn)
    elif args.command == "shapes":
        shapes(args.seeds, not args.in_turn)
    elif args.command == "restart":
        restart(args.seeds)
    elif args.command == "move":
        best_move(args.seed, not args.in_turn, args.at)
    else:
        optimum(args.seed, not args.in_turn)


if __name__ == "__main__":
    sys.exit(main())
