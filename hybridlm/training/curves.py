"""Does a run's loss curve track a reference run's? (`python scripts/compare_runs.py A B`)

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
import sys
from dataclasses import dataclass


class CurveError(ValueError):
    """A metrics file that cannot be compared; the message is one sentence naming it."""


def load_losses(path: str) -> dict[int, float]:
    """iteration -> loss from a ``--metrics-file`` JSONL (records without a loss are skipped)."""
    losses: dict[int, float] = {}
    try:
        with open(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise CurveError(f"{path}, line {number}: not a JSON record (is this a --metrics-file?).") from None
                if "iteration" in record and record.get("loss") is not None:
                    losses[int(record["iteration"])] = float(record["loss"])
    except OSError as e:
        raise CurveError(f"{path}: cannot read it ({e.strerror}).") from None
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", help="metrics JSONL of the reference run (e.g. 1 GPU)")
    parser.add_argument("other", help="metrics JSONL of the run to check (e.g. 8 GPUs)")
    parser.add_argument("--window", type=int, default=10, help="steps per averaged window")
    parser.add_argument("--skip", type=int, default=0, help="ignore the first steps (warm-up)")
    parser.add_argument("--tolerance", type=float, default=0.02, help="largest allowed relative gap of windowed means")
    args = parser.parse_args(argv)
    if args.window < 1 or args.tolerance <= 0:
        print("error: --window must be positive and --tolerance greater than 0.", file=sys.stderr)
        return 2
    try:
        result = compare(load_losses(args.reference), load_losses(args.other), window=args.window, skip=args.skip)
    except CurveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'steps':>11s} {'reference':>10s} {'other':>10s} {'gap':>7s}")
    for first, last, ref, oth in result.windows:
        print(f"{first:>5d}-{last:<5d} {ref:10.4f} {oth:10.4f} {100 * abs(oth - ref) / abs(ref):6.2f}%")
    verdict = "tracks" if result.max_gap <= args.tolerance else "DIVERGES from"
    print(f"{args.other} {verdict} {args.reference}: largest windowed gap {100 * result.max_gap:.2f}% "
          f"(steps {result.worst_window[0]}-{result.worst_window[1]}; tolerance {100 * args.tolerance:.1f}%)")
    return 0 if result.max_gap <= args.tolerance else 1
