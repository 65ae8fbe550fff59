"""Does a run's loss curve track a reference run's? (`python scripts/compare_runs.py A B`); and several runs'
logged figures side by side (`python scripts/compare_runs.py --series mfu,exposed_comm_share A B C [--plot out.png]`).

Two runs of the same model, data and seed in different layouts (8 GPUs against 1, bf16)
compute the same function only up to rounding, and rounding differences grow over hundreds
of steps; step-by-step equality is the oracle's job (fp32, few steps). Here the question is
the practical one: do the curves stay together? Each curve is averaged over windows of
``window`` steps (which also absorbs the per-step noise of the data order being identical
but the arithmetic not), and the largest relative gap between the windowed means, after the
first ``skip`` steps, must stay under ``tolerance``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass


class CurveError(ValueError):
    """A metrics file that cannot be compared; the message is one sentence naming it."""


def read_metrics(path: str) -> list[dict]:
    """The records of a ``--metrics-file`` JSONL, in file order."""
    records = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise CurveError(f"{path}, line {number}: not a JSON record (is this a --metrics-file?).") from None
    except OSError as e:
        raise CurveError(f"{path}: cannot read it ({e.strerror}).") from None
    return records


def load_losses(path: str) -> dict[int, float]:
    """iteration -> loss from a ``--metrics-file`` JSONL (records without a loss are skipped)."""
    losses = {int(r["iteration"]): float(r["loss"]) for r in read_metrics(path)
              if "iteration" in r and r.get("loss") is not None}
    if not losses:
        raise CurveError(f"{path}: no records with an iteration and a loss (was it written with --log-interval 1?).")
    return losses


@dataclass
class Comparison:
    windows: list[tuple[int, int, float, float]]  # (first step, last step, reference mean, other mean)
    max_gap: float  # largest |other - reference| / reference over the windows after ``skip``
    worst_window: tuple[int, int]


def compare(reference: dict[int, float], other: dict[int, float], *, window: int, skip: int) -> Comparison:
    common = sorted(set(reference) & set(other))
    missing = sorted(set(reference) ^ set(other))
    if missing:
        raise CurveError(f"the runs logged different iterations (first difference: {missing[0]}); "
                         "compare runs with the same --train-iters and --log-interval.")
    steps = [s for s in common if s > skip]
    if len(steps) < window:
        raise CurveError(f"only {len(steps)} common steps after --skip {skip}: fewer than one --window of {window}.")
    windows = []
    for start in range(0, len(steps) - window + 1, window):
        chunk = steps[start:start + window]
        windows.append((chunk[0], chunk[-1], sum(reference[s] for s in chunk) / window, sum(other[s] for s in chunk) / window))
    first, last, ref, oth = max(windows, key=lambda w: abs(w[3] - w[2]) / abs(w[2]))
    return Comparison(windows, abs(oth - ref) / abs(ref), (first, last))


def allowed_gap(tolerance: float, rounding_gap: float | None = None) -> float:
    """The largest windowed gap a run may show against the reference: ``tolerance`` beyond what rounding alone makes
    of the reference's own run. ``rounding_gap`` is a rounding-only control's largest windowed gap to the same
    reference (the reference's layout with, say, another micro-batch size: the same sums in another order), measured
    in the same call. A model whose training passes through a fast phase (a MoE model's routing, a memorised corpus)
    can turn rounding into gaps of several percent there, in any layout, one GPU's included; a fixed tolerance would
    then judge the reference run's luck, not the layout."""
    return tolerance + (rounding_gap or 0.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="metrics JSONL files: the reference run (e.g. 1 GPU) and the run to check "
                        "(e.g. 8 GPUs); with --series, any number of runs")
    parser.add_argument("--window", type=int, default=10, help="steps per averaged window")
    parser.add_argument("--skip", type=int, default=0, help="ignore the first steps (warm-up)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest allowed relative gap of windowed means")
    parser.add_argument("--control", default=None, help="a rounding-only control's metrics (the reference's layout with "
                        "another micro-batch size): the tolerance is counted beyond its own largest gap to the reference")
    parser.add_argument("--series", default=None, help="instead of the loss check, show these logged figures of every "
                        f"run side by side: a comma list, or 'monitor' for {','.join(DEFAULT_SERIES)}")
    parser.add_argument("--plot", default=None, help="with --series: also draw them against the iteration into this PNG")
    args = parser.parse_args(argv)
    try:
        if args.series is not None:
            names = DEFAULT_SERIES if args.series == "monitor" else [s.strip() for s in args.series.split(",") if s.strip()]
            return show_series(args.runs, list(names), skip=args.skip, plot_path=args.plot)
        if len(args.runs) != 2 or args.plot:
            raise CurveError("the loss check compares two runs (a reference and another) and draws nothing; "
                             "--series shows any number of runs and --plot draws them.")
        if args.window < 1 or args.tolerance <= 0:
            raise CurveError("--window must be positive and --tolerance greater than 0.")
        reference, other = args.runs
        result = compare(load_losses(reference), load_losses(other), window=args.window, skip=args.skip)
        control = compare(load_losses(reference), load_losses(args.control), window=args.window, skip=args.skip) \
            if args.control else None
    except CurveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'steps':>11s} {'reference':>10s} {'other':>10s} {'gap':>7s}")
    for first, last, ref, oth in result.windows:
        print(f"{first:>5d}-{last:<5d} {ref:10.4f} {oth:10.4f} {100 * abs(oth - ref) / abs(ref):6.2f}%")
    allowed = allowed_gap(args.tolerance, control.max_gap if control else None)
    verdict = "tracks" if result.max_gap <= allowed else "DIVERGES from"
    beyond = f", beyond the control's own {100 * control.max_gap:.2f}%: {100 * allowed:.2f}% in all" if control else ""
    print(f"{other} {verdict} {reference}: largest windowed gap {100 * result.max_gap:.2f}% "
          f"(steps {result.worst_window[0]}-{result.worst_window[1]}; tolerance {100 * args.tolerance:.1f}%{beyond})")
    return 0 if result.max_gap <= allowed else 1


# ---------------------------------------------------------------- several runs' logged figures side by side

DEFAULT_SERIES = ("loss", "mfu", "comm_share", "exposed_comm_share", "gpu_busy_share", "grad_noise_scale")


def load_series(path: str, names: list[str], skip: int = 0) -> dict[str, list[tuple[int, float]]]:
    """name -> [(iteration, value)] of a run's records after ``skip`` (the monitor's figures come only on the logged
    steps after a sampled one; a figure never logged has no points)."""
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for record in read_metrics(path):
        iteration = record.get("iteration")
        if iteration is None or iteration <= skip:
            continue
        for name in names:
            value = record.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series[name].append((int(iteration), float(value)))
    return series


def refuse_unlogged(paths: list[str], names: list[str]) -> None:
    """A figure no run ever logged (a mistyped name) is one sentence naming those they did log, not an empty row."""
    logged = {key for path in paths for record in read_metrics(path) for key, value in record.items()
              if isinstance(value, (int, float)) and not isinstance(value, bool)}
    unknown = [name for name in names if name not in logged]
    if unknown:
        import difflib
        near = difflib.get_close_matches(unknown[0], sorted(logged), n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise CurveError(f"--series {unknown[0]}: no run logged a figure of that name{hint}; they logged "
                         f"{', '.join(sorted(logged))}.")


def _number(name: str, value: float) -> str:
    share = name == "mfu" or name.endswith("_share") or name.endswith("utilization")
    return f"{100 * value:.1f}%" if share else f"{value:,.4g}"


def show_series(paths: list[str], names: list[str], *, skip: int = 0, plot_path: str | None = None) -> int:
    """Print, per figure, each run's count, first, median and last value after ``skip``; draw them if asked."""
    if not names:
        raise CurveError("--series names no figure; give a comma list such as mfu,exposed_comm_share.")
    refuse_unlogged(paths, names)
    runs = {path: load_series(path, names, skip) for path in paths}
    width = max(len(p) for p in paths) + 2
    for name in names:
        print(f"{name:<{width}s} {'values':>7s} {'first':>10s} {'median':>10s} {'last':>10s}")
        for path, series in runs.items():
            values = [v for _, v in series[name]]
            if values:
                cells = [_number(name, v) for v in (values[0], statistics.median(values), values[-1])]
            else:
                cells = ["-"] * 3
            print(f"  {path:<{width - 2}s} {len(values):>7d} " + " ".join(f"{c:>10s}" for c in cells))
    if plot_path:
        plot_series(runs, names, plot_path)
        print(f"wrote {plot_path}")
    return 0


def plot_series(runs: dict[str, dict], names: list[str], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CurveError("--plot needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib).") from None
    figure, axes = plt.subplots(len(names), 1, figsize=(8, 2.4 * len(names)), sharex=True, squeeze=False)
    for axis, name in zip(axes[:, 0], names):
        for label, series in runs.items():
            points = series[name]
            if points:
                axis.plot([i for i, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None,
                          label=label)
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    axes[-1, 0].set_xlabel("iteration")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
