"""The rlbus command: fast help, clear errors, prompt files validated before publishing."""

import argparse
import resource
import subprocess
import sys

import pytest

from rlbus.ops.admin import read_prompts


def _args(**kw):
    base = {"group_size": 4, "run_name": "f", "max_new_tokens": 8, "temperature": 1.0}
    return argparse.Namespace(**{**base, **kw})


def test_help_is_fast_and_imports_nothing_heavy():
    code = (
        "import sys, time; t = time.perf_counter()\n"
        "from rlbus.ops.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "print(heavy, file=sys.stderr)"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert "demo" in out.stdout and "feed" in out.stdout and "model" in out.stdout
    assert out.stderr.strip() == "[]"
    # CPU time, which a loaded machine does not stretch as it does wall time: generous, a
    # guard against importing torch
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert cpu_s < 10, cpu_s


def test_prompt_file_is_read_with_defaults(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"task": "guess_number", "spec": {"target": 3}}\n\n'
                    '{"task": "addition", "spec": {"a": 1, "b": 2}, "group_size": 2}\n')
    prompts = read_prompts(path, _args())
    assert [p.group_id for p in prompts] == ["f/1", "f/3"]
    assert [p.group_size for p in prompts] == [4, 2]
    assert prompts[0].sampling.max_new_tokens == 8


def test_bad_prompt_line_names_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"task": "guess_number"}\n{"spec": {}}\n')
    with pytest.raises(SystemExit, match=r"p.jsonl:2: not a prompt \(KeyError"):
        read_prompts(path, _args())


def test_missing_prompt_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        read_prompts(tmp_path / "nope.jsonl", _args())


def test_invalid_settings_fail_with_the_key_named(monkeypatch):
    monkeypatch.setenv("RLBUS_NOT_A_SETTING", "1")
    from rlbus.runner import run_service

    with pytest.raises(SystemExit, match="RLBUS_NOT_A_SETTING"):
        run_service("reward")


def test_a_misspelt_variable_names_the_one_meant(monkeypatch):
    monkeypatch.setenv("RLBUS_KAFKA__BOOTSTRAPP", "h:1")
    from rlbus.ops.cli import main

    with pytest.raises(SystemExit, match=r"rlbus topics: invalid settings: .*"
                       r"RLBUS_KAFKA__BOOTSTRAPP \(did you mean RLBUS_KAFKA__BOOTSTRAP\?\)"):
        main(["topics", "list"])


def test_unreachable_broker_is_a_clear_error_not_a_hang():
    from rlbus.reward.service import Reward
    from rlbus.reward.settings import RewardSettings
    from rlbus.settings import KafkaSettings
    from rlbus.transport import BrokerConnectError

    settings = RewardSettings(kafka=KafkaSettings(bootstrap="127.0.0.1:1", request_timeout_s=5))

    async def start():
        await Reward(settings).run()

    import asyncio

    with pytest.raises(BrokerConnectError, match=r"nothing listens at 127.0.0.1:1"):
        asyncio.run(start())


def test_acl_dry_run_prints_the_rows_without_connecting(monkeypatch, capsys):
    monkeypatch.setenv("RLBUS_TOPICS__PREFIX", "dry")
    monkeypatch.setenv("RLBUS_KAFKA__BOOTSTRAP", "127.0.0.1:1")  # nothing listens there
    from rlbus.ops.cli import main

    assert main(["acl", "apply", "--dry-run", "--principal", "rollout=svc-r"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "User:svc-r       WRITE    TOPIC            LITERAL  dry.trajectories" in lines
    assert "User:reward      WRITE    TRANSACTIONAL_ID PREFIXED dry.reward-" in lines
    with pytest.raises(SystemExit, match="expected ROLE=USER"):
        main(["acl", "apply", "--dry-run", "--principal", "admin=root"])
