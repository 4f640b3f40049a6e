"""Plot ``mlfabric_convergence.py --curves`` output: training loss (or accuracy) over time, as SVG.

``python -m benchmarks.plot_curves curves.jsonl -o loss.svg [--metric loss|accuracy] [--setting S]``
draws one line per run, one colour per kind, with the target loss as a dashed line. No
plotting library needed: the SVG is written by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLOURS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 720, 420, 60, 170, 30, 45


def load(path: Path, setting: str | None) -> list[dict]:
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in runs if setting is None or r.get("setting") == setting]


def svg(runs: list[dict], metric: str, title: str, target: float | None) -> str:
    """The plot of ``metric`` over ``t`` for every run."""
    points = [(p["t"], p[metric]) for r in runs for p in r["curve"] if p.get(metric) is not None]
    if not points:
        raise ValueError("no points to plot")
    t_max = max(t for t, _ in points) or 1.0
    y_max = max(v for _, v in points) if metric == "loss" else 1.0
    y_min = 0.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + plot_w * t / t_max

    def y(v: float) -> float:
        return TOP + plot_h * (1 - (v - y_min) / ((y_max - y_min) or 1.0))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="18" text-anchor="middle">{title}</text>',
           f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="black"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="black"/>']
    for i in range(6):
        t, v = t_max * i / 5, y_min + (y_max - y_min) * i / 5
        out.append(f'<text x="{x(t):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{t:.0f}</text>')
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 8}" text-anchor="middle">seconds since all '
               f'workers joined</text>')
    out.append(f'<text x="14" y="{TOP + plot_h / 2}" transform="rotate(-90 14 {TOP + plot_h / 2})" '
               f'text-anchor="middle">{metric}</text>')
    if target is not None and metric == "loss" and y_min <= target <= y_max:
        out.append(f'<line x1="{LEFT}" y1="{y(target):.1f}" x2="{LEFT + plot_w}" y2="{y(target):.1f}" '
                   f'stroke="grey" stroke-dasharray="4 4"/>')
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    for run in runs:
        colour = COLOURS[kinds.index(run["kind"]) % len(COLOURS)]
        path = " ".join(f"{x(p['t']):.1f},{y(p[metric]):.1f}" for p in run["curve"] if p.get(metric) is not None)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" opacity="0.8" points="{path}"/>')
    for i, kind in enumerate(kinds):
        ly = TOP + 10 + 18 * i
        colour = COLOURS[i % len(COLOURS)]
        out.append(f'<line x1="{WIDTH - RIGHT + 15}" y1="{ly}" x2="{WIDTH - RIGHT + 40}" y2="{ly}" '
                   f'stroke="{colour}" stroke-width="3"/>')
        out.append(f'<text x="{WIDTH - RIGHT + 46}" y="{ly + 4}">{kind}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("curves", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--metric", choices=("loss", "accuracy"), default="loss")
    parser.add_argument("--setting", help="only the runs of this setting")
    parser.add_argument("--title", default="")
    parser.add_argument("--target", type=float, default=0.2, help="the target loss, drawn dashed")
    args = parser.parse_args(argv)
    runs = load(args.curves, args.setting)
    if not runs:
        print(f"no runs in {args.curves}" + (f" for setting {args.setting!r}" if args.setting else ""), file=sys.stderr)
        return 2
    args.output.write_text(svg(runs, args.metric, args.title or f"{args.metric} over time", args.target))
    print(f"{args.output}: {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
