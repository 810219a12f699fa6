"""The soak benchmark (benchmarks/soak.py), 30 seconds against a tiny random model: every answer as expected
(no 5xx, no dropped connection, good requests answered 200, or 429 while a burst fills the queue), the server's
RSS at the end within 10% of its RSS after the first seconds, and a clean exit on SIGTERM."""

import sys
from pathlib import Path

import pytest
from mlx_lm_reference import save_hf_model

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from soak import KINDS, Soak  # noqa: E402

pytestmark = pytest.mark.slow  # a `minimlx serve` process, 30 seconds


def test_a_30_second_soak_answers_everything_as_expected_with_flat_memory(tmp_path):
    save_hf_model(tmp_path, "llama")
    soak = Soak(str(tmp_path), long_words=200)
    try:
        soak.run(30, clients=4)
    finally:
        status = soak.stop()
    print(soak.report())
    assert soak.unexpected == [] and status == 0
    assert sum(soak.outcomes["burst"].values()) > soak.outcomes["burst"][429] > 0  # past the queue: some refused
    assert all(soak.outcomes[kind] for kind in KINDS)
    warm = soak.rss[2][1]  # after the first seconds: the prompt cache filled, MLX's buffers for the shapes seen
    assert soak.rss[-1][1] <= 1.1 * warm, soak.rss
