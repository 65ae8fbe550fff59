"""The DeepSpeed dict handed to deepspeed.initialize: what hybridlm adds beyond the "auto" values."""
import json
import os

from oracle import ROOT, TINY, ds_config

from hybridlm.config import parse_args
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
