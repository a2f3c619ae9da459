"""TTFT distribution per routing policy, from llmgw-bench-routing's ttft.json.

usage: plot_routing.py TTFT_JSON OUT_PNG

ttft.json lists {"policy", "ttft_ms"} per policy, in run order, TTFTs in milliseconds. The plot is one empirical
CDF per policy on a log time axis, with p50/p90/p99 marked by the grid lines at 0.5/0.9/0.99.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        samples = json.load(f)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for entry in samples:
        policy, ttfts = entry["policy"], entry["ttft_ms"]
        if not ttfts:
            continue
        ttfts = sorted(ttfts)
        n = len(ttfts)
        ys = [(i + 1) / n for i in range(n)]
        style = "-" if not policy.startswith("vllm-router") else "--"
        width = 2.4 if policy == "llmgw_precise" else 1.4
        ax.step(ttfts, ys, where="post", linestyle=style, linewidth=width, label=f"{policy} (n={n})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_yticks([0, 0.25, 0.5, 0.75, 0.9, 0.99])
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("TTFT per routing policy (make bench-routing)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2])
    print(f"wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
