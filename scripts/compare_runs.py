"""Check that a run's loss curve tracks a reference run's: `python scripts/compare_runs.py one_gpu.jsonl eight_gpus.jsonl`.

Both files are `--metrics-file` outputs of the same model, data and seed (log interval 1);
exit 0 when the windowed means stay within --tolerance, 1 when they do not, 2 on bad input.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.training.curves import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
