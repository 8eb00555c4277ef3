"""``cocodiff plan`` and the layout flags of ``cocodiff simulate``: output, JSON, and
one line on stderr with exit 2 for every bad input."""

from __future__ import annotations

import json

import pytest

from cocodiff.commands.cli import main


@pytest.mark.slow
def test_plan_prints_the_best_layouts(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--nodes", "2", "--resolution", "512", "--schedule", "flat,vfirst",
                 "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "24 ranks" in text and "comm bound" in text and "best: --ulysses" in text
    record = json.loads(out.read_text())
    assert record["num_ranks"] == 24
    times = [c["step_time_s"] for c in record["candidates"]]
    assert times == sorted(times)
    best = record["candidates"][0]
    assert best["ulysses"] * best["ring"] * best["batch"] == 24 and best["ulysses"] <= 24
    assert f"U{best['ulysses']}xR{best['ring']}xB{best['batch']}" in text


def test_simulate_layout_auto_and_explicit(capsys, tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--nodes", "4", "--resolution", "512", "--steps", "2",
                 "--schedule", "flat", "--parallel-layout", "auto", "--json", str(out)]) == 0
    auto = json.loads(out.read_text())["results"][0]
    assert auto["layout"]["ulysses"] * auto["layout"]["ring"] == 48
    assert auto["layout"]["name"] in capsys.readouterr().out  # the layout column
    assert main(["simulate", "--nodes", "2", "--resolution", "512", "--steps", "2",
                 "--schedule", "vfirst", "--ulysses", "12", "--ring-inner", "--json",
                 str(out)]) == 0
    layout = json.loads(out.read_text())["results"][0]["layout"]
    assert (layout["ulysses"], layout["ring"], layout["name"]) == (12, 2, "U12xR2xB1/ring-inner")


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--nodes", "2", "--ulysses", "5"], "multiply to 5, which does not divide"),
    (["simulate", "--nodes", "4", "--ulysses", "48"], "ulysses degree 48 is above the model's"),
    (["simulate", "--nodes", "1", "--ulysses", "6", "--batch", "2"],
     "batch degree 2 does not divide the 1 sample"),
    (["simulate", "--parallel-layout", "auto", "--ring", "2"],
     "--parallel-layout auto and --ulysses/--ring/--batch both choose"),
    (["simulate", "--layout", "auto", "--ring", "2"],  # the old name, for one release
     "--parallel-layout auto and --ulysses/--ring/--batch both choose"),
    (["simulate", "--sweep", "--ring", "2"], "--sweep chooses its own layouts"),
    (["simulate", "--ring-inner"], "--ring-inner places a Ring"),
    (["plan", "--schedule", "nope"], "unknown schedule 'nope'"),
    (["plan", "--model", "nope"], "nope"),
    (["plan", "--collective", "nope"], "unknown collective model 'nope'"),
    (["plan", "--nodes", "0"], "expected a positive integer"),
    # run checks its layout flags on every rank before any collective or model load
    (["run", "--quiet", "--ulysses", "2"], "multiply to 2, which does not divide the 1 ranks"),
    (["run", "--quiet", "--parallel-layout", "auto", "--schedule", "diffusers"],
     "--schedule diffusers runs pure Ulysses only"),
    (["run", "--quiet", "--layout", "auto", "--schedule", "diffusers"],  # the old name
     "--schedule diffusers runs pure Ulysses only"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as usage_error:  # argparse's own checks
        code = usage_error.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
