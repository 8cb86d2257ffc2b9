"""benchmarks/tokens_to_target.py: the power law it fits is exact on a curve that is one."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.tokens_to_target import curves_from_log, parse_points, tokens_to  # noqa: E402


def test_a_power_law_curve_is_solved_exactly():
    # excess 0.5 at 1M tokens falling as tokens^-0.5: 0.1 at 25M
    curve = [(t, 1 + 0.5 * (t / 1e6) ** -0.5) for t in (1e6, 2e6, 4e6)]
    b, tokens = tokens_to(curve, 1.10)
    assert b == pytest.approx(0.5) and tokens == pytest.approx(25e6, rel=1e-9)
    assert tokens_to([(1e6, 1.3), (2e6, 1.4)], 1.10)[1] == float("inf")  # rising: never
    assert parse_points("news=0.82M:1.46,820k:1.5,820000:1.6") == ("news", [(820000.0, 1.46), (820000.0, 1.5),
                                                                            (820000.0, 1.6)])


def test_a_train_log_gives_its_evaluations_after_step_0(tmp_path):
    log = tmp_path / "train_log.jsonl"
    records = [{"step": 0, "tokens": 0, "eval": {"news": {"ppl_ratio": 2.0}}}, {"step": 1, "tokens": 4096},
               {"step": 2, "tokens": 8192, "eval": {"news": {"ppl_ratio": 1.5}, "plays": {"ppl_ratio": 0.9}}},
               {"step": 4, "tokens": 16384, "eval": {"news": {"ppl_ratio": 1.4}, "plays": {"ppl_ratio": 0.8}}}]
    log.write_text("\n".join(map(json.dumps, records)))
    assert curves_from_log(log) == {"news": [(8192.0, 1.5), (16384.0, 1.4)], "plays": [(8192.0, 0.9), (16384.0, 0.8)]}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tokens_to_target.py"), str(log)],
                         capture_output=True, text=True, check=True).stdout
    assert "reached" in out.splitlines()[2] and "plays" in out.splitlines()[2]
    news = out.splitlines()[1].split()
    expected = 16384 * (0.4 / 0.1) ** (1 / 0.321928)  # b = log2(0.5 / 0.4)
    assert news[0] == "news" and float(news[-1]) == pytest.approx(expected, rel=1e-2)  # printed to 3 figures
