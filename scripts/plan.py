"""Plan a layout: `python scripts/plan.py --model llama2-70b --gpus 64 --gpu-memory 80`.

Prints per-GPU memory (parameters, gradients, optimizer states, activations with and without
recompute) of candidate TP/PP/DP/ZeRO layouts and the pretrain command of the fastest that fits.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.planner.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
