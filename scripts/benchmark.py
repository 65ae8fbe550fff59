"""Benchmark a preset through the real training path, or one of its peers:
`deepspeed --num_gpus N scripts/benchmark.py --model reference --steps 30 [--system torch-compile] [--record-file R.jsonl] -- [pretrain flags]`.
The benchmark suite (`python -m benchmarks run`) runs this for its cases."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridlm.training.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
