"""``args.given``: the options a command line gave, whatever their values
(cocodiff.commands.given)."""

import pytest

from cocodiff.commands.cli import build_parser


@pytest.mark.parametrize(("argv", "given"), [
    (["run"], set()),
    # at the default value, at a falsy one, a flag, an old alias
    (["run", "--steps", "4", "--vmajor-warmup", "0", "--ring-inner", "--layout", "1x2x1"],
     {"steps", "vmajor_warmup", "ring_inner", "layout"}),
    (["simulate", "--schedule", "flat,tapa,vfirst,cocodiff", "--layout", "pure", "--sweep"],
     {"schedule", "parallel_layout", "sweep"}),
])
def test_the_parser_records_the_options_given(argv, given):
    args = build_parser().parse_args(argv)
    assert args.given == given
    if "steps" in given:
        assert args.steps == 4  # and stores the value as argparse would


def test_two_parses_do_not_share_what_was_given():
    parser = build_parser()
    parser.parse_args(["run", "--steps", "4"])
    assert parser.parse_args(["run"]).given == set()
