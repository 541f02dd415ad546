"""Secrets never reach a file: redaction by name and by value in records, logs and CLI errors."""

from __future__ import annotations

import json
import logging

import pytest
from huggingface_hub import constants as hf_constants

from hf_pma.utils.fs import atomic_write_json
from hf_pma.utils.logs import RedactingFilter
from hf_pma.utils.secrets import find_named_secrets, is_secret_name, redact, redact_obj, tokens_in_use
from tests.helpers.cli import run_cli

IN_USE = "in-use-token-not-shaped-like-hf-0123"  # only its value gives it away


@pytest.fixture()
def token_in_use(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", IN_USE)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    return IN_USE


@pytest.mark.parametrize(
    "text, expected",
    [
        ("pretrain.py --hub_token SECRET --max_steps 5", "pretrain.py --hub_token *** --max_steps 5"),
        ("x --hub-token=SECRET y", "x --hub-token=*** y"),
        ("x --token 'SEC RET' y", "x --token '***' y"),
        ("x --wandb_api_key abc --my-service-token=zz", "x --wandb_api_key *** --my-service-token=***"),
        ("HF_TOKEN=SECRET WANDB_API_KEY=k2 python x.py", "HF_TOKEN=*** WANDB_API_KEY=*** python x.py"),
        ('{"hub_token": "SECRET", "push_to_hub": true}', '{"hub_token": "***", "push_to_hub": true}'),
        ("TrainingArguments(hub_token='SECRET', seed=1)", "TrainingArguments(hub_token='***', seed=1)"),
        # not secrets: tokenizer words, token counts, a flag without a value, redacted values
        ("--eos_token </s> --pad_token <pad>", "--eos_token </s> --pad_token <pad>"),
        ("--pma_interval_tokens 1024 --max_tokens 5", "--pma_interval_tokens 1024 --max_tokens 5"),
        ("--hub_token *** --token None", "--hub_token *** --token None"),
    ],
)
def test_redact_by_name(text, expected):
    assert redact(text) == expected
    assert find_named_secrets(redact(text)) == []


def test_redact_by_value_whatever_its_shape(token_in_use):
    assert token_in_use in tokens_in_use()
    text = f"curl -H 'Authorization: Bearer {token_in_use}' https://x/{token_in_use}/y"
    assert redact(text) == "curl -H 'Authorization: Bearer ***' https://x/***/y"
    assert redact("a value given by the caller: value-given-1234", ["value-given-1234"]).endswith(": ***")
    assert redact("short: abc", ["abc"]) == "short: abc"  # too short to be a token: left alone


def test_redact_obj_masks_secret_keys_and_values(token_in_use):
    record = {
        "command": f"x --hub_token {token_in_use}",
        "args": {"hub_token": "other", "eos_token": "</s>"},
        "log": [f"pushed with {token_in_use}"],
        "tokens": 5,
    }
    clean = redact_obj(record)
    assert clean == {
        "command": "x --hub_token ***",
        "args": {"hub_token": "***", "eos_token": "</s>"},
        "log": ["pushed with ***"],
        "tokens": 5,
    }
    assert is_secret_name("--hub-token") and is_secret_name("HF_TOKEN") and not is_secret_name("num_tokens")


def test_every_json_record_written_is_redacted(token_in_use, tmp_path):
    path = tmp_path / "record.json"
    atomic_write_json(path, {"command": f"train --token {token_in_use}", "note": f"HF_TOKEN={token_in_use}"})
    text = path.read_text()
    assert token_in_use not in text and json.loads(text) == {
        "command": "train --token ***",
        "note": "HF_TOKEN=***",
    }


def test_log_lines_are_redacted(token_in_use):
    record = logging.LogRecord(
        "hf_pma.x", logging.INFO, __file__, 1, "pushing with %s", (token_in_use,), None
    )
    assert RedactingFilter().filter(record) and record.getMessage() == "pushing with ***"


def test_cli_error_lines_are_redacted(tmp_path):
    env = {
        "HF_TOKEN": IN_USE,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "home"),
        "PATH": "/usr/bin:/bin",
    }
    missing = tmp_path / IN_USE
    proc = run_cli("merge", missing, "-o", tmp_path / "m", env=env, process=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert IN_USE not in proc.stderr and "***" in proc.stderr


@pytest.mark.parametrize(
    "text, expected",
    [
        ("HF_ENDPOINT=http://user:pass@host:8080/api", "HF_ENDPOINT=http://***@host:8080/api"),
        ("cannot reach https://hub-user:p@ss@mirror.local/x", "cannot reach https://***@mirror.local/x"),
        ("https://tok-not-hf-shaped@hf.co/org/m", "https://***@hf.co/org/m"),  # a token as the user alone
        # no user information: kept as they are
        ("https://huggingface.co/org/m?x=a@b", "https://huggingface.co/org/m?x=a@b"),
        ("git@github.com:org/repo, mail a@b.com", "git@github.com:org/repo, mail a@b.com"),
        ("http://***@host", "http://***@host"),
    ],
)
def test_redact_credentials_in_urls(text, expected):
    assert redact(text) == expected
    assert redact_obj({"endpoint": text}) == {"endpoint": expected}


def test_cli_error_lines_redact_a_password_in_hf_endpoint(tmp_path):
    env = {
        "HF_ENDPOINT": "http://someone:s3cr3t-pw@127.0.0.1:9/",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path),
    }
    proc = run_cli("merge", "http://someone:s3cr3t-pw@127.0.0.1:9/x", "-o", tmp_path / "m", env=env)
    assert proc.returncode == 2, proc.stderr
    assert "s3cr3t-pw" not in proc.stderr and "someone" not in proc.stderr and "***@127.0.0.1" in proc.stderr
