"""Requests/s and added p99 against concurrency, from llmgw-bench-throughput's JSON.

usage: plot_throughput.py RESULTS_JSON OUT_PNG

The JSON lists one row per (prompt_bytes, clients, path) with requests_per_s and added_p99_ms
(null for the baseline). The plot has one row of two panels per prompt size: throughput per path
(the baseline, Envoy round robin without ext_proc, included), and the p99 each routed path adds
over the baseline at the same concurrency. Both x axes are the number of closed-loop clients, on
a log scale.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(size: int) -> str:
    return f"{size // 1024} KB" if size >= 1024 else f"{size} B"


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        rows = json.load(f)
    sizes = sorted({r["prompt_bytes"] for r in rows})
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 4.2 * len(sizes)), dpi=110, squeeze=False)
    colors = {path: f"C{i}" for i, path in enumerate(paths)}
    for (rps_ax, p99_ax), size in zip(axes, sizes):
        for path in paths:
            points = sorted(
                (r["clients"], r["requests_per_s"], r["added_p99_ms"])
                for r in rows
                if r["prompt_bytes"] == size and r["path"] == path
            )
            if not points:
                continue
            clients = [p[0] for p in points]
            style = "--" if path.startswith("floor") else (":" if path == "baseline" else "-")
            width = 2.4 if path == "buffered 1 core" else 1.4
            line = {"marker": "o", "linewidth": width, "color": colors[path], "label": path}
            rps_ax.plot(clients, [p[1] for p in points], style, **line)
            if path != "baseline":
                p99_ax.plot(clients, [p[2] for p in points], style, **line)
        ticks = sorted({r["clients"] for r in rows if r["prompt_bytes"] == size})
        for ax in (rps_ax, p99_ax):
            ax.set_xscale("log")
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("closed-loop clients (log scale)")
            ax.grid(True, which="both", alpha=0.3)
        rps_ax.set_ylabel("requests/s through the gateway")
        rps_ax.set_title(f"{label(size)} prompts: throughput")
        p99_ax.set_ylabel("added p99 over Envoy round robin (ms)")
        p99_ax.set_title(f"{label(size)} prompts: added p99")
        p99_ax.axhline(0, color="black", linewidth=0.6)
        rps_ax.legend(fontsize=8)
    fig.suptitle("llmgw under closed-loop load (make bench-throughput)")
    fig.tight_layout()
    fig.savefig(sys.argv[2])
    print(f"wrote {sys.argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
