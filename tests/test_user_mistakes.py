"""What a new user gets wrong, and what they are told: each mistake ends in one sentence that names
the flag, file or line (exit code 2, before any process group, nothing written), or in the one log
line that says what the run did instead. Issue 37 found each of them by trying the README's
workflows as a new user would."""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

from chat_fixtures import tokenizer_dir, write_jsonl
from harness import run_ranks
from oracle import ROOT, TINY, ds_config

ZERO1 = ds_config("zero1")


def _main(argv: list[str], finetune: bool = False) -> tuple[int, str, str, bool]:
    """scripts/pretrain.py's (or finetune.py's) main on a forked rank: (exit code, stdout, stderr,
    whether a process group was created). An argparse exit counts as the exit code it carries."""
    import torch.distributed as dist

    from hybridlm.training.finetune import main as finetune_main
    from hybridlm.training.trainer import main as pretrain_main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = (finetune_main if finetune else pretrain_main)(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue(), dist.is_initialized()


def _finetune(argv: list[str]):
    return _main(argv, finetune=True)


def _refused(result, sentence: str) -> None:
    code, _, err, initialized = result
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and not initialized, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and sentence in lines[0], err


def _fake_checkpoint(directory, settings: list[str], step: int = 2) -> str:
    """A run directory as a training run's --save leaves it, as far as flag parsing reads it: 'latest'
    and the tag's config.yaml (enough for what is decided before any weight is read)."""
    from hybridlm.config import effective_yaml, parse_args
    tag = directory / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "config.yaml").write_text(effective_yaml(parse_args(settings)))
    (directory / "latest").write_text(f"global_step{step}")
    return str(directory)


# ---------------------------------------------------------------- 1. --load that holds no checkpoint

@pytest.mark.parametrize("where, sentence", [
    pytest.param("missing", "--load {load}: no such directory: fine-tuning starts from the weights it loads", id="typo"),
    pytest.param("empty", "--load {load} holds no checkpoint (no 'latest' file): fine-tuning starts", id="empty_dir"),
    pytest.param("tag", "is one checkpoint's folder, not the directory that holds them: use --load {parent} --ckpt-step 2",
                 id="tag_folder"),
])
def test_finetune_refuses_a_load_that_holds_no_checkpoint(tmp_path, where, sentence):
    run = _fake_checkpoint(tmp_path / "run", [])
    load = {"missing": str(tmp_path / "chekpoint"), "empty": str(tmp_path / "empty"), "tag": os.path.join(run, "global_step2")}[where]
    os.makedirs(tmp_path / "empty")
    result = run_ranks(1, _finetune, ["--task", "sft", "--load", load, "--data-path", str(tmp_path / "chat"),
                                      "--save", str(tmp_path / "out")] + ZERO1)[0]
    _refused(result, sentence.format(load=load, parent=run))
    assert not os.path.exists(tmp_path / "out")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step run of the oracle's tiny model whose --load (its own --save) held nothing yet: its output
    and the run directory, at global_step2."""
    run = str(tmp_path_factory.mktemp("saved") / "run")
    result = run_ranks(1, _main, TINY + ZERO1 + ["--train-iters", "2", "--save", run, "--load", run])[0]
    assert result[0] == 0, result[2]
    return run, result


def test_pretrain_from_an_empty_load_starts_from_scratch_and_says_so(saved_run):
    run, (_, _, err, _) = saved_run
    # (--save, the same directory, is created at start-up: its lock file lives there)
    assert (f"warning: --load {run} holds no checkpoint (no 'latest' file): training starts from scratch at iteration 0, "
            "as Megatron-LM does" in err), err


def test_a_resume_says_which_checkpoint_it_loaded(saved_run, tmp_path):
    run, _ = saved_run
    code, out, err, _ = run_ranks(1, _main, TINY + ZERO1 + ["--train-iters", "3", "--load", run])[0]
    assert code == 0, err
    assert f"--load {run}: resumed from global_step2 at iteration 2" in out, out


# ---------------------------------------------------------------- 4. resuming past the end

def test_resuming_past_the_end_says_so_in_one_line_and_exits_0(saved_run):
    run, _ = saved_run
    before = {name: os.stat(os.path.join(run, name)).st_mtime_ns for name in os.listdir(run)}
    code, out, err, _ = run_ranks(1, _main, TINY + ZERO1 + ["--train-iters", "1", "--load", run, "--save", run])[0]
    assert code == 0, err
    said = [line for line in out.splitlines() if "nothing to train" in line]
    assert said == [f"hybridlm: --load {run} is at iteration 2, at or past this run's end (--train-iters 1): nothing to train; "
                    "raise --train-iters to train further."], out
    assert "iter " not in out  # no step was logged
    assert {name: os.stat(os.path.join(run, name)).st_mtime_ns for name in os.listdir(run)} == before  # nothing written


# ---------------------------------------------------------------- 2. data tokenized with another vocabulary

@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A word-level tokenizer of 602 ids: its data does not fit the default byte vocabulary (257)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(600)} | {"<|endoftext|>": 600, "[UNK]": 601}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = str(tmp_path_factory.mktemp("words") / "words.json")
    tok.save(path)
    return path


def _word_data(tmp_path, tokenizer: str) -> str:
    from hybridlm.data.preprocess import preprocess
    from hybridlm.data.tokenizers import TokenizerSpec
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": " ".join(f"w{(7 * i + j) % 300}" for j in range(40))} for i in range(50)])
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer)
    return preprocess([docs], str(tmp_path / "words"), spec, append_eod=True, progress=False).outputs["text"]


def test_data_of_another_tokenizer_is_refused_naming_the_tokenizer_it_was_preprocessed_with(tmp_path, word_tokenizer):
    prefix = _word_data(tmp_path, word_tokenizer)
    result = run_ranks(1, _main, ["--data-path", prefix, "--save", str(tmp_path / "out")] + ZERO1)[0]
    _refused(result, f"--data-path {prefix} holds token ids up to 600, but the model's vocabulary has 257 (--tokenizer-type "
                     f"ByteTokenizer); it was preprocessed with --tokenizer-type HuggingFaceTokenizer --tokenizer-model "
                     f"{word_tokenizer}: give the same flags.")
    assert not os.path.exists(tmp_path / "out")


def test_megatron_preprocessed_data_is_sampled_and_the_missing_flags_named(tmp_path, word_tokenizer):
    from hybridlm.config import ConfigError, parse_args
    from hybridlm.data.indexed import ids_path
    from hybridlm.training.trainer import prepare_config
    prefix = _word_data(tmp_path, word_tokenizer)
    os.remove(ids_path(prefix))  # as Megatron's preprocess_data.py leaves it
    with pytest.raises(ConfigError, match=r"holds token ids up to 600, but the model's vocabulary has 512 \(--tokenizer-type "
                                          r"ByteTokenizer --vocab-size 512\); give the --tokenizer-type \(and --tokenizer-model\)"):
        prepare_config(parse_args(["--data-path", prefix, "--vocab-size", "512"] + ZERO1))
    cfg, _ = prepare_config(parse_args(["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
                                        "--tokenizer-model", word_tokenizer] + ZERO1))
    assert cfg.model.vocab_size == 602  # the right tokenizer passes


# ---------------------------------------------------------------- 3. the schedule

def _prepared(argv: list[str]):
    from hybridlm.config import parse_args
    from hybridlm.training.trainer import prepare_config
    return prepare_config(parse_args(argv + ZERO1))[0]


@pytest.mark.parametrize("iters", [1, 20, 300])
def test_the_builtin_run_takes_any_train_iters(iters):
    t = _prepared(["--train-iters", str(iters)]).train
    warmup, decay, _ = t.schedule_in_samples()
    assert warmup == pytest.approx(0.05 * decay) and decay == iters * t.global_batch_size  # 15 of the default 300 steps


def test_a_warmup_typed_replaces_the_builtin_fraction_and_keeps_megatrons_meaning():
    t = _prepared(["--train-iters", "20", "--lr-warmup-iters", "5"]).train
    assert (t.lr_warmup_iters, t.lr_warmup_fraction) == (5, None)
    assert t.schedule_in_samples()[0] == 5 * t.global_batch_size


@pytest.mark.parametrize("flags, sentence", [
    pytest.param(["--train-iters", "10", "--lr-warmup-iters", "10"],
                 "the warm-up (10 iterations: --lr-warmup-iters 10) must end before the decay (10 iterations: --lr-decay-iters, "
                 "default --train-iters) does, as Megatron-LM requires; shorten the warm-up with --lr-warmup-iters or "
                 "--lr-warmup-fraction, or lengthen the decay with --lr-decay-iters or --train-iters.", id="iterations"),
    pytest.param(["--train-samples", "80", "--lr-warmup-samples", "80"],
                 "the warm-up (80 samples: --lr-warmup-samples 80) must end before the decay (80 samples: --lr-decay-samples, "
                 "default --train-samples)", id="samples"),
    pytest.param(["--model", "warm", "--train-iters", "20"],
                 "the warm-up (20 iterations: --lr-warmup-iters 20 from --model warm) must end before the decay (20 iterations: "
                 "--lr-decay-iters, default --train-iters) does, as Megatron-LM requires; shorten the warm-up with "
                 "--lr-warmup-iters (yours wins over the preset)", id="a_presets_warmup"),
    pytest.param(["--train-iters", "10", "--lr-warmup-fraction", "1"], "--lr-warmup-fraction must be in [0, 1)", id="fraction"),
])
def test_a_warmup_longer_than_the_decay_names_every_flag_that_fixes_it(monkeypatch, flags, sentence):
    from hybridlm.config import ConfigError
    from hybridlm.presets import MODELS
    monkeypatch.setitem(MODELS, "warm", MODELS["tiny"][:-6] + ["--lr-warmup-iters", "20"])  # a preset counting iterations
    with pytest.raises(ConfigError) as refused:
        _prepared(flags)
    assert sentence in str(refused.value)


def test_finetuning_from_a_tiny_checkpoint_takes_its_model_not_the_presets_schedule(tmp_path):
    from hybridlm.training.finetune import parse_finetune_args
    load = _fake_checkpoint(tmp_path / "run", ["--model", "tiny", "--hidden-size", "64", "--lr-warmup-iters", "0"])
    cfg = parse_finetune_args(["--task", "sft", "--load", load, "--data-path", "chat", "--train-iters", "10"])
    assert (cfg.model.model, cfg.model.hidden_size) == ("tiny", 64)  # the checkpoint's model
    assert (cfg.train.lr_warmup_iters, cfg.train.lr_warmup_fraction, cfg.train.lr_decay_style) == (0, None, "linear")


# ---------------------------------------------------------------- bad values, flags and layouts

@pytest.mark.parametrize("flags, sentence", [
    pytest.param(["--lr", "-1"], "--lr must not be negative, got -1.", id="negative_lr"),
    pytest.param(["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1), got 1.", id="beta2_one"),
    pytest.param(["--weight-decay", "-0.1"], "--weight-decay must not be negative, got -0.1.", id="negative_weight_decay"),
])
def test_a_value_torch_would_refuse_is_one_sentence_before_any_process_group(tmp_path, flags, sentence):
    result = run_ranks(1, _main, flags + ["--save", str(tmp_path / "out")] + ZERO1)[0]
    _refused(result, sentence)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("flags, line", [
    pytest.param(["--task", "rlhf"], "error: argument --task: invalid choice: 'rlhf' (choose from 'pretrain', 'sft', 'dpo', 'grpo')",
                 id="unknown_task"),
    pytest.param(["--micro-batch-size", "two"], "error: argument --micro-batch-size: invalid int value: 'two'", id="not_a_number"),
    pytest.param(["--hidden-sise", "64"], "error: unrecognized arguments: --hidden-sise 64 (did you mean --hidden-size?)",
                 id="misspelt_flag"),
])
def test_an_argparse_mistake_is_one_line_printed_once_not_the_usage_per_rank(flags, line):
    (code0, out0, err0, _), (code1, out1, err1, _) = run_ranks(2, _main, flags + ZERO1)
    assert (code0, code1) == (2, 2)
    first, hint = err0.splitlines()  # two lines, not ~160 of usage
    assert first == line and hint.endswith(" --help lists every flag."), err0
    assert (out0, out1, err1) == ("", "", "")  # rank 1 leaves it to rank 0


def test_sequence_parallel_without_tensor_parallelism_is_turned_off_with_a_notice():
    cfg = _prepared(["--sequence-parallel"])
    assert not cfg.parallel.sequence_parallel
    assert "--sequence-parallel is off: it shards activations over the TP ranks, and --tensor-model-parallel-size is 1 " \
           "(Megatron-LM turns it off the same way)." in cfg.notes  # printed at start-up as "hybridlm: ..."


def test_plan_finds_a_layout_for_the_tiny_preset_on_its_own_1_gib_ranks(capsys):
    from hybridlm.planner.report import main
    assert main(["--model", "tiny", "--gpus", "2", "--gpu-memory", "1"]) == 0
    assert "need = total x 1.10 + 0.1 (--reserved-gib)" in capsys.readouterr().out
    assert main(["--model", "tiny", "--gpus", "2", "--gpu-memory", "80"]) == 0
    assert "need = total x 1.10 + 2 (--reserved-gib)" in capsys.readouterr().out  # a GPU's CUDA context and NCCL, as before
    assert main(["--model", "tiny", "--gpus", "2", "--gpu-memory", "1", "--reserved-gib", "0.5"]) == 0
    assert "need = total x 1.10 + 0.5 (--reserved-gib)" in capsys.readouterr().out


# ---------------------------------------------------------------- 5. chat records

@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return tokenizer_dir("chatml", tmp_path_factory.mktemp("chatml"))


def _preprocess_chat(argv: list[str], capsys) -> tuple[int, str, str]:
    import importlib.util
    spec = importlib.util.spec_from_file_location("preprocess_chat", os.path.join(ROOT, "scripts", "preprocess_chat.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    code = script.main(argv + ["--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


GOOD = {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on a mat"}]}
BOT = {"messages": [{"role": "user", "content": "the cat"}, {"role": "bot", "content": "sat on a mat"}]}
NO_REPLY = {"messages": [{"role": "user", "content": "only a question"}]}


def test_a_chat_record_with_an_unknown_role_is_refused_naming_its_line(tmp_path, chatml, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, BOT])
    code, out, err = _preprocess_chat(["--input", data, "--output-prefix", str(tmp_path / "out" / "chat"),
                                       "--tokenizer-model", chatml], capsys)
    assert code == 2 and out == ""
    assert err.strip() == (f"error: {data}:3: messages[1] has the unknown role 'bot'; the roles are system, developer, user, "
                           "assistant, tool, function, ipython.")
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")


def test_skip_bad_lines_skips_an_unknown_role_and_says_which_line(tmp_path, chatml, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, {"messages": [{"role": "human", "content": "hi"}]}, GOOD])
    code, out, err = _preprocess_chat(["--input", data, "--output-prefix", str(tmp_path / "chat"), "--tokenizer-model", chatml,
                                       "--skip-bad-lines"], capsys)
    assert code == 0
    assert err.strip() == (f"skipped {data}:2: messages[0] has the unknown role 'human' (did you mean 'user'?); the roles are "
                           "system, developer, user, assistant, tool, function, ipython")
    assert "2 conversations" in out and "1 bad line(s) skipped" in out


def test_a_conversation_without_an_assistant_turn_is_dropped_naming_its_line(tmp_path, chatml, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", [GOOD, NO_REPLY, GOOD])
    code, out, err = _preprocess_chat(["--input", data, "--output-prefix", str(tmp_path / "chat"), "--tokenizer-model", chatml],
                                      capsys)
    assert code == 0
    assert err.strip() == f"dropped {data}:2: no assistant turn, so nothing to train"
    with open(tmp_path / "chat.manifest.json") as f:
        assert json.load(f)["dropped_no_loss_tokens"] == 1


# ---------------------------------------------------------------- what a correct run does not say

def _pipeline_warnings(argv: list[str]) -> tuple[int, list[str]]:
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = _main(argv)[0]
    return code, [str(w.message) for w in caught if "autograd kernel was not registered" in str(w.message)]


def test_a_pipeline_with_tied_embeddings_trains_and_resumes_without_an_autograd_warning(tmp_path):
    run = str(tmp_path / "run")
    flags = TINY + ZERO1 + ["--pipeline-model-parallel-size", "2", "--save", run]
    for argv in (flags + ["--train-iters", "1"], flags + ["--train-iters", "2", "--load", run]):
        assert run_ranks(2, _pipeline_warnings, argv, timeout=300) == [(0, []), (0, [])]


# ---------------------------------------------------------------- issue 47, item 6: the smaller ones

def _init_on_a_taken_port() -> str:
    """In a child: rank 0 of a one-rank launch whose MASTER_PORT another process listens on."""
    import socket

    from hybridlm.config import ConfigError
    from hybridlm.training.distributed import init_distributed
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(holder.getsockname()[1]), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        init_distributed(0.5)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - what the user would have seen instead
        return f"{type(e).__name__}: {e}"
    return "no error"


def _in_a_child(fn):
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=lambda: results.put(fn()))
    child.start()
    try:
        return results.get(timeout=60)
    finally:
        child.join(timeout=10)


def test_a_taken_rendezvous_port_is_one_sentence_naming_the_launchers_flag():
    """The README's first command when another job holds port 29500: one sentence, not an EADDRINUSE traceback."""
    message = _in_a_child(_init_on_a_taken_port)
    assert message.startswith("the rendezvous port ") and "is taken by another process" in message, message
    assert "deepspeed --master_port N" in message and "\n" not in message
    from harness import port_was_taken
    assert port_was_taken(message), "the tests' and the benchmark runner's retry on a taken port would not recognise this sentence"


def _metrics(path, *keys) -> str:
    path.write_text("".join(json.dumps({"iteration": i, "loss": 5.0 - i, **{k: 0.5 for k in keys}}) + "\n" for i in range(1, 4)))
    return str(path)


def test_a_mistyped_series_key_is_one_sentence_naming_the_logged_ones(tmp_path, capsys):
    from hybridlm.training.curves import main
    run = _metrics(tmp_path / "a.jsonl", "mfu")
    assert main(["--series", "mfuu", run]) == 2
    err = capsys.readouterr().err
    assert err == "error: --series mfuu: no run logged a figure of that name (did you mean mfu?); they logged iteration, loss, mfu.\n"


def test_plot_without_matplotlib_names_the_install_extra_that_brings_it(tmp_path, capsys, monkeypatch):
    import re as regex

    from hybridlm.training.curves import main
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["--series", "loss", _metrics(tmp_path / "a.jsonl"), "--plot", str(tmp_path / "p.png")]) == 2
    extra = regex.search(r"pip install -e '\.\[(\w+)\]'", capsys.readouterr().err).group(1)
    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert regex.search(rf'"{extra}": \[[^\]]*"matplotlib"', setup), f"setup.py's {extra} extra does not bring matplotlib"


def test_recompute_of_a_part_the_model_does_not_have_says_it_does_nothing():
    from hybridlm.config import parse_args
    cfg = parse_args(["--recompute-granularity", "selective", "--recompute-modules", "moe", "core_attn"]).validate(1)
    assert cfg.parallel.recompute_modules == ["core_attn"]
    assert "--recompute-modules moe does nothing here: the model has no MoE layers (no --num-experts)." in cfg.notes


def test_the_replica_check_without_replicas_says_it_is_off_instead_of_that_they_agree():
    from hybridlm.config import parse_args
    cfg = parse_args(["--check-weight-hash-across-dp-replicas-interval", "10"]).validate(1)
    assert cfg.train.check_weight_hash_across_dp_replicas_interval is None
    assert any(note.startswith("--check-weight-hash-across-dp-replicas-interval is off: DP x CP is 1") for note in cfg.notes)
    assert parse_args(["--check-weight-hash-across-dp-replicas-interval", "10"]).validate(2).train \
        .check_weight_hash_across_dp_replicas_interval == 10


def test_train_tokenizer_exits_2_on_bad_input_as_every_other_tool(tmp_path, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_tokenizer", os.path.join(ROOT, "scripts", "train_tokenizer.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "tok")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_a_negative_lr_in_scientific_notation_gets_the_flags_own_sentence():
    from hybridlm.config import ConfigError, parse_args
    with pytest.raises(ConfigError, match=r"^--lr must not be negative, got -0.001\.$"):
        parse_args(["--lr", "-1e-3"]).validate(1)
