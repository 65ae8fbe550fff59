"""The DeepSpeed dict handed to deepspeed.initialize: what hybridlm adds beyond the "auto" values."""
import json
import os

import pytest
from oracle import ROOT, TINY, ds_config

from hybridlm.config import ConfigError, parse_args
from hybridlm.training.trainer import prepare_config


def test_deepspeeds_throughput_timer_is_off_so_it_does_not_synchronise_the_device_at_every_micro_batch():
    _, ds = prepare_config(parse_args(TINY + ds_config("zero1")))
    assert ds["timers"]["throughput"] == {"enabled": False, "synchronized": False}


def test_a_json_that_configures_the_throughput_timer_keeps_its_setting(tmp_path):
    shipped = json.load(open(os.path.join(ROOT, "ds_configs", "zero1.json")))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**shipped, "timers": {"throughput": {"enabled": True, "synchronized": True}}}))
    _, ds = prepare_config(parse_args(TINY + ["--deepspeed_config", str(path)]))
    assert ds["timers"]["throughput"] == {"enabled": True, "synchronized": True}


def test_megatrons_fp32_gradient_accumulation_and_reduction_become_deepspeeds_dtypes():
    _, ds = prepare_config(parse_args(TINY + ["--bf16", "--accumulate-allreduce-grads-in-fp32"] + ds_config("zero1")))
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    _, ds = prepare_config(parse_args(TINY + ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"]
                                      + ds_config("zero1")))
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "bf16"
    _, ds = prepare_config(parse_args(TINY + ["--bf16"] + ds_config("zero1")))  # DeepSpeed's default: bf16 throughout
    assert "data_types" not in ds and "communication_data_type" not in ds


@pytest.mark.parametrize("given, sentence", [
    ("bf16", 'asks for "communication_data_type": "fp32" but .*ds.json says \'bf16\''),
    ("float32", None),  # DeepSpeed's other name for fp32 agrees
    ("fp33", '"communication_data_type": \'fp33\' in .*ds.json is not a dtype DeepSpeed knows'),
], ids=["contradicts", "same-dtype-other-name", "not-a-dtype"])
def test_a_json_that_contradicts_fp32_gradients_is_refused_naming_the_key(tmp_path, given, sentence):
    shipped = json.load(open(os.path.join(ROOT, "ds_configs", "zero1.json")))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**shipped, "communication_data_type": given}))
    flags = TINY + ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--deepspeed_config", str(path)]
    if sentence is None:
        assert prepare_config(parse_args(flags))[1]["communication_data_type"] == "fp32"
    else:
        with pytest.raises(ConfigError, match=sentence):
            prepare_config(parse_args(flags))


@pytest.mark.parametrize("flags, sentence", [
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], "cannot be combined with --fp16"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
], ids=["fp16", "reduce-in-bf16-without-bf16"])
def test_gradient_precision_flags_that_cannot_work_are_one_sentence(flags, sentence):
    with pytest.raises(ConfigError, match=sentence):
        parse_args(TINY + flags + ds_config("zero1")).validate(world_size=1)


def test_fp32_gradients_at_ep2_x_dp2_in_bf16_follow_one_process_to_bf16_rounding():
    # DeepSpeed's BF16_Optimizer (what ZeRO-1 takes with fp32 accumulation) with expert parameter groups: the
    # EP layout's losses and gradient norms stay with one process's over 6 bf16 steps.
    from harness import run_ranks
    from oracle import train_and_probe
    flags = TINY + ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--num-experts", "4", "--moe-router-topk", "2",
                    "--lr", "1e-3"] + ds_config("zero1")
    single = run_ranks(1, train_and_probe, flags, 6)[0]
    split = run_ranks(4, train_and_probe, flags + ["--expert-model-parallel-size", "2"], 6)[0]
    for key in ("losses", "grad_norms"):
        for step, (want, got) in enumerate(zip(single[key], split[key]), start=1):
            assert abs(got - want) <= 2e-2 * abs(want), f"step {step} {key[:-1]}: EP2 x DP2 {got}, one process {want}"


def _muon_modules_seen_by_deepspeed(json_optimizers: list) -> list:
    """In a fresh rank without DeepSpeed's Muon modules: after ``answer_muon_checks`` for each JSON optimizer in
    turn, what DeepSpeed's own imports get (torch AdamW is a MuonWithAuxAdam? muon_update's module?)."""
    import sys

    import torch

    from hybridlm.training import deepspeed_muon
    for name in (deepspeed_muon._DEEPSPEED_MUON, deepspeed_muon._DEEPSPEED_MUON_KERNELS):
        sys.modules.pop(name, None)
    seen = []
    for optimizer in json_optimizers:
        deepspeed_muon.answer_muon_checks({"optimizer": optimizer} if optimizer else {})
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        from deepspeed.runtime.zero.muon.original_muon import muon_update
        adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
        seen.append((MuonWithAuxAdam.__module__, isinstance(adamw, MuonWithAuxAdam), muon_update.__module__))
    return seen


def test_deepspeeds_muon_modules_are_imported_only_for_a_json_that_names_muon():
    # Importing them costs every rank ~3 s (their top-level torch.compile imports Inductor). Without Muon, DeepSpeed's
    # isinstance checks get a class no optimizer is an instance of, and muon_update loads the real one if ever called.
    from harness import run_ranks
    [seen] = run_ranks(1, _muon_modules_seen_by_deepspeed, [None, {"type": "AdamW"}, {"type": "Muon"}])
    stand_in = ("hybridlm.training.deepspeed_muon", False, "hybridlm.training.deepspeed_muon")
    real = ("deepspeed.runtime.zero.muon.muon_optimizer", False, "deepspeed.runtime.zero.muon.original_muon")
    assert seen == [stand_in, stand_in, real]
