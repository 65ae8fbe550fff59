"""The benchmark suite: cases as data (cases.py), one runner (runner.py), records (records.py)
that render RESULTS.md, the README's headline table and the plot (render.py).

    HYBRIDLM_COMMIT=$(cat .device/COMMIT) python -m benchmarks run --suite headline --out $OUT   # on the GPU machine
    python -m benchmarks render --add $OUT/records.jsonl     # here: file the records, render

The helper scripts beside this package (kernels.py, attention.py, plan_check.py,
preprocess_bench.py, curves.py, interop_check.py) are what some cases run; each writes
records with --record-file.
"""
