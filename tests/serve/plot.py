"""Draws the serve benchmark's figures (serve.py --json OUT) as an SVG:
for each system, the share of requests whose first token came within t
(a cumulative distribution of the time to first token). No plotting
library: plain SVG text.

Usage: plot.py SERVE_JSON OUT_SVG
"""

import json
import sys

COLORS = ["#1b6ac9", "#d9480f", "#2b8a3e", "#862e9c", "#495057"]
W, H = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 60


def main(src, out):
    d = json.load(open(src))
    results = d["results"]
    top = max(r["ttft"] for res in results for r in res["records"] if r["ttft"] is not None)
    step = 30 if top > 120 else 10
    xmax = (int(top // step) + 1) * step
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(t):
        return LEFT + pw * t / xmax

    def y(f):
        return TOP + ph * (1 - f)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">Time to first token, {d["requests"]} '
             f'requests of one trace, budget {d["budget"] / 1e6:.0f} MB (share of requests answered within t)</text>']
    for t in range(0, xmax + 1, step):
        parts.append(f'<line x1="{x(t):.1f}" y1="{TOP}" x2="{x(t):.1f}" y2="{TOP + ph}" stroke="#eee"/>')
        parts.append(f'<text x="{x(t):.1f}" y="{TOP + ph + 16}" text-anchor="middle">{t}</text>')
    for f in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{LEFT}" y1="{y(f):.1f}" x2="{LEFT + pw}" y2="{y(f):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(f) + 4:.1f}" text-anchor="end">{int(f * 100)}%</text>')
    parts.append(f'<text x="{LEFT + pw / 2}" y="{H - 20}" text-anchor="middle">t, seconds</text>')
    for i, res in enumerate(results):
        ttft = sorted(r["ttft"] for r in res["records"] if r["ttft"] is not None)
        n = len(res["records"])
        points = [(x(0), y(0))]
        for k, t in enumerate(ttft):
            points.append((x(t), y(k / n)))
            points.append((x(t), y((k + 1) / n)))
        points.append((x(xmax), y(len(ttft) / n)))
        c = COLORS[i % len(COLORS)]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{path}"/>')
        # The legend, top left: where a distribution has no points.
        ly = TOP + 14 + 18 * i
        parts.append(f'<line x1="{LEFT + 10}" y1="{ly}" x2="{LEFT + 35}" y2="{ly}" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{LEFT + 40}" y="{ly + 4}">{res["system"]} (p50 {res["ttft_p50"]:.0f} s)</text>')
    parts.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(parts) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
