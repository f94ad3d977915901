"""train_dapo.py's model loading (dapo_trl/cli/train.py): the ModelConfig flags and `--model_init_kwargs` as
from_pretrained's keywords, and bitsandbytes quantization, built as TRL's scripts build it or refused with the reason.

Nothing trains here: from_pretrained is replaced by a recorder, except where the built-in tiny model (a local folder)
is loaded to see a keyword take effect."""

import inspect
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from trl import GRPOTrainer

from dapo_trl.cli import DAPOParser, UserFacingError, load_model_and_tokenizer, main
from dapo_trl.cli import train as cli_train


def parse(tmp_path, *flags):
    """(ModelConfig flags, DAPOConfig) of a command line."""
    _, config, model_args = DAPOParser().parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--report_to", "none", *flags]
    )
    return model_args, config


def init_kwargs(value: dict) -> list[str]:
    return ["--model_init_kwargs", json.dumps(value)]


@pytest.fixture
def from_pretrained(monkeypatch):
    """The keywords AutoModelForCausalLM.from_pretrained receives, one dict per call; no model is loaded (the
    tokenizer is: the built-in tiny model's, from its local folder)."""
    calls = []

    def record(name, **kwargs):
        calls.append(kwargs)
        return object()

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(record))
    return calls


@pytest.fixture
def cuda_with_bitsandbytes(monkeypatch):
    """A machine with a CUDA GPU and bitsandbytes, as far as train_dapo.py's checks can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli_train, "is_bitsandbytes_available", lambda: True)


# ------------------------------------------------------------------------------------ flags and model_init_kwargs
def test_flags_reach_from_pretrained(tmp_path, from_pretrained):
    model_args, config = parse(tmp_path, "--attn_implementation", "eager", "--dtype", "bfloat16")
    load_model_and_tokenizer(model_args, config)
    assert from_pretrained == [
        {"revision": "main", "trust_remote_code": False, "attn_implementation": "eager", "dtype": "bfloat16"}
    ]


def test_model_init_kwargs_reach_from_pretrained_and_the_reference_model(tmp_path, from_pretrained):
    """Every key reaches from_pretrained, over the flags left at their defaults (--dtype float32 here), as in TRL's
    grpo.py; they become the config's model_init_kwargs, with which TRL loads the reference model."""
    given = {"attn_implementation": "eager", "dtype": "bfloat16", "low_cpu_mem_usage": True}
    model_args, config = parse(tmp_path, *init_kwargs(given))
    load_model_and_tokenizer(model_args, config)
    (kwargs,) = from_pretrained
    assert kwargs == {"revision": "main", "trust_remote_code": False, **given}
    assert config.model_init_kwargs == kwargs


def test_model_init_kwargs_load_the_tiny_model_with_them(tmp_path):
    default_args, default_config = parse(tmp_path)
    default_model, _ = load_model_and_tokenizer(default_args, default_config)
    model_args, config = parse(tmp_path, *init_kwargs({"attn_implementation": "eager", "dtype": "bfloat16"}))
    model, tokenizer = load_model_and_tokenizer(model_args, config)
    assert (default_model.config._attn_implementation, default_model.dtype) != ("eager", torch.bfloat16)
    assert (model.config._attn_implementation, model.dtype) == ("eager", torch.bfloat16)
    assert tokenizer.pad_token is not None


@pytest.mark.parametrize(
    "flag, value, key, other",
    [
        ("attn_implementation", "sdpa", "attn_implementation", "eager"),
        ("dtype", "float16", "dtype", "bfloat16"),
        ("model_revision", "v1", "revision", "v2"),
        ("trust_remote_code", "true", "trust_remote_code", False),
    ],
)
def test_a_flag_and_model_init_kwargs_that_disagree_are_refused(tmp_path, from_pretrained, flag, value, key, other):
    model_args, config = parse(tmp_path, f"--{flag}", value, *init_kwargs({key: other}))
    with pytest.raises(UserFacingError, match=f"--{flag} .* and --model_init_kwargs' '{key}': {other!r} disagree"):
        load_model_and_tokenizer(model_args, config)
    assert not from_pretrained


def test_a_flag_and_model_init_kwargs_that_agree_load(tmp_path, from_pretrained):
    model_args, config = parse(
        tmp_path, "--attn_implementation", "eager", *init_kwargs({"attn_implementation": "eager"})
    )
    load_model_and_tokenizer(model_args, config)
    assert from_pretrained[0]["attn_implementation"] == "eager"


def test_torch_dtype_is_dtype(tmp_path, from_pretrained):
    """transformers' old name would lose to the dtype --dtype passes: it is read as dtype."""
    model_args, config = parse(tmp_path, *init_kwargs({"torch_dtype": "bfloat16"}))
    load_model_and_tokenizer(model_args, config)
    assert from_pretrained[0]["dtype"] == "bfloat16" and "torch_dtype" not in from_pretrained[0]
    model_args, config = parse(tmp_path, *init_kwargs({"torch_dtype": "bfloat16", "dtype": "float16"}))
    with pytest.raises(UserFacingError, match="both 'dtype' and 'torch_dtype'"):
        load_model_and_tokenizer(model_args, config)


def test_trl_warning_that_model_init_kwargs_are_ignored_is_dropped():
    """GRPOTrainer says model_init_kwargs are ignored when the model comes loaded; train_dapo.py loaded it with them."""
    assert cli_train.IGNORED_INIT_KWARGS in inspect.getsource(GRPOTrainer.__init__)
    drop = cli_train.DropIgnoredInitKwargsWarning()

    def record(message):
        return logging.LogRecord("trl.trainer.grpo_trainer", logging.WARNING, __file__, 1, message, None, None)

    assert not drop.filter(record(f"You passed `model_init_kwargs` ... {cli_train.IGNORED_INIT_KWARGS}."))
    assert drop.filter(record("You passed `quantization_config` to the trainer, but ..."))


# ------------------------------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("flag", ["--load_in_4bit", "--load_in_8bit"])
def test_quantization_is_refused_without_cuda(tmp_path, monkeypatch, from_pretrained, flag):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model_args, config = parse(tmp_path, flag, "true", "--use_peft", "true", "--dtype", "bfloat16")
    with pytest.raises(UserFacingError, match=f"{flag}: bitsandbytes' 4-bit and 8-bit weights need a CUDA GPU") as e:
        load_model_and_tokenizer(model_args, config)
    assert f"Drop {flag} to train the model unquantized" in str(e.value)
    assert not from_pretrained


def test_quantization_refusal_reaches_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = ["--output_dir", str(tmp_path), "--report_to", "none", "--load_in_4bit", "true", "--use_peft", "true"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "error: --load_in_4bit: bitsandbytes' 4-bit and 8-bit weights need a CUDA GPU" in err
    assert "Traceback" not in err


def test_4bit_is_built_as_trl_builds_it_on_this_process_gpu(tmp_path, from_pretrained, cuda_with_bitsandbytes):
    model_args, config = parse(
        tmp_path,
        *("--load_in_4bit", "true", "--use_peft", "true", "--dtype", "bfloat16", "--bnb_4bit_quant_type", "fp4"),
        *("--use_bnb_nested_quant", "true"),
    )
    load_model_and_tokenizer(model_args, config)
    (kwargs,) = from_pretrained
    quantization = kwargs["quantization_config"]
    assert isinstance(quantization, BitsAndBytesConfig) and quantization.load_in_4bit
    assert quantization.bnb_4bit_quant_type == "fp4" and quantization.bnb_4bit_use_double_quant
    assert quantization.bnb_4bit_compute_dtype == torch.bfloat16
    assert kwargs["device_map"] == {"": 0} and kwargs["dtype"] == "bfloat16"
    assert "quantization_config" not in config.model_init_kwargs  # LoRA: no reference model to quantize


def test_8bit_keeps_a_device_map_from_model_init_kwargs(tmp_path, from_pretrained, cuda_with_bitsandbytes):
    model_args, config = parse(
        tmp_path, "--load_in_8bit", "true", "--use_peft", "true", *init_kwargs({"device_map": "auto"})
    )
    load_model_and_tokenizer(model_args, config)
    (kwargs,) = from_pretrained
    assert kwargs["quantization_config"].load_in_8bit and kwargs["device_map"] == "auto"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--load_in_4bit", "true", "--dtype", "bfloat16"], "--load_in_4bit needs --use_peft true"),
        (["--load_in_4bit", "true", "--use_peft", "true", "--dtype", "auto"], "--load_in_4bit computes in --dtype"),
        (
            [
                "--load_in_8bit",
                "true",
                "--use_peft",
                "true",
                *init_kwargs({"quantization_config": {"load_in_8bit": True}}),
            ],
            "--load_in_8bit and --model_init_kwargs' 'quantization_config' both quantize",
        ),
    ],
)
def test_quantization_mistakes_are_named(tmp_path, from_pretrained, cuda_with_bitsandbytes, flags, message):
    model_args, config = parse(tmp_path, *flags)
    with pytest.raises(UserFacingError, match=message):
        load_model_and_tokenizer(model_args, config)
    assert not from_pretrained


def test_quantization_needs_bitsandbytes(tmp_path, monkeypatch, from_pretrained):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli_train, "is_bitsandbytes_available", lambda: False)
    model_args, config = parse(tmp_path, "--load_in_8bit", "true", "--use_peft", "true")
    with pytest.raises(
        UserFacingError, match="--load_in_8bit needs the bitsandbytes package: pip install bitsandbytes"
    ):
        load_model_and_tokenizer(model_args, config)


@pytest.mark.parametrize(
    "flags",
    [["--bnb_4bit_quant_type", "fp4"], ["--use_bnb_nested_quant", "true"], ["--bnb_4bit_quant_storage", "uint8"]],
)
def test_4bit_flags_without_4bit_are_refused(tmp_path, from_pretrained, flags):
    model_args, config = parse(tmp_path, *flags)
    with pytest.raises(UserFacingError, match=f"{flags[0]}: shape 4-bit weights only; add --load_in_4bit true"):
        load_model_and_tokenizer(model_args, config)
