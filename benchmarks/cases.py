"""Every benchmark case, as data: what runs, on how many GPUs, for how long, beside which peers.

A case is one configuration. Its runs are hybridlm's (``scripts/benchmark.py``, or for the
cases with a ``script``, that helper) and one run per peer, all in the same call of the
runner (``python -m benchmarks run --cases NAME``), so hybridlm / peer ratios compare like
with like. Peers: ``megatron-lm`` (Megatron-LM's pretrain_gpt.py on mock data with the same
model and batch: benchmarks/megatron.py), ``torch`` and ``torch-compile`` (this model as a
plain PyTorch module, eager or compiled) and ``hf-zero2`` (Hugging Face Llama under DeepSpeed
ZeRO-2): hybridlm/training/baselines.py.

Suites group cases (``--suite``).
"""
from __future__ import annotations

from dataclasses import dataclass

PEERS = ("megatron-lm", "torch", "torch-compile", "hf-zero2")
ONE_GPU_PEERS = ("torch", "torch-compile", "hf-zero2")  # baselines.py runs on exactly one GPU
TRAIN_FIGURES = ("tokens/s/GPU", "TFLOP/s/GPU", "MFU", "peak GiB", "per-step tokens/s")

SUITES = {
    "headline": "the README's table: the reference model (944M, d2048 L16, seq 2048) on one GPU, bf16 and FP8, beside the peers",
    "variants": "the reference on one GPU with one setting changed (ZeRO stage, batch, attention kernel, TE, FP8 recipe, fused ops)",
    "long-context": "longer sequences: the reference on one GPU up to the longest that trains, and context parallelism (CP=2, p2p and a2a) on two",
    "moe": "Mixture-of-Experts: Mixtral-8x7B's layer shapes, on one GPU and under expert parallelism",
    "scaling": "several GPUs: TP, PP, DP, ZeRO-3 and their products; loss curves of a layout against one GPU",
    "memory": "the largest model one GPU trains, with and without CPU offload",
    "kernels": "the fused kernels and attention backends against eager PyTorch and torch.compile",
    "planner": "the memory planner's estimate against the measured peak",
    "data": "preprocessing throughput against the tokenizer's bare encoder and Megatron-LM's tools/preprocess_data.py",
    "post-training": "fine-tuning on one GPU: packed SFT of a Qwen2-1.5B shape beside TRL's SFTTrainer and hybridlm's own "
                     "pretraining, DPO's reference pass; LoRA of a llama2-7b shape against full fine-tuning with ZeRO-3 + CPU offload; "
                     "GRPO of a Qwen2-0.5B shape beside TRL's GRPOTrainer; QLoRA (a 4-bit base) of llama2-7b and -13b shapes, "
                     "and beside PEFT + bitsandbytes",
    "monitor": "what the training monitor costs (README, 'Monitoring'): the reference on one GPU trained without it and "
               "with the gradient noise scale and a profiled step every 5, in one call",
    "cpu": "the runner's own check in the test suite: the built-in tiny model, two steps, on CPU",
}


@dataclass(frozen=True)
class Case:
    name: str  # what --cases takes
    suite: str
    label: str  # the configuration in words (the tables' layout column)
    model: str = "reference"  # a preset of hybridlm/presets.py
    flags: tuple[str, ...] = ()  # pretrain flags after the preset (they win)
    gpus: int = 1  # GPUs the case needs (0: CPU only)
    steps: int = 14  # timed steps
    warmup: int = 6  # untimed steps before them
    peers: tuple[str, ...] = ()  # run beside hybridlm, in this order
    figures: tuple[str, ...] = TRAIN_FIGURES  # the columns the case fills in its suite's table
    readme: bool = False  # a row of the README's headline table (a curve case: rows of its layouts table)
    expected_s: int = 150  # one run's usual wall time, start-up included: what --budget-s plans with
    timeout_s: int = 360  # one run's limit
    script: tuple[str, ...] = ()  # a helper's argv (it takes --record-file) instead of scripts/benchmark.py
    launcher: str = "deepspeed"  # how a script starts: "deepspeed" (--num_gpus) or "python"
    needs: tuple[str, ...] = ()  # what must be importable: "te" (Transformer Engine), "fa" (flash-attn-4), "bnb"
    # (bitsandbytes), "peft", "trl"

    @property
    def ranks(self) -> int:
        return max(self.gpus, 1)


ZERO1 = ("--deepspeed_config", "ds_configs/zero1.json")
BF16 = ("--bf16",) + ZERO1
COMPILED = BF16 + ("--torch-compile", "--global-batch-size", "64", "--attention-backend", "cudnn")
# the amax history and algorithm the FP8 figures were measured with (Megatron's defaults are 1 / most_recent)
FP8 = BF16 + ("--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
              "--fp8-amax-compute-algo", "max", "--torch-compile",
              "--global-batch-size", "64", "--attention-backend", "cudnn")
L_FP8 = "1 GPU, ZeRO-1, gbs 64, TE FP8 hybrid delayed, --torch-compile, cuDNN attention"
# MoE speed cases route by random logits (Megatron-LM's benchmark flag, passed to its peer too): at the default
# learning rate with no warm-up the router collapsed onto two experts within four steps (1 x H200, 2026-12-02:
# [65536 65536 0 0 0 0 0 0] tokens per expert), so the cases timed two large GEMMs, not a trained model's eight
BALANCED = ("--moe-router-force-load-balancing",)
L_BALANCED = "random balanced routing"
MIXTRAL_2L = ("--num-layers", "2", "--global-batch-size", "16") + BF16 + BALANCED
# as many of Mixtral-8x7B's 32 layers as one H200 holds at EP=1 (scripts/plan.py: 128.4 of 141 GiB at ZeRO-1)
MIXTRAL_4L = ("--num-layers", "4", "--global-batch-size", "8") + BF16 + BALANCED
L_MIXTRAL_4L = f"Mixtral-8x7B shape, 4 of 32 layers, 1 H200, EP=1, gbs 8, ZeRO-1, {L_BALANCED}"
FP8_TE = ("--transformer-impl", "transformer_engine", "--fp8-format", "hybrid")
COMPILED_MB2 = ("--torch-compile", "--micro-batch-size", "2")
SEVEN_B = dict(model="llama2-7b", gpus=4, steps=6, warmup=3, expected_s=200)
# one sample per step, full recompute: the longest sequences; a case past the memory is a failed record
LONG = BF16 + ("--micro-batch-size", "1", "--global-batch-size", "1", "--recompute-granularity", "full")
L_LONG = "mb 1, full recompute, ZeRO-1, bf16"
LORA_7B = ("--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "all-linear")
QLORA = LORA_7B + ("--quant-bits", "4", "--quant-type", "nf4", "--double-quant")
L_QLORA = "1 GPU, QLoRA: LoRA R 16 alpha 32 on all linears over an NF4 base (double quantization), bf16, ZeRO-1, seq 4096, mb 1, gbs 8"
SFT_ROWS = ("--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8")
PLAN = ("--fused-ops", "none", "--bf16", "--train-iters", "3", "--log-interval", "1", "--lr-warmup-iters", "0")
PLAN_FIGURES = ("measured GiB", "planner GiB", "planner vs measured")


def _qlora_beside_peft(name: str, setting: str, *options: str, expected_s: int = 480) -> Case:
    """QLoRA SFT beside PEFT + bitsandbytes through TRL's SFTTrainer on the same packed chat data
    (benchmarks/qlora_throughput.py: a random llama2-7b-shaped Hugging Face model and its import, made once
    in the work directory, ~27 GB of disk); ``options``: the script's, for what each side recomputes."""
    return Case(name, "post-training", "QLoRA SFT, llama2-7b shape, R 16 alpha 32 all linears, NF4 + double quantization, "
                f"packed rows of 4096, mb 1, gbs 8, {setting}; PEFT + bitsandbytes (TRL SFTTrainer) beside it", gpus=1,
                figures=("loss tokens/s", "positions/s", "peak GiB", "hybridlm/PEFT"), launcher="python",
                script=("benchmarks/qlora_throughput.py", "--out", "/tmp/qlorabench-out", "--workdir", "/tmp/qlorabench",
                        *options), expected_s=expected_s, timeout_s=590, needs=("bnb", "peft", "trl"))


def _long(name: str, seq: int, cp: int = 1, comm: str = "p2p", probe: bool = False, mlp_recompute: bool = False, **kw) -> Case:
    """The reference at ``seq`` tokens per sample, on one GPU or with CP over ``cp`` GPUs; a ``probe``
    only asks whether that length trains (two timed steps); ``mlp_recompute`` rebuilds the MLP
    sub-blocks (selective recompute) instead of whole layers."""
    where = f"{cp} GPUs, CP={cp} {comm}" if cp > 1 else "1 GPU"
    flags = LONG + ("--seq-length", str(seq)) + (("--context-parallel-size", str(cp), "--cp-comm-type", comm) if cp > 1 else ())
    label = L_LONG
    if mlp_recompute:
        flags += ("--recompute-granularity", "selective", "--recompute-modules", "mlp")  # the later flag wins
        label = L_LONG.replace("full recompute", "selective recompute of the MLPs")
    timing = dict(steps=2, warmup=1, expected_s=180, timeout_s=300) if probe else dict(steps=4, warmup=2, expected_s=240, timeout_s=360)
    return Case(name, "long-context", f"{where}, seq {seq}, {label}", gpus=cp, flags=flags, **timing, **kw)


def _plan(name: str, gpus: int, label: str, *flags: str, model: str = "reference") -> Case:
    return Case(name, "planner", label, model=model, gpus=gpus, figures=PLAN_FIGURES, expected_s=90, timeout_s=150,
                script=("benchmarks/plan_check.py", "--label", label, "--", "--model", model) + PLAN + flags)


def _curve(name: str, suite: str, label: str, gpus: int = 0, layouts: tuple[str, ...] = (), extra: tuple[str, ...] = (),
           expected_s: int = 0, readme: bool = True) -> Case:
    """benchmarks/curves.py's 200-step loss curves of layouts against one rank: the dense model for the scaling
    suite, the MoE one for the moe suite; on ``gpus`` GPUs (4: each of ``layouts``, 50-170 s a four-GPU run with its
    start-up on H200s, ``expected_s`` the whole case; a one-GPU rounding-only control runs beside the reference), or
    8 gloo ranks (0). A four-GPU case is sized to finish within one 10-minute device call."""
    kind = "moe" if suite == "moe" else "dense"
    on_gpus = ("--gpus", str(gpus)) if gpus else ()
    chosen = ("--layouts", ",".join(layouts)) if layouts else ()
    four = [n for n in layouts if not n.startswith("1gpu")]
    timing = dict(expected_s=expected_s or 120 * (len(four) + 1), timeout_s=560) if layouts else (
        dict(expected_s=500, timeout_s=580) if gpus else dict(expected_s=900, timeout_s=1800))
    return Case(name, suite, label, gpus=gpus, figures=("max windowed loss gap", "verdict"), launcher="python", readme=readme,
                script=("benchmarks/curves.py", kind) + on_gpus + chosen + extra, **timing)


CASES = (
    # headline: what the README's table shows, with the peers
    Case("ref-bf16", "headline", "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, cuDNN attention", flags=COMPILED,
         peers=("megatron-lm", "torch-compile", "hf-zero2", "torch"), readme=True, expected_s=110),
    Case("ref-fp8", "headline", f"{L_FP8}, --cuda-graphs, --gradient-accumulation-fusion",
         flags=FP8 + ("--cuda-graphs", "--gradient-accumulation-fusion"), peers=("megatron-lm",), readme=True,
         expected_s=130, needs=("te",)),
    # variants of the reference on one GPU
    Case("ref-fp8-nofusion", "variants", f"{L_FP8}, --cuda-graphs", flags=FP8 + ("--cuda-graphs",), readme=True,
         expected_s=130, needs=("te",)),
    Case("ref-fp8-nographs", "variants", L_FP8, flags=FP8, readme=True, expected_s=120, needs=("te",)),
    Case("ref-fp8-mb8", "variants", L_FP8.replace("gbs 64", "mb 8, gbs 64"), flags=FP8 + ("--micro-batch-size", "8"),
         readme=True, expected_s=120, needs=("te",)),
    Case("ref-bf16-flash", "variants", "1 GPU, ZeRO-1, bf16, gbs 64, --torch-compile, flash-attn-4",
         flags=BF16 + ("--torch-compile", "--global-batch-size", "64", "--attention-backend", "flash"), readme=True,
         needs=("fa",)),
    Case("ref-bf16-zero0", "variants", "1 GPU, ZeRO-0, bf16, gbs 64, --torch-compile, cuDNN attention",
         flags=COMPILED + ("--deepspeed_config", "ds_configs/zero0.json")),
    Case("ref-bf16-eager", "variants", "1 GPU, ZeRO-1, bf16, gbs 64, eager, cuDNN attention",
         flags=BF16 + ("--global-batch-size", "64", "--attention-backend", "cudnn")),
    Case("ref-te-bf16", "variants", "1 GPU, ZeRO-1, gbs 64, TE linears bf16, --torch-compile, cuDNN attention",
         flags=COMPILED + ("--transformer-impl", "transformer_engine"), needs=("te",)),
    Case("ref-fp8-current", "variants", L_FP8.replace("hybrid delayed", "e4m3 current"),
         flags=FP8 + ("--fp8-format", "e4m3", "--fp8-recipe", "current"), needs=("te",)),
    Case("ref-fused-ops-all", "variants", "1 GPU, ZeRO-1, bf16, eager, --fused-ops all", flags=BF16 + ("--fused-ops", "all")),
    Case("ref-fused-ops-none", "variants", "1 GPU, ZeRO-1, bf16, eager, --fused-ops none", flags=BF16 + ("--fused-ops", "none")),
    # long context
    Case("ref-seq8k", "long-context", "1 GPU, ZeRO-1, bf16, seq 8192, mb 1, gbs 16, --torch-compile, cuDNN attention",
         flags=COMPILED + ("--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "16"),
         peers=("megatron-lm",)),
    _long("ref-seq128k", 131072),  # the per-GPU figure CP=2 compares with
    _long("ref-seq192k", 196608, probe=True),
    _long("ref-seq256k", 262144, probe=True),
    _long("ref-cp2-seq128k-p2p", 131072, cp=2, peers=("megatron-lm",)),  # fits two H100s (25 GiB a GPU)
    _long("ref-cp2-seq128k-a2a", 131072, cp=2, comm="a2a", peers=("megatron-lm",)),
    _long("ref-cp2-seq128k-p2p-mlp-recompute", 131072, cp=2, mlp_recompute=True),  # planned 81.9 GiB a GPU: H200s
    _long("ref-cp2-seq256k-p2p", 262144, cp=2, peers=("megatron-lm",)),
    _long("ref-cp2-seq256k-a2a", 262144, cp=2, comm="a2a", peers=("megatron-lm",)),
    Case("cp2-same-weights", "long-context", "CP test model (d256 L4, seq 1024, constant lr 1e-3): the same weights and batch on "
         "1 GPU and CP=2, bf16", gpus=2, launcher="python", script=("benchmarks/same_weights.py",), expected_s=200, timeout_s=400,
         figures=("loss 16 on the weights of 15", "gradient error to fp32 at 15", "gradient error to fp32 at 14",
                  "loss 16 of each trajectory")),
    _long("ref-cp2-seq384k", 393216, cp=2, probe=True),
    _long("ref-cp2-seq512k", 524288, cp=2, probe=True),
    _long("ref-cp4-seq256k-p2p", 262144, cp=4, peers=("megatron-lm",)),  # 256K on four H100s: two H200s' load per GPU
    _long("ref-cp4-seq256k-a2a", 262144, cp=4, comm="a2a", peers=("megatron-lm",)),
    _long("ref-cp4-seq256k-p2p-mlp-recompute", 262144, cp=4, mlp_recompute=True),  # planned 79.3 GiB a GPU: H200s
    _long("ref-cp4-seq512k", 524288, cp=4, probe=True),  # planned 40.3 GiB a GPU
    _long("ref-cp4-seq1m", 1048576, cp=4, probe=True),  # planned 74.3 GiB a GPU: H200s, the edge of H100s
    # MoE
    Case("moe-1gpu", "moe", f"Mixtral-8x7B shape, 2 of 32 layers, 1 GPU, gbs 16, ZeRO-1, bf16, {L_BALANCED}", model="mixtral-8x7b",
         flags=MIXTRAL_2L, peers=("megatron-lm",), timeout_s=300),
    # hybridlm's one-GPU recommendation for the layer (issue 45's MFU goal): compiled, two sequences a micro-batch
    Case("moe-1gpu-compiled", "moe", f"Mixtral-8x7B shape, 2 of 32 layers, 1 GPU, mb 2, gbs 16, ZeRO-1, bf16, "
         f"--torch-compile, {L_BALANCED}", model="mixtral-8x7b", flags=MIXTRAL_2L + ("--torch-compile", "--micro-batch-size", "2"),
         peers=("megatron-lm",), timeout_s=300),
    Case("moe-4l-bf16", "moe", f"{L_MIXTRAL_4L}, bf16", model="mixtral-8x7b", flags=MIXTRAL_4L, steps=10, warmup=4,
         peers=("megatron-lm",), expected_s=240, timeout_s=300),
    Case("moe-4l-fp8", "moe", f"{L_MIXTRAL_4L}, TE FP8 hybrid, the experts as TE's grouped FP8 GEMMs", model="mixtral-8x7b",
         flags=MIXTRAL_4L + FP8_TE, steps=10, warmup=4, peers=("megatron-lm",), expected_s=240, timeout_s=300, needs=("te",)),
    # issue 45's FP8 goal in hybridlm's one-GPU setting for the layer (moe-1gpu-compiled: compiled, mb 2), FP8 against bf16
    Case("moe-4l-bf16-compiled", "moe", f"{L_MIXTRAL_4L}, mb 2, bf16, --torch-compile", model="mixtral-8x7b",
         flags=MIXTRAL_4L + COMPILED_MB2, steps=10, warmup=4, expected_s=120, timeout_s=300),
    Case("moe-4l-fp8-compiled", "moe", f"{L_MIXTRAL_4L}, mb 2, TE FP8 hybrid, the experts as TE's grouped FP8 GEMMs, "
         "--torch-compile", model="mixtral-8x7b", flags=MIXTRAL_4L + FP8_TE + COMPILED_MB2, steps=10, warmup=4,
         expected_s=120, timeout_s=300, needs=("te",)),
    Case("moe-4l-finegrained", "moe", f"{L_MIXTRAL_4L.replace('Mixtral-8x7B shape', 'Mixtral-8x7B attention, 64 experts of width 1792 top-8')}, bf16",
         model="mixtral-8x7b", flags=MIXTRAL_4L + ("--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "1792"),
         steps=10, warmup=4, peers=("megatron-lm",), expected_s=240, timeout_s=300),
    Case("moe-4l-finegrained-compiled", "moe", f"{L_MIXTRAL_4L.replace('Mixtral-8x7B shape', 'Mixtral-8x7B attention, 64 experts of width 1792 top-8')}, "
         "mb 2, bf16, --torch-compile", model="mixtral-8x7b", flags=MIXTRAL_4L + COMPILED_MB2 + ("--num-experts", "64",
         "--moe-router-topk", "8", "--moe-ffn-hidden-size", "1792"), steps=10, warmup=4, peers=("megatron-lm",), expected_s=120,
         timeout_s=300),
    Case("mixtral-ep2", "moe", f"EP=2, Mixtral-8x7B shape, 2 of 32 layers, gbs 16, ZeRO-1, bf16, {L_BALANCED}", model="mixtral-8x7b",
         gpus=2, flags=MIXTRAL_2L + ("--expert-model-parallel-size", "2"), peers=("megatron-lm",)),
    # issue 45's 4-GPU case: the same two layers, two of the eight experts a GPU, gbs 16 as DP=4 x 4 micro-batches
    Case("mixtral-ep4", "moe", f"EP=4, Mixtral-8x7B shape, 2 of 32 layers, gbs 16, ZeRO-1, bf16, {L_BALANCED}", model="mixtral-8x7b",
         gpus=4, flags=MIXTRAL_2L + ("--expert-model-parallel-size", "4"), peers=("megatron-lm",)),
    Case("moe-ep4-8gpu", "moe", f"Mixtral-style d1024 L16, 8 experts top-2 (1.5B, 0.5B active), EP=4 x DP=8, ZeRO-1, bf16, gbs 64, {L_BALANCED}",
         gpus=8, steps=10, warmup=4, flags=("--num-layers", "16", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "3584", "--num-experts", "8", "--moe-router-topk", "2",
         "--moe-aux-loss-coeff", "0.02", "--micro-batch-size", "2", "--expert-model-parallel-size", "4",
         "--global-batch-size", "64") + BF16 + BALANCED, peers=("megatron-lm",)),
    _curve("curve-moe-4gpu", "moe", "Mixtral-style d768 L8 (240M), 200 steps at EP=2 x DP=2, EP=2 x CP=2, EP=4 and EP=2 x TP=2 SP "
           "against 1 GPU, beside one GPU with micro-batches of 1", gpus=4, layouts=("1gpu-mb1", "ep2-dp2", "ep2-cp2", "ep4", "ep2-tp2-sp"),
           expected_s=480),
    _curve("curve-moe-4gpu-fp32-grads", "moe", "the same model and layouts (and DP=4 without EP), gradients accumulated "
           "and reduced in fp32 (Megatron-LM's bf16 default)", gpus=4, layouts=("1gpu-mb1", "dp4", "ep2-dp2", "ep2-cp2"),
           extra=("--fp32-grads",), readme=False),
    Case("moe-same-weights", "moe", "the same Mixtral-style model: from one GPU's weights of iteration 60, one step of "
         "1 GPU (bf16, fp32, micro-batches of 1), DP=4, EP=2 x DP=2, EP=2 x CP=2, EP=4 and EP=2 x TP=2 SP", gpus=4,
         launcher="python", script=("benchmarks/same_weights.py", "--model", "moe", "--steps", "0"), expected_s=330,
         timeout_s=560, figures=("clip norm / gradient norm at 60", "gradient error to fp32 at 60", "update error to 1 GPU at 60",
                                 "verdict")),
    _curve("curve-moe-8gpu", "moe", "the same Mixtral-style model, 200 steps at EP=4 x DP=8 against 1 GPU", gpus=8),
    _curve("curve-moe-cpu", "moe", "tiny model with 8 experts top-2, 200 steps at EP=4 x DP=8 (8 gloo ranks) against 1 rank"),
    # several GPUs
    Case("ref-tp2", "scaling", "TP=2 SP, ZeRO-1, bf16", gpus=2, flags=BF16 + ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
         peers=("megatron-lm",)),
    Case("ref-pp2", "scaling", "PP=2, gbs 32 (8 micro-batches), ZeRO-1, bf16", gpus=2,
         flags=BF16 + ("--pipeline-model-parallel-size", "2", "--global-batch-size", "32"), peers=("megatron-lm",)),
    Case("ref-tp2-compiled", "scaling", "TP=2 SP, ZeRO-1, bf16, --torch-compile", gpus=2,
         flags=BF16 + ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--torch-compile"), peers=("megatron-lm",)),
    Case("ref-pp2-compiled", "scaling", "PP=2, gbs 32 (8 micro-batches), ZeRO-1, bf16, --torch-compile", gpus=2,
         flags=BF16 + ("--pipeline-model-parallel-size", "2", "--global-batch-size", "32", "--torch-compile"),
         peers=("megatron-lm",)),
    Case("ref-pp2-compiled-first9", "scaling", "PP=2, 9 of 16 layers on the first stage, gbs 32 (8 micro-batches), ZeRO-1, "
         "bf16, --torch-compile", gpus=2, flags=BF16 + ("--pipeline-model-parallel-size", "2", "--global-batch-size", "32",
                                                        "--torch-compile", "--decoder-first-pipeline-num-layers", "9"),
         peers=("megatron-lm",)),
    Case("ref-dp4", "scaling", "DP=4 ZeRO-1, bf16, gbs 128, --torch-compile", gpus=4,
         flags=BF16 + ("--global-batch-size", "128", "--torch-compile"), peers=("megatron-lm",), readme=True),
    Case("ref-dp4-fp32-grads", "scaling", "DP=4 ZeRO-1, bf16, gbs 128, --torch-compile, gradients accumulated and reduced in "
         "fp32 (--accumulate-allreduce-grads-in-fp32, Megatron-LM's bf16 default)", gpus=4,
         flags=BF16 + ("--global-batch-size", "128", "--torch-compile", "--accumulate-allreduce-grads-in-fp32")),
    Case("7b-tp2-dp2", "scaling", "TP=2 SP x DP=2, ZeRO-1, bf16, mb 2, gbs 16, --torch-compile", **SEVEN_B,
         flags=BF16 + ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "2",
                       "--global-batch-size", "16", "--torch-compile"), peers=("megatron-lm",), readme=True),
    Case("7b-pp2-dp2", "scaling", "PP=2 x DP=2, ZeRO-1, bf16, gbs 16, --torch-compile", **SEVEN_B,
         flags=BF16 + ("--pipeline-model-parallel-size", "2", "--global-batch-size", "16", "--torch-compile"),
         peers=("megatron-lm",), readme=True),
    Case("7b-tp2-pp2", "scaling", "TP=2 SP x PP=2, ZeRO-1, bf16, mb 2, gbs 16, --torch-compile (the 70B template's layout in "
         "miniature)", **SEVEN_B, flags=BF16 + ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                                                "--global-batch-size", "16", "--torch-compile"), peers=("megatron-lm",)),
    Case("7b-zero3-dp4", "scaling", "ZeRO-3 DP=4, bf16, mb 2, gbs 32", **SEVEN_B, readme=True,
         flags=("--bf16", "--micro-batch-size", "2", "--global-batch-size", "32", "--deepspeed_config", "ds_configs/zero3.json")),
    Case("1p3b-8gpu", "scaling", "reference block d2048 L24 (1.3B), TP=2 SP x PP=2 x DP=2, ZeRO-1, bf16, --torch-compile, gbs 64",
         gpus=8, steps=10, warmup=4, flags=BF16 + ("--num-layers", "24", "--torch-compile", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--pipeline-model-parallel-size", "2", "--global-batch-size", "64"), peers=("megatron-lm",)),
    _curve("curve-dense-4gpu-a", "scaling", "Llama-style d1024 L10 (120M), 200 steps at DP=4 ZeRO-1, DP=4 ZeRO-3 and TP=2 SP x DP=2 "
           "against 1 GPU", gpus=4, layouts=("1gpu-mb2", "dp4-zero1", "dp4-zero3", "tp2-sp-dp2"), expected_s=420),
    _curve("curve-dense-4gpu-pp", "scaling", "the same model, 200 steps at TP=2 x PP=2 and PP=2 x DP=2 against 1 GPU",
           gpus=4, layouts=("1gpu-mb2", "tp2-pp2", "pp2-dp2"), expected_s=360),
    # the CP layouts take 140-170 s each (four ranks on 1024 tokens): two cases, each within one call
    _curve("curve-dense-4gpu-b", "scaling", "the same model, 200 steps at CP=2 p2p x DP=2 and CP=2 a2a x TP=2 against 1 GPU",
           gpus=4, layouts=("1gpu-mb2", "cp2-p2p-dp2", "cp2-a2a-tp2"), expected_s=280),
    _curve("curve-dense-4gpu-c", "scaling", "the same model, 200 steps at CP=4 p2p and CP=4 a2a against 1 GPU",
           gpus=4, layouts=("1gpu-mb2", "cp4-p2p", "cp4-a2a"), expected_s=400),
    _curve("curve-dense-8gpu", "scaling", "the same 1.3B model, 200 steps at TP=2 SP x PP=2 x DP=2 against 1 GPU", gpus=8),
    _curve("curve-dense-cpu", "scaling", "built-in tiny model, 200 steps at TP=2 SP x PP=2 x DP=2 (8 gloo ranks) against 1 rank"),
    # the largest model on one GPU
    Case("7b-nooffload-L30", "memory", "1 GPU, no offload, ZeRO-2, full recompute, seq 2048, mb 1, 30 of 32 layers",
         model="llama2-7b", steps=3, warmup=1, flags=("--num-layers", "30", "--seq-length", "2048", "--bf16",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--recompute-granularity", "full",
         "--deepspeed_config", "ds_configs/zero2.json"), expected_s=200),
    Case("13b-offload", "memory", "1 GPU, ZeRO-3 + CPU offload (params and optimizer), full recompute, seq 2048, mb 1",
         model="llama2-13b", steps=2, warmup=1, flags=("--seq-length", "2048", "--bf16", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--recompute-granularity", "full", "--deepspeed_config", "ds_configs/zero3_offload_cpu.json"),
         expected_s=500, timeout_s=580),
    # post-training: the same model, rows and batch; only what trains and where its state lives differ. The rows are
    # the benchmark's mock documents, 4096 tokens each, as packed SFT rows are full (the loss mask costs nothing).
    Case("7b-lora-r16", "post-training", "1 GPU, LoRA R 16 alpha 32 on all linears (one adapter per fused weight), frozen bf16 "
         "base, ZeRO-1 (adapter state only), seq 4096, mb 1, gbs 8", model="llama2-7b", steps=6, warmup=3,
         flags=BF16 + LORA_7B + SFT_ROWS, expected_s=200, timeout_s=400),
    # QLoRA (issue 35): the same rows over a 4-bit base, quantized at start from the seed's weights; the peak counts the whole
    # run (build and quantization included). Full recompute fits in well under 20 GiB; recomputing half the layers trades
    # that room for speed.
    Case("7b-qlora-r16", "post-training", f"{L_QLORA}, full recompute", model="llama2-7b", steps=6, warmup=3,
         flags=BF16 + QLORA + ("--recompute-granularity", "full") + SFT_ROWS, expected_s=240, timeout_s=480,
         needs=("bnb",)),
    Case("7b-qlora-r16-recompute16", "post-training", f"{L_QLORA}, recompute 16 of 32 layers", model="llama2-7b", steps=6,
         warmup=3, flags=BF16 + QLORA + ("--recompute-granularity", "full", "--recompute-method", "block",
                                         "--recompute-num-layers", "16") + SFT_ROWS, expected_s=240, timeout_s=480,
         needs=("bnb",)),
    Case("7b-qlora-r16-norecompute", "post-training", f"{L_QLORA}, no recompute", model="llama2-7b", steps=6, warmup=3,
         flags=BF16 + QLORA + SFT_ROWS, expected_s=240, timeout_s=480, needs=("bnb",)),
    Case("13b-qlora-r16", "post-training", f"{L_QLORA}, full recompute", model="llama2-13b", steps=4, warmup=2,
         flags=BF16 + QLORA + ("--recompute-granularity", "full") + SFT_ROWS, expected_s=300, timeout_s=560, needs=("bnb",)),
    # does a 70B base fit one H200 in 4 bits (issue 46)? One row a step: a step of 8 would take most of a minute
    Case("70b-qlora-r16-probe", "post-training", f"{L_QLORA.replace('gbs 8', 'gbs 1')}, full recompute", model="llama2-70b",
         steps=2, warmup=1, flags=BF16 + QLORA + ("--recompute-granularity", "full", "--seq-length", "4096",
                                                 "--micro-batch-size", "1", "--global-batch-size", "1"),
         expected_s=300, timeout_s=560, needs=("bnb",)),
    _qlora_beside_peft("7b-qlora-peft", "every layer recomputed on both sides (PEFT: gradient checkpointing)"),
    # the same pair where the card holds every activation (an 80 GiB one): neither side recomputes
    _qlora_beside_peft("7b-qlora-peft-norecompute", "no recompute on either side", "--hybridlm-flags=", "--no-peft-recompute"),
    # each side at its fastest there: hybridlm compiled (its README setting for 48 GiB and up)
    _qlora_beside_peft("7b-qlora-peft-compiled", "no recompute on either side, hybridlm --torch-compile",
                       "--hybridlm-flags=--torch-compile", "--no-peft-recompute", expected_s=300),
    # every layer recomputed on both sides again (a 24 GiB card), hybridlm compiled (0.69x PEFT at 7c40540, before
    # the frozen base's GEMMs took flat rows: benchmarks/PROFILES.md)
    _qlora_beside_peft("7b-qlora-peft-compiled-recompute", "every layer recomputed on both sides, hybridlm --torch-compile",
                       "--hybridlm-flags=--torch-compile --recompute-granularity full"),
    Case("7b-full-zero3-offload", "post-training", "1 GPU, full fine-tuning, ZeRO-3 + CPU offload (params and optimizer), full "
         "recompute, bf16, seq 4096, mb 1, gbs 8", model="llama2-7b", steps=3, warmup=1,
         flags=("--bf16", "--deepspeed_config", "ds_configs/zero3_offload_cpu.json", "--recompute-granularity", "full") + SFT_ROWS,
         expected_s=500, timeout_s=580),
    Case("sft-qwen2-1p5b", "post-training", "SFT, Qwen2-1.5B shape, packed rows of 4096, mb 1, gbs 16, bf16, torch.compile; "
         "TRL SFTTrainer beside it", gpus=1,
         figures=("loss tokens/s", "positions/s", "peak GiB", "hybridlm/TRL", "SFT/pretraining"), launcher="python",
         script=("benchmarks/sft_throughput.py", "--out", "/tmp/sftbench-out", "--workdir", "/tmp/sftbench",
                 "--hybridlm-flags=--torch-compile"),
         expected_s=340, timeout_s=580),
    # hybridlm with the README's GRPO memory flags: bf16 AdamW moments and the MLP recomputed (one H200, ddc577a, 2 steps
    # after 1: peak 16.9 GiB without them, 10.7 with both; TRL's 11.7), at the same completions/s
    Case("grpo-qwen2-0p5b", "post-training", "GRPO, Qwen2-0.5B shape, random weights, G 8, completions of 512 tokens, 64 per step "
         "(mb 8), bf16, rollouts from hybridlm's own decoder, bf16 moments, MLP recomputed; TRL GRPOTrainer (transformers "
         "generate, no vLLM) beside it", gpus=1,
         figures=("completions/s", "generation s/step", "rest s/step", "peak GiB", "hybridlm/TRL"), launcher="python",
         script=("benchmarks/grpo_throughput.py", "--out", "/tmp/grpobench-out", "--workdir", "/tmp/grpobench",
                 "--hybridlm-flags=--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 "
                 "--recompute-granularity selective --recompute-modules mlp"),
         expected_s=420, timeout_s=590),
    Case("generation-qwen2-0p5b", "post-training", "greedy decoding, Qwen2-0.5B shape, random bf16 weights, batch 1 and 64, 512 "
         "new tokens; transformers generate beside it, compiled (static cache) and as TRL calls it", gpus=1,
         figures=("tokens/s", "decode step ms", "hybridlm/this", "rows equal"), launcher="python",
         script=("benchmarks/generation_speed.py", "--out", "/tmp/genbench-out", "--workdir", "/tmp/genbench", "--repeats", "1"),
         expected_s=300, timeout_s=560),
    # kernels
    Case("kernels", "kernels", "rmsnorm, rope, swiglu at the reference's shapes, bf16: eager, torch.compile, fused",
         figures=("fwd", "fwd+bwd"), launcher="python", script=("benchmarks/kernels.py",), expected_s=120),
    Case("attention", "kernels", "causal attention B4 H16 S4096 D128 bf16, fwd+bwd, each installed backend",
         figures=("TFLOP/s",), launcher="python",
         script=("benchmarks/attention.py", "--batch", "4", "--heads", "16", "--seq", "4096", "--head-dim", "128"), expected_s=60),
    # the planner against measured peaks
    _plan("plan-ref-zero0", 1, "1 GPU, ZeRO-0", "--deepspeed_config", "ds_configs/zero0.json"),
    _plan("plan-ref-tp2", 2, "TP=2 SP, ZeRO-1", "--tensor-model-parallel-size", "2", "--sequence-parallel", *ZERO1),
    _plan("plan-ref-pp2", 2, "PP=2, gbs 32 (8 micro-batches), ZeRO-1", "--pipeline-model-parallel-size", "2",
          "--global-batch-size", "32", *ZERO1),
    _plan("plan-ref-zero3", 2, "DP=2, ZeRO-3", "--deepspeed_config", "ds_configs/zero3.json"),
    _plan("plan-7b-zero1", 1, "llama2-7b shape, 4 of 32 layers, 1 GPU, ZeRO-1", "--num-layers", "4", *ZERO1, model="llama2-7b"),
    _plan("plan-7b-tp2-full", 2, "llama2-7b shape, 4 of 32 layers, TP=2 SP, full recompute, ZeRO-1", "--num-layers", "4",
          "--tensor-model-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "full", *ZERO1, model="llama2-7b"),
    # data
    Case("preprocess", "data", "byte-level BPE 32k on a 220 MB JSONL corpus: bare encoder, preprocess_data.py --workers 1 and 2",
         gpus=0, figures=("MB/s", "M tokens/s", "of bare encode_batch", "peak RSS"), launcher="python",
         script=("benchmarks/preprocess_bench.py", "--size-mb", "220"), peers=("megatron-lm",), expected_s=400, timeout_s=580),
    # the training monitor's cost
    Case("monitor-overhead", "monitor", "the reference on 1 GPU, ref-bf16's flags: monitor off, then --log-grad-noise-scale "
         "--log-comm-interval 5", launcher="python", script=("benchmarks/monitor_overhead.py", "--out", "/tmp/monitor-overhead"),
         figures=("step ms (monitor off)", "step ms (noise scale on, unsampled)", "noise scale cost per step",
                  "sampled step cost ms", "overhead at --log-comm-interval 500",
                  "overhead at --log-comm-interval 500 with the noise scale", "exposed comm share", "GPU busy share"),
         expected_s=300, timeout_s=580),
    # the test suite's check of the runner
    Case("cpu-tiny", "cpu", "built-in tiny model, 1 rank, ZeRO-0, fp32", model="tiny", gpus=0, steps=2, warmup=1,
         flags=("--deepspeed_config", "ds_configs/zero0.json"), expected_s=30, timeout_s=240),
)

BY_NAME = {case.name: case for case in CASES}


def select(suite: str | None = None, names: str | None = None) -> list[Case]:
    """The cases of a suite, or named ones (comma list), in declaration order; ValueError names what is unknown."""
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in BY_NAME]
        if unknown:
            raise ValueError(f"--cases: no case named {unknown[0]!r} (python -m benchmarks list shows them).")
        return [BY_NAME[n] for n in wanted]
    if suite not in SUITES:
        raise ValueError(f"--suite {suite!r}: the suites are {', '.join(SUITES)}.")
    return [case for case in CASES if case.suite == suite]
