"""The DeepSpeed dict handed to deepspeed.initialize: what hybridlm adds beyond the "auto" values."""
import json

from hybridlm.config import parse_args
from hybridlm.training.trainer import prepare_config

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "8"]


def test_deepspeeds_throughput_timer_does_not_synchronise_the_device_at_every_micro_batch():
    _, ds = prepare_config(parse_args(TINY + ["--deepspeed_config", "ds_configs/zero1.json"]))
    assert ds["timers"]["throughput"] == {"enabled": False, "synchronized": False}


def test_a_json_that_configures_the_throughput_timer_keeps_its_setting(tmp_path):
    shipped = json.load(open("ds_configs/zero1.json"))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**shipped, "timers": {"throughput": {"enabled": True, "synchronized": True}}}))
    _, ds = prepare_config(parse_args(TINY + ["--deepspeed_config", str(path)]))
    assert ds["timers"]["throughput"] == {"enabled": True, "synchronized": True}
