"""RESULTS.md, the README's headline and layouts tables and the plots, rendered from the records.

Nothing here measures: every figure comes from a record (benchmarks/records/*.jsonl), and
``python -m benchmarks render --check`` (a test runs it) fails when RESULTS.md or the README's
table is not what the records render, so the two cannot disagree with the records or each other.
"""
from __future__ import annotations

import os
from typing import Optional

from .cases import BY_NAME, CASES, SUITES
from .records import HERE, step_spread, throughput

ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "RESULTS.md")
README = os.path.join(ROOT, "README.md")
PLOT = os.path.join(HERE, "headline.png")
CURVES = os.path.join(HERE, "curves.png")
BEGIN = "<!-- headline table: rendered by `python -m benchmarks render` from benchmarks/records/ (do not edit by hand) -->"
END = "<!-- end of the headline table -->"
LAYOUTS_BEGIN = ("<!-- layouts table: rendered by `python -m benchmarks render` from benchmarks/records/ "
                 "(do not edit by hand) -->")
LAYOUTS_END = "<!-- end of the layouts table -->"
RULES = {"current": "new", "re-derived (new rule)": "re-derived", "old rule": "old"}

INTRO = """# Benchmark results

Rendered by `python -m benchmarks render` from the records in `benchmarks/records/` (one JSON line
per run); edit the records or the cases (`benchmarks/cases.py`), never this file. One row per run,
newest first, grouped by suite; each row's command is listed once under its table (`c1`, `c2`, ...).
A suite runs with `python -m benchmarks run --suite NAME`, a case with `--cases NAME`.

Throughput is per GPU; a figure is the median of the timed steps after the warm-up, and *per-step*
gives the slowest and fastest timed step. **TFLOP/s and MFU** are recomputed from the measured
tokens/s by `hybridlm.training.metrics.flops_per_token` of the run's model flags (the function the
trainer logs with) over the run's peak (dense bf16: 989 TFLOP/s on H100/H200; FP8 runs too). The
*rule* column says how: `new`, logged by the current rule; `re-derived`, recomputed by the current
rule from the run's tokens/s (the run logged them by the rule of its day, which may differ); `old`,
as published then (the model cannot be rebuilt from the command). *hybridlm / peer* is
hybridlm's tokens/s over the peer's for the same case, from the same call unless it says otherwise.
Peers: `megatron-lm` (Megatron-LM's pretrain_gpt.py, mock data, the same model; its flags in
`benchmarks/megatron.py`), `torch` / `torch-compile` (this model as a plain PyTorch module, fused
AdamW, bf16 autocast), `hf-zero2` (Hugging Face Llama under DeepSpeed ZeRO-2).

Rows dated before 2026-11-25 were converted from this file's earlier hand-written rows (one per
figure), one record per run: the run's figures merged, its command kept as it was typed then.
"""


def newest_first(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: (r.get("date", ""), r.get("time") or "", r.get("_order", 0)), reverse=True)


def _num(value: Optional[float], fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _ratio_base(record: dict, records: list[dict]) -> tuple[Optional[dict], bool]:
    """The hybridlm record a peer's ratio divides: the same call's, else the newest of the case (and False)."""
    ours = [r for r in records if r["system"] == "hybridlm" and r.get("status", "ok") == "ok"
            and r.get("case") == record.get("case") and r.get("tokens_per_sec_per_gpu")]
    same = [r for r in ours if r.get("call") == record.get("call")]
    if same:
        return same[0], True
    if record.get("case") and ours:
        return newest_first(ours)[0], False
    return None, False


def ratio(record: dict, records: list[dict]) -> str:
    if record["system"] == "hybridlm" or not record.get("tokens_per_sec_per_gpu"):
        return ""
    base, same = _ratio_base(record, records)
    if base is None:
        return ""
    text = f"{base['tokens_per_sec_per_gpu'] / record['tokens_per_sec_per_gpu']:.2f}x"
    return text if same else f"{text} (different calls: hybridlm's of {base['date']})"


def _throughput_row(r: dict, records: list[dict]) -> list[str]:
    if r.get("status", "ok") != "ok":
        return [f"failed: {r.get('error', '')}", "", "", "", "", "", ""]
    t = throughput(r)
    spread = step_spread(r)
    return [_num(t.tokens_per_sec_per_gpu, ",.0f"), _num(t.tflops_per_gpu, ".1f"),
            "" if t.mfu is None else f"{100 * t.mfu:.1f}%", RULES[t.rule], _num(r.get("peak_memory_gib"), ".1f"),
            f"{spread[0]:,.0f}-{spread[1]:,.0f}" if spread else "", ratio(r, records)]


def _figure_columns(suite: str, records: list[dict]) -> list[str]:
    columns = [f for case in CASES if case.suite == suite for f in case.figures]
    for r in records:
        columns += list(r.get("figures") or {})
    return list(dict.fromkeys(columns))


def suite_commands(suite: str, records: list[dict]) -> list[str]:
    """A suite's commands in the order its table first shows them: command ``c{i+1}`` is the i-th."""
    return list(dict.fromkeys(r["command"] for r in newest_first([r for r in records if r.get("suite") == suite])))


def suite_markdown(suite: str, records: list[dict]) -> list[str]:
    rows = newest_first([r for r in records if r.get("suite") == suite])
    if not rows:
        return []
    commands = suite_commands(suite, records)
    timed = any(r.get("tokens_per_sec_per_gpu") for r in rows)
    head = ["date", "device", "case", "system", "configuration"]
    figures = [] if timed else _figure_columns(suite, rows)
    head += (["tokens/s/GPU", "TFLOP/s/GPU", "MFU", "rule", "peak GiB", "per-step tokens/s", "hybridlm / peer"]
             if timed else figures) + ["command"]
    lines = [f"## {suite}", "", SUITES.get(suite, ""), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if timed and r.get("tokens_per_sec_per_gpu") is None and r.get("status", "ok") == "ok":
            cells = [" ".join(f"{k} {v}" for k, v in (r.get("figures") or {}).items())] + [""] * 6
        elif timed:
            cells = _throughput_row(r, rows)
        else:
            values = r.get("figures") or {}
            cells = [str(values.get(f, "")) for f in figures]
            if r.get("status", "ok") != "ok":
                cells[0] = f"failed: {r.get('error', '')}"
        lines.append("| " + " | ".join([r.get("date", ""), r.get("device", ""), r.get("case") or "", r["system"],
                                        r.get("label", "")] + cells + [f"c{commands.index(r['command']) + 1}"]) + " |")
    lines += ["", "Commands:", ""] + [f"- c{i}: `{c}`" for i, c in enumerate(commands, 1)] + [""]
    return lines


def _cut(shard: str) -> int | None:
    """N of a shard named k/N; None for a record of named tests (*part*)."""
    return int(shard.split("/")[1]) if "/" in shard else None


def _whole_suite_passes(records: list[dict]) -> list[tuple[str, str, str, int]]:
    """(date, commit, device, N) of every commit at which shards 1..N of one cut each have a finished record on one
    device with no failure and no error, newest first: the times the whole GPU suite passed."""
    passing: dict[tuple, dict[str, str]] = {}  # (commit, device, N) -> {shard: the time its passing record began}
    for r in records:
        f, shard = r.get("figures", {}), r.get("shard", "")
        if _cut(shard) and f.get("finished") and not f.get("failed") and not f.get("error"):
            passing.setdefault((r.get("commit", ""), r.get("device", ""), _cut(shard)), {})[shard] = r.get("time", r.get("date", ""))
    whole = [(max(times.values()), *key) for key, times in passing.items() if len(times) == key[2]]
    return [(time[:10], *key) for time, *key in sorted(whole, reverse=True)]


def gpu_tests_markdown(records: list[dict]) -> list[str]:
    """The newest gpu-tests record of each shard of the newest cut (tests/gpu_shards.py), and the last time every shard of
    one cut passed at one commit: when the GPU suite last passed, where, at what commit, and why each skipped test
    skipped. Records of an older cut (other shard counts cut the suite elsewhere) are counted, not shown."""
    ordered = newest_first([r for r in records if r.get("case") == "gpu-tests"])
    if not ordered:
        return []
    cuts = [_cut(r.get("shard", "all")) for r in ordered]
    cut = next((n for n in cuts if n), None)
    newest: dict[str, dict] = {}
    older: dict[str, dict] = {}
    for r, n in zip(ordered, cuts):
        (newest if n in (cut, None) else older).setdefault(r.get("shard", "all"), r)
    lines = ["## GPU tests", "", "`pytest -m gpu` in shards on the GPU machine: `make test-gpu SHARD=K/N RECORD=DIR`, then "
             "`python -m benchmarks render --add DIR/records.jsonl`. The newest record of each shard (*part*: a run of "
             "named tests; *finished* no: stopped at its time limit, the counts are how far it came).", ""]
    whole = _whole_suite_passes(ordered)
    if whole:
        date, commit, device, n = whole[0]
        lines += [f"The whole GPU suite last passed on {date} at {commit} on {device}: all {n} shards finished with no "
                  "failure.", ""]
    else:
        lines += ["The whole GPU suite has not yet passed: no commit has every shard of one cut finished without failure.", ""]
    lines += ["| shard | date | device | commit | passed | failed | errors | skipped | finished | wall s | command |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shard, r in sorted(newest.items()):
        f = r.get("figures", {})
        lines.append(f"| {shard} | {r.get('date', '')} | {r.get('device', '')} | {r.get('commit', '')} | {f.get('passed', '')} | "
                     f"{f.get('failed', '')} | {f.get('error', '')} | {f.get('skipped', '')} | {'yes' if f.get('finished') else 'no'} "
                     f"| {r.get('wall_s', '')} | `{r.get('command', '')}` |")
    if older:
        lines += ["", f"Not shown: the newest records of {len(older)} shards of other cuts "
                  f"({', '.join(sorted(older))}, newest {max(r.get('date', '') for r in older.values())})."]
    failures = [(shard, x) for shard, r in sorted(newest.items()) for x in r.get("failures", [])]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {shard} `{x['test']}`: {x['error'].splitlines()[0][:300]}" for shard, x in failures]
    reasons: dict[str, int] = {}
    for r in newest.values():
        for skip in r.get("skips", []):
            reasons[skip["reason"]] = reasons.get(skip["reason"], 0) + 1
    if reasons:
        lines += ["", "Skips, by reason:", ""] + [f"- {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda x: -x[1])]
    return lines + [""]


def results_markdown(records: list[dict]) -> str:
    lines = INTRO.splitlines() + [""]
    lines += gpu_tests_markdown(records)
    records = [r for r in records if r.get("case") != "gpu-tests"]
    for suite in list(SUITES) + sorted({r.get("suite") for r in records} - set(SUITES)):
        lines += suite_markdown(suite, records)
        if suite == "scaling" and curve_records(records):
            lines += ["The newest loss curve of each layout against one GPU (curve cases; window of 10 steps):", "",
                      f"![loss curves of each layout against one GPU]({os.path.basename(CURVES)})", ""]
    return "\n".join(lines).rstrip() + "\n"


def curve_records(records: list[dict]) -> list[dict]:
    """The newest successful or diverged record of each curve case's layout that kept its curves, for the cases that
    still exist and the layouts they still run (a case split or merged keeps its old records in RESULTS.md's tables, not
    in the plot)."""
    def listed(r: dict) -> bool:
        script = BY_NAME[r["case"]].script if r.get("case") in BY_NAME else ()
        chosen = script[script.index("--layouts") + 1].split(",") if "--layouts" in script else None
        return r.get("case") in BY_NAME and (chosen is None or r["curve"]["layout"] in chosen)

    newest: dict[tuple, dict] = {}
    for r in newest_first([r for r in records if r.get("curve") and listed(r)]):
        newest.setdefault((r.get("case"), r["curve"]["layout"]), r)
    return list(newest.values())


def plot_curves(records: list[dict], path: str = CURVES) -> int:
    """Per model (a row each: the scaling suite's dense model, the MoE one), each layout's loss curve over its one-GPU
    reference (left) and their windowed relative gap (right); the number drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    chosen = curve_records(records)
    if not chosen:
        return 0
    suites = sorted({r.get("suite", "") for r in chosen}, key=lambda s: s == "moe")
    figure, axes = plt.subplots(len(suites), 2, figsize=(13, 4.5 * len(suites)), squeeze=False)
    for (left, right), suite in zip(axes, suites):
        model = "MoE" if suite == "moe" else "dense"
        references = {}
        for r in sorted((r for r in chosen if r.get("suite", "") == suite), key=lambda r: (r.get("case", ""), r["curve"]["layout"])):
            reference, losses, name = r["curve"]["reference"], r["curve"]["losses"], r["curve"]["layout"]
            kind = r.get("case", "").removeprefix("curve-")
            if kind not in references:
                references[kind] = reference
                left.plot(range(1, len(reference) + 1), reference, color="black", linewidth=2.5, alpha=0.35, label=f"{kind}: 1 GPU")
            style = dict(linestyle="--") if name.startswith("1gpu") else {}  # a rounding-only control on one GPU
            left.plot(range(1, len(losses) + 1), losses, linewidth=0.8, label=f"{kind}: {name}", **style)
            gaps = [100 * (sum(losses[i:i + 10]) - sum(reference[i:i + 10])) / sum(reference[i:i + 10])
                    for i in range(0, len(losses) - 9, 10)]
            right.plot([i + 10 for i in range(0, len(losses) - 9, 10)], gaps, marker=".", linewidth=0.8, label=f"{kind}: {name}", **style)
        left.set(title=f"{model} model: loss, each layout over its one-GPU run", xlabel="step", ylabel="loss", yscale="log")
        right.axhspan(-3, 3, color="green", alpha=0.08, label="tolerance (3%; counted beyond a dashed control's gap)")
        right.set(title=f"{model} model: gap of 10-step means to one GPU", xlabel="step", ylabel="%")
        for axis in (left, right):
            axis.grid(alpha=0.3)
        right.legend(fontsize=7, ncol=2)
    figure.suptitle(f"loss curves of every layout against one GPU, bf16 ({chosen[0].get('device', '')}; benchmarks/curves.py)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)
    return len(chosen)


def _timed_runs(records: list[dict], case: str, system: str) -> list[dict]:
    """A case's successful runs of one system, newest first; the unprofiled ones where there are
    any (a profiled step runs slower), else the profiled."""
    runs = newest_first([r for r in records if r.get("case") == case and r["system"] == system
                         and r.get("status", "ok") == "ok" and r.get("tokens_per_sec_per_gpu")])
    return [r for r in runs if not r.get("profiled")] or runs


def _newest(records: list[dict], case: str, system: str, call: Optional[str] = None) -> Optional[dict]:
    found = _timed_runs(records, case, system)
    same = [r for r in found if call is not None and r.get("call") == call]
    return (same or found or [None])[0]


def headline_rows(records: list[dict]) -> list[tuple[str, str, dict, str]]:
    """(case, system, record, ratio) for the README: each readme case's newest hybridlm run, then its peers'
    (from the same call where there is one)."""
    rows = []
    for case in (c for c in CASES if c.readme):
        ours = _newest(records, case.name, "hybridlm")
        if ours is None:
            continue
        rows.append((case.name, "hybridlm", ours, ""))
        for peer in case.peers:
            theirs = _newest(records, case.name, peer, call=ours.get("call"))
            if theirs is not None:
                rows.append((case.name, peer, theirs, ratio(theirs, records)))
    return rows


def _other_runs(records: list[dict], case: str, system: str) -> str:
    runs = [r["tokens_per_sec_per_gpu"] for r in _timed_runs(records, case, system)]
    return f"{len(runs)} runs: {min(runs):,.0f}-{max(runs):,.0f}" if len(runs) > 1 else ""


def readme_table(records: list[dict]) -> str:
    lines = [BEGIN, "", "| case | configuration | system | tokens/s/GPU | MFU | hybridlm / peer | run | command | all runs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, system, r, rel in headline_rows(records):
        t = throughput(r)
        mfu = "" if t.mfu is None else f"{100 * t.mfu:.1f}%" + ("" if t.rule == "current" else f" ({RULES[t.rule]})")
        label = BY_NAME[name].label if system == "hybridlm" else "same case"
        when = f"{r['date']}, {r['device']}" + (" (profiled)" if r.get("profiled") else "")
        suite = r["suite"]
        command = f"[RESULTS.md {suite} c{suite_commands(suite, records).index(r['command']) + 1}](benchmarks/RESULTS.md#{suite})"
        lines.append(f"| `{name}` | {label} | {system} | {t.tokens_per_sec_per_gpu:,.0f} | {mfu} | {rel} | "
                     f"{when} | {command} | {_other_runs(records, name, system)} |")
    lines += ["", END]
    return "\n".join(lines)


def _gap(record: dict) -> str:
    return record.get("figures", {}).get("max windowed loss gap", "").split(" (")[0]


def _run(record: dict) -> str:
    return ", ".join(str(record[k]) for k in ("date", "device", "commit") if record.get(k))


def layouts_table(records: list[dict]) -> str:
    """The README's account of which layouts were checked against one GPU: for each README curve case, the newest
    record of each layout it runs (its largest gap of 10-step means and its verdict) beside the rounding-only
    control of the same call, with the run's date, machine and commit; a layout with no record says so, with the
    command that makes one."""
    from .curves import LAYOUTS_4GPU, ONE_GPU_LAYOUTS
    newest: dict[tuple, dict] = {}
    for r in newest_first([r for r in records if r.get("figures", {}).get("max windowed loss gap")]):
        newest.setdefault((r.get("case"), (r.get("curve") or {}).get("layout")), r)
    lines = [LAYOUTS_BEGIN, "", "| case | layout | gap | rounding-only control, same call | verdict | run |",
             "|---|---|---|---|---|---|"]
    for case in (c for c in CASES if c.readme and "benchmarks/curves.py" in c.script):
        kind, first = case.script[1], f"`{case.name}`"
        names = case.script[case.script.index("--layouts") + 1].split(",") if "--layouts" in case.script else [None]
        for name in (n for n in names if n not in ONE_GPU_LAYOUTS[kind]):
            r = newest.get((case.name, name))
            if r is None:
                words = LAYOUTS_4GPU[kind][name][1] if name else case.label
                lines.append(f"| {first} | {words} | | | no record | `python -m benchmarks run --cases {case.name}` |")
            else:
                control = [c for (n, layout), c in newest.items() if n == case.name
                           and layout in ONE_GPU_LAYOUTS[kind] and c.get("call") == r.get("call")]
                control_text = (f"{_gap(control[0])} ({ONE_GPU_LAYOUTS[kind][control[0]['curve']['layout']][1]})"
                                .replace(" (rounding only)", "") if control else "none")
                layout = r.get("label", "").partition(": ")[2].split(" vs 1 ")[0]
                lines.append(f"| {first} | {layout} | {_gap(r)} | {control_text} | "
                             f"{r['figures'].get('verdict', 'not recorded')} | {_run(r)} |")
            first = ""
    lines += ["", LAYOUTS_END]
    return "\n".join(lines)


def plot(records: list[dict], path: str = PLOT) -> list[tuple[str, str, float, Optional[float]]]:
    """Tokens/s and MFU per README case beside its peers, as a PNG; returns the bars drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = []
    for name, system, r, _ in headline_rows(records):
        t = throughput(r)
        bars.append((name, system, t.tokens_per_sec_per_gpu, t.mfu))
    colors = {"hybridlm": "#1f77b4", "megatron-lm": "#76b900", "torch-compile": "#ff7f0e", "torch": "#ffbb78", "hf-zero2": "#9467bd"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 0.42 * len(bars) + 1.5), sharey=True)
    y = list(range(len(bars)))[::-1]
    labels = [f"{name} · {system}" for name, system, _, _ in bars]
    for axis, values, title in ((left, [b[2] for b in bars], "tokens/s per GPU"),
                                (right, [100 * (b[3] or 0) for b in bars], "MFU % (dense bf16 peak)")):
        axis.barh(y, values, color=[colors.get(b[1], "#999999") for b in bars])
        axis.set_title(title)
        axis.grid(axis="x", alpha=0.3)
    left.set_yticks(y, labels, fontsize=8)
    figure.suptitle("hybridlm beside its peers (newest run of each README case; benchmarks/RESULTS.md)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)
    return bars


def spliced_readme(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """The README with the text between the markers replaced by ``table`` (ValueError without the markers)."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"README.md has no table markers ({begin!r} ... {end!r}).")
    return text[:start] + table + text[stop + len(end):]


def rendered_readme(text: str, records: list[dict]) -> str:
    """The README with both rendered tables in place."""
    return spliced_readme(spliced_readme(text, readme_table(records)), layouts_table(records), LAYOUTS_BEGIN, LAYOUTS_END)


def stale(records: list[dict]) -> list[str]:
    """The files that are not what the records render (empty: all current)."""
    with open(RESULTS) as f:
        results = f.read()
    with open(README) as f:
        readme = f.read()
    out = []
    if results != results_markdown(records):
        out.append(RESULTS)
    if readme != rendered_readme(readme, records):
        out.append(README)
    return out


def write(records: list[dict], with_plot: bool = True) -> list[str]:
    with open(RESULTS, "w") as f:
        f.write(results_markdown(records))
    with open(README) as f:
        readme = f.read()
    with open(README, "w") as f:
        f.write(rendered_readme(readme, records))
    written = [RESULTS, README]
    if with_plot:
        plot(records)
        written.append(PLOT)
        if plot_curves(records):
            written.append(CURVES)
    return written
