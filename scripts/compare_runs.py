"""Check that a run's loss curve tracks a reference run's: `python scripts/compare_runs.py one_gpu.jsonl eight_gpus.jsonl`.

Both files are `--metrics-file` outputs of the same model, data and seed (log interval 1);
exit 0 when the windowed means stay within --tolerance, 1 when they do not, 2 on bad input.
`python scripts/compare_runs.py --series monitor a.jsonl b.jsonl c.jsonl [--plot runs.png]` shows the
logged figures of any number of runs side by side instead (MFU, the communication and GPU busy shares,
the gradient noise scale: README, "Monitoring"), and draws them against the iteration.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.training.curves import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
