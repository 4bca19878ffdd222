"""`tgserve generate` mirrors the offline API and fails with a clear message and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

from tgserve import LLM, SamplingParams
from tgserve.server.testing.fixtures import fixture_path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tgserve", "generate", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_the_offline_api_result() -> None:
    model = str(fixture_path("llama"))
    done = run_cli("--model-id", model, "--prompt", "Once upon a time", "--max-new-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = LLM(model).generate(["Once upon a time"], SamplingParams(temperature=0.0, max_new_tokens=6))[0]
    assert result["token_ids"] == expected.token_ids
    assert result["finish_reason"] == expected.finish_reason


def test_generate_reports_a_missing_model() -> None:
    done = run_cli("--model-id", "/nonexistent/model", "--prompt", "hi")
    assert done.returncode == 2
    assert "does not exist" in done.stderr
