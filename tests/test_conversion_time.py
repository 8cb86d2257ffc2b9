"""The plan's time (conversion_time.py): each stage's estimate is a slice of its own work, timed with the model the
run computes with, times the units the plan holds. How close it comes to the clock is a benchmark's question
(benchmarks/convert_time.py), not a test's."""

import pytest
import torch

from .test_calibrate import calib_text, dense_with_tokenizer  # noqa: F401 (a fixture)


@pytest.fixture
def planned(dense_with_tokenizer, tmp_path):
    from stem_upcycle.convert import plan_conversion
    from stem_upcycle.source import open_source
    from stem_upcycle.table_init import InitOptions
    from stem_upcycle.table_init.parent_rows import ParentRowOptions

    dense, src = dense_with_tokenizer()
    options = InitOptions(calib_data=[str(calib_text(tmp_path, n=3000))], calib_tokens=2048, calib_seq_len=32,
                          parent=ParentRowOptions(contexts=4, reads=2))
    plan = plan_conversion(open_source(str(src)), layers="all", init="calib", columns="1/3", init_options=options,
                           dry_run=True)
    return dense, plan


def test_each_stage_is_its_units_times_a_slice_timed_with_the_runs_model(planned, tmp_path, monkeypatch):
    import stem_upcycle.conversion_time as conversion_time
    from stem_upcycle.generate import Sampling
    from stem_upcycle.table_init.calibrated import CALIB_WINDOWS
    from stem_upcycle.table_init.mlp_inputs import WINDOWS_PER_FORWARD
    from stem_upcycle.table_init.parent_rows import CANDIDATES, ROWS_PER_FORWARD
    from stem_upcycle.table_init.row_choice import COLUMN_SCORING_WINDOWS

    dense, plan = planned
    forwards = []  # what the slices ran: (batch, positions) of each forward of the model's layers
    hook = dense.model.layers[0].register_forward_pre_hook(lambda module, args: forwards.append(tuple(args[0].shape[:2])))
    monkeypatch.setattr(conversion_time, "timed", lambda fn, repeat=1, warm=None: (fn(), 1.0)[1])  # one run, "1 s"
    sampling = Sampling.covering(1024, batch_size=4, length=64)
    estimates = {e.stage: e.seconds for e in conversion_time.estimate_conversion(
        plan, dense, 2048, sampling, 3, tmp_path / "out", dense)}
    hook.remove()
    # a decode step of the sampling batch, a forward of WINDOWS_PER_FORWARD windows, a forward of the parent's rows
    assert (1, 32) in forwards and (4, 1) in forwards  # half a sequence's cache, repeated; a step of the batch
    assert (WINDOWS_PER_FORWARD, 32) in forwards
    assert (ROWS_PER_FORWARD, plan.init_options.parent.context_length + CANDIDATES) in forwards
    windows, layers = 2048 // 32, 3
    assert estimates["sample"] == 3 * 64  # batches x steps x a step
    assert estimates["read text"] == windows / WINDOWS_PER_FORWARD
    assert estimates["parent rows"] == pytest.approx(plan.parent_positions / (ROWS_PER_FORWARD * CANDIDATES))
    assert estimates["rows"] == pytest.approx(windows / CALIB_WINDOWS * layers)
    # every neuron's sums over the text, the scoring windows' rows, the parent's rows of the tokens they hold
    scored = conversion_time.distinct_tokens(COLUMN_SCORING_WINDOWS * 32, plan.config.vocab_size)
    assert estimates["score neurons"] == pytest.approx((windows + COLUMN_SCORING_WINDOWS) / CALIB_WINDOWS * layers
                                                       + scored * 2 / (ROWS_PER_FORWARD * CANDIDATES))
    assert estimates["write"] > 0


def test_a_plan_over_an_hour_names_what_would_shorten_it():
    from stem_upcycle.stages import Estimate, describe_estimates

    short = describe_estimates([Estimate("sample", "65,536 tokens", 90.0), Estimate("write", "2 GB", 9.0)], "a CPU")
    assert short == ("time       ~1.6 min on this machine (a CPU; each stage timed on a slice of its work): sample 1.5 min "
                     "(65,536 tokens), write 9 s (2 GB)")
    long = describe_estimates([Estimate("parent rows", "2,052,096 positions", 5 * 3600.0)], "a CPU").splitlines()
    assert long[0].startswith("time       ~5.0 h on this machine") and len(long) == 2
    assert all(cure in long[1] for cure in ("a GPU (--device cuda)", "--parent-reads", "--parent-contexts",
                                            "--columns", "--calib-generate"))
