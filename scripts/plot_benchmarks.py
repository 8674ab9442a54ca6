"""Draw the committed bench results as charts: each system's % of the floor, per figure, per device.

    python scripts/plot_benchmarks.py [--results bench/results] [--out docs/img]

For every bench (decode, runtime, bundle, hostcall, stream) and device it takes the newest result file named
`<bench>-<device>-<YYYYMMDD>.json` (probe runs with longer names are left out) and writes
`<out>/<bench>-<device>.png`, which BENCHMARKS.md shows. 100% is the floor the same run measured
(bandwidth, a raw driver call, a bare ring); a bar's label carries the measured value. Run it again
whenever a result is committed. Needs matplotlib (`pip install 'warploop[plot]'`).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"^(decode|runtime|bundle|hostcall|stream)-([a-z0-9]+)-(\d{8})\.json$")

# bench -> figures: (title, unit, key path of the floor, {system: key path of its value}). Every value is a
# time (lower is better), so % of floor = floor / value. Paths are dotted keys into the result JSON.
FIGURES: dict[str, list[tuple[str, str, str, dict[str, str]]]] = {
    "decode": [
        ("decode ms/token, batch 1 (floor: weights / copy bandwidth)", "ms", "floor_ms",
         {"warploop streaming executor": "stream.ms_per_token_bs1", "megakernel": "megakernel.ms_per_token_bs1",
          "warploop (per-op)": "warploop.ms_per_token_bs1",
          "torch.compile": "torch_compile.ms_per_token_bs1", "HF eager": "hf_eager.ms_per_token_bs1"}),
    ],
    "runtime": [
        ("MLP stack, 16 x 2 GEMVs (floor: weights / copy bandwidth)", "us", "mlp_stack.floor_us",
         {"warploop runtime": "mlp_stack.warploop_us", "CUDA graph": "mlp_stack.cuda_graph_us",
          "torch eager": "mlp_stack.torch_eager_us"}),
        ("dependent hop across SMs (floor: hand-written counter hop)", "us", "handwritten_cross_hop_ns/1000",
         {"warploop runtime": "cross_worker_hop_us", "CUDA graph node": "cuda_graph_node_us"}),
    ],
    "bundle": [
        ("host time per launch (floor: raw cuLaunchKernel)", "us", "raw_launch_us",
         {"warploop, DeviceArrays": "launch_array_us", "warploop, torch": "launch_us", "Triton": "triton_launch_us"}),
        ("cold start to first correct result (floor: interpreter + CUDA context)", "s", "cold_start_floor_s",
         {"warploop bundle, no torch": "cold_start_s", "warploop bundle, torch": "cold_start_torch_s",
          "Triton JIT": "triton_cold_start_s"}),
    ],
    "stream": [
        ("weight stream ms (floor: weights / copy bandwidth)", "ms", "floor_ms",
         {"warploop streaming executor": "configs.0.ms", "torch ops, CUDA graph": "peer_torch_graph_ms"}),
    ],
    "hostcall": [
        ("GPU -> host call, p50 (floor: bare pinned-memory ring)", "us", "raw_roundtrip_us",
         {"warploop call": "call_p50_us"}),
    ],
}


def lookup(data: dict, path: str) -> float | None:
    """A dotted key path, optionally divided (`a.b/1000`); None where the run has no such figure."""
    path, _, divisor = path.partition("/")
    value = data
    for key in path.split("."):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
            continue
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        return None
    return value / float(divisor or 1)


def newest_results(results: Path) -> dict[tuple[str, str], Path]:
    """(bench, device) -> the newest result file."""
    newest: dict[tuple[str, str], tuple[str, Path]] = {}
    for file in results.glob("*.json"):
        m = NAME.match(file.name)
        if m and m.group(3) > newest.get((m.group(1), m.group(2)), ("", file))[0]:
            newest[(m.group(1), m.group(2))] = (m.group(3), file)
    return {key: file for key, (_, file) in sorted(newest.items())}


def panels_of(bench: str, data: dict) -> list[tuple[tuple, dict]]:
    """(figure, the data its paths read) for each panel: a decode run with `models` has a panel per
    model (the figure's title names it); an older run (no `models`) one panel."""
    if bench in ("decode", "stream") and isinstance(data.get("models"), dict):
        return [((f"{name}: {f[0]}", *f[1:]), entry) for name, entry in data["models"].items()
                for f in FIGURES[bench]]
    return [(f, data) for f in FIGURES[bench]]


def bars(data: dict, figure: tuple) -> tuple[float | None, list[tuple[str, float, float]]]:
    """(floor, [(system, value, % of floor)]) for the systems this run measured."""
    _, _, floor_path, systems = figure
    floor = lookup(data, floor_path)
    rows = []
    for name, path in systems.items():
        value = lookup(data, path)
        if value is not None and floor is not None:
            rows.append((name, value, 100.0 * floor / value))
    return floor, rows


def plot(bench: str, data: dict, out: Path) -> bool:
    """One PNG with a panel per figure; False when the run has none of the figures."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = [(f, *bars(d, f)) for f, d in panels_of(bench, data)]
    panels = [p for p in panels if p[2]]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.3 + 0.55 * sum(len(p[2]) + 1 for p in panels)),
                             squeeze=False)
    for ax, ((title, unit, _, _), floor, rows) in zip(axes[:, 0], panels, strict=True):
        names = [r[0] for r in rows][::-1]
        pcts = [r[2] for r in rows][::-1]
        ours = [n.startswith("warploop") or n == "megakernel" for n in names]
        ax.barh(names, pcts, color=["#2a6f97" if o else "#a0a0a0" for o in ours])
        for y, (pct, value) in enumerate(zip(pcts, [r[1] for r in rows][::-1], strict=True)):
            ax.text(pct + 1, y, f"{pct:.0f}%  ({value:.3g} {unit})", va="center", fontsize=8)
        ax.axvline(100, color="black", lw=0.8, ls="--")
        ax.set_xlim(0, 130)
        ax.set_title(f"{title}; floor {floor:.3g} {unit}", fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("% of the floor (100% = the floor; higher is better)", fontsize=8)
    fig.suptitle(f"warploop bench {bench}: {data.get('device')}, {data.get('date')}, torch "
                 f"{data.get('versions', {}).get('torch')}, Triton {data.get('versions', {}).get('triton')}",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"), help="folder of result JSON files")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder the PNGs are written to")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_benchmarks: needs matplotlib: pip install 'warploop[plot]'", file=sys.stderr)
        return 2
    found = newest_results(Path(args.results))
    if not found:
        print(f"plot_benchmarks: no <bench>-<device>-<YYYYMMDD>.json files in {args.results}", file=sys.stderr)
        return 1
    for (bench, device), file in found.items():
        out = Path(args.out) / f"{bench}-{device}.png"
        if plot(bench, json.loads(file.read_text()), out):
            print(f"{file.name} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
