"""python -m benchmarks run | render | list

  run     --suite NAME or --cases A,B [--systems hybridlm,megatron-lm] [--out DIR] [--profile] [--budget-s S]
          every run of those cases on this machine, records in DIR/records.jsonl, a table printed last
  render  [--add RECORDS.jsonl ...] [--check] [--no-plot]
          file a call's records under benchmarks/records/, then render RESULTS.md, the README's table, the plot;
          --check renders nothing and exits 1 if RESULTS.md or the README's table is not what the records give
  list    [--suite NAME]   the cases, their GPUs, peers and what they run
"""
from __future__ import annotations

import argparse
import sys

from . import records as stored
from . import render
from .cases import CASES, SUITES, select
from .runner import Call, run


def _run(args) -> int:
    try:
        cases = select(args.suite, args.cases)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    systems = {s.strip() for s in args.systems.split(",")} if args.systems else None
    call = Call(out=args.out, profile=args.profile, budget_s=args.budget_s, megatron_src=args.megatron)
    done = run(cases, call, systems)
    return 0 if done and all(r.get("status") == "ok" for r in done) and not call.not_run else 1


def _render(args) -> int:
    for path in args.add or []:
        for written in stored.store(stored.read(path)):
            print(f"filed {written}")
    records = stored.load_all()
    if args.check:
        stale = render.stale(records)
        for path in stale:
            print(f"{path} is not what benchmarks/records/ renders: run python -m benchmarks render", file=sys.stderr)
        return 1 if stale else 0
    for path in render.write(records, with_plot=not args.no_plot):
        print(f"wrote {path}")
    return 0


def _list(args) -> int:
    for case in CASES:
        if args.suite and case.suite != args.suite:
            continue
        what = " ".join(case.script) if case.script else f"--model {case.model} " + " ".join(case.flags)
        peers = f" | peers: {', '.join(case.peers)}" if case.peers else ""
        print(f"{case.name:<20} {case.suite:<12} {case.gpus} GPU{'s' if case.gpus != 1 else ''}{peers}\n    {case.label}\n    {what}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run cases and write their records")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--suite", choices=list(SUITES))
    which.add_argument("--cases", help="comma list of case names")
    p.add_argument("--systems", default=None, help="only these of hybridlm and the peers (comma list)")
    p.add_argument("--out", default="bench_out", help="folder for records.jsonl, logs.tar.gz and table.md ($OUT on the GPU machine)")
    p.add_argument("--profile", action="store_true", help="profile hybridlm's last two timed steps (a summary in each record)")
    p.add_argument("--budget-s", type=float, default=None, help="start no run the call has too little time left for")
    p.add_argument("--megatron", default=None, help="Megatron-LM's source (default: $MEGATRON_LM, else .device/megatron)")
    p.set_defaults(func=_run)
    p = sub.add_parser("render", help="render RESULTS.md, the README's table and the plot from the records")
    p.add_argument("--add", nargs="*", help="records.jsonl files of calls to file under benchmarks/records/ first")
    p.add_argument("--check", action="store_true", help="only check that the rendered files are current")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (matplotlib: pip install -e '.[bench]')")
    p.set_defaults(func=_render)
    p = sub.add_parser("list", help="the cases")
    p.add_argument("--suite", choices=list(SUITES))
    p.set_defaults(func=_list)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
