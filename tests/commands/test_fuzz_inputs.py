"""Fuzzed input (hypothesis): topology TOML files, model ``config.json`` files and command
lines of ``cocodiff simulate`` and ``cocodiff run``.

Every case must either work (exit 0) or be refused with exactly one line on stderr and
exit code 2: never a traceback, never a hang (each case runs under an alarm). The CLI is
driven in-process through ``cocodiff.commands.cli.main`` for speed, plus a handful of cases through
a real process (where stdout/stderr encodings and exit codes are the real ones).

Files and argument values are generated both from the formats' own keys (to get past the
first checks) and as noise (random keys, types, unicode, huge numbers, bad bytes, empty
files, deep nesting). Input that is valid is also simulated end to end when it is small;
large valid input is only loaded and validated (a deliberately wrong ``--resolution 8x12``
then stops the command after the topology and model were read): simulating a huge machine
or model is slow by nature, not a bug of the input boundary.

A last target builds *valid* input made hostile (issue 18): names holding rich markup,
bytes that are not UTF-8 or 300 characters, file and directory names past the file
system's limits, deeply nested JSON beside valid files, resource-exhausting values
(thousands of nodes, more chunks than rows, subnormal bandwidths), for ``simulate``,
``plan`` and ``export-tiny``. The resource guard's limit is lowered to a few seconds
(``COCODIFF_MAX_SIM_S``) so that what it lets through must finish within the alarm.

Runs are reproducible (derandomised). ``COCODIFF_FUZZ_EXAMPLES=N`` scales the number of
cases; ``COCODIFF_FUZZ_RANDOM=1`` draws new ones each run (seed them with pytest's
``--hypothesis-seed``); docs/hardening.md has the long run's command and figures.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import string
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from clicheck import Hang, call, check_one_line_error, check_outcome, time_limit
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from launching import LAUNCH_VARS, REPO

from cocodiff.commands.cli import main
from cocodiff.models import REGISTRY, ModelSpecError, load_model_spec
from topology import PRESETS, TopologyError, load_topology

# Seconds one in-process case may take before it counts as a hang (generous: the machine
# may be busy); a small valid topology or model simulates in well under a second.
CASE_LIMIT_S = 30
SIMULATE_LIMIT_S = 10
# The resource guard's wall-time limit in the hostile cases (cocodiff.simulator.budget): what it
# accepts must finish well inside CASE_LIMIT_S even on a busy machine.
GUARD_LIMIT_S = 3
SCALE = float(os.environ.get("COCODIFF_FUZZ_EXAMPLES", "1"))
SETTINGS = settings(
    deadline=None,
    database=None,
    derandomize=not os.environ.get("COCODIFF_FUZZ_RANDOM"),
    suppress_health_check=list(HealthCheck),
    # No shrinking: shrinking a hang re-runs it (CASE_LIMIT_S each) dozens of times, and
    # the generated cases are small enough to read as they are.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
# The resolution that every model refuses (8 * patch never divides both 8 and 12), so
# that a valid topology or config is read and checked, then the command stops cheaply.
REFUSED_RESOLUTION = "8x12"
MAX_TILES_PLUS = 10**7  # counts above topology.spec.MAX_TILES: always refused


class Tally:
    """Cases tried per fuzz target and how they ended."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def add(self, target: str, outcome: str) -> None:
        self.counts[target, outcome] += 1

    def lines(self) -> list[str]:
        targets = sorted({target for target, _ in self.counts})
        total = sum(self.counts.values())
        lines = [f"fuzz: {total} cases tried"]
        for target in targets:
            outcomes = {o: n for (t, o), n in self.counts.items() if t == target}
            detail = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
            lines.append(f"  {target}: {sum(outcomes.values())} ({detail})")
        return lines


TALLY = Tally()


@pytest.fixture(scope="module", autouse=True)
def print_tally(request):
    """Print the number of cases in the normal pytest output (no -s needed)."""
    yield
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print("\n" + "\n".join(TALLY.lines()))


def run_cli(argv: list[str], target: str, limit_s: float = CASE_LIMIT_S) -> int:
    """main(argv) under the alarm; checks the work-or-one-line contract; returns the code.

    stdout and stderr encode as a real process's do (UTF-8; strict on stdout,
    backslashreplace on stderr), so that text a terminal could not show fails here too.
    """
    try:
        outcome = call(argv, limit_s)
    except Hang:
        pytest.fail(f"hang: cocodiff {argv!r}")
    check_outcome(outcome, argv)
    TALLY.add(target, "worked" if outcome.code == 0 else "refused")
    return outcome.code


# ---- value strategies ---------------------------------------------------------------------

# Text a user could put in a file or on a command line: any unicode (no surrogates in files),
# plus control characters and the odd bytes of a non-UTF-8 path (surrogate-escaped).
texts = st.text(max_size=24)
# Command-line words may also hold the bytes of a non-UTF-8 path (surrogate-escaped).
argv_texts = st.one_of(texts, st.binary(max_size=12).map(os.fsdecode))
keys = st.one_of(st.sampled_from(["count", "gpus", "bandwidth_gbps", "a b", "", "ü", "🐍"]),
                 st.text(min_size=1, max_size=12))
huge_ints = st.one_of(st.integers(MAX_TILES_PLUS, 10**30), st.integers(-(10**30), -1),
                      st.sampled_from([2**63, 2**64, 10**400]))
any_floats = st.floats(allow_nan=True, allow_infinity=True)
scalars = st.one_of(st.integers(-10, 10), huge_ints, any_floats, st.booleans(), texts,
                    st.datetimes(timezones=st.none()), st.dates())
toml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12,
)


def _toml_key(key: str) -> str:
    if key and all(c in string.ascii_letters + string.digits + "_-" for c in key):
        return key
    return _toml_string(key)


def _toml_string(text: str) -> str:
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    return "".join(out) + '"'


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return value.isoformat()  # datetime, date


def to_toml(doc: dict) -> str:
    """TOML text of ``doc``: top-level tables as [sections], deeper ones inline."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in doc.items()
             if not isinstance(v, dict)]
    for key, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{_toml_key(key)}]")
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


# ---- topology files -----------------------------------------------------------------------

counts = st.one_of(st.integers(1, 4), st.integers(-2, 0), huge_ints, any_floats, texts,
                   st.booleans())
small_counts = st.integers(1, 4)
numbers = st.one_of(st.floats(0.5, 1e4), st.integers(1, 10**4), st.just(0), st.integers(-5, -1),
                    any_floats, st.integers(10**300, 10**400), texts, st.booleans())
good_numbers = st.floats(0.5, 1e4)


def _link(value_numbers):
    return st.fixed_dictionaries(
        {}, optional={"bandwidth_gbps": value_numbers, "latency_us": value_numbers})


@st.composite
def topology_docs(draw):
    """Documents with the format's own tables and keys: clean ones (every link the shape
    needs, good numbers: mostly valid) or noisy ones (any value, stray keys)."""
    noisy = draw(st.booleans())
    count_values = counts if noisy else small_counts
    number_values = numbers if noisy else good_numbers
    nodes = draw(st.fixed_dictionaries(
        {"gpus": count_values},
        optional={"count": count_values, "tiles_per_gpu": count_values, "nics": count_values}))
    tile = draw(st.fixed_dictionaries({"tflops": number_values, "memory_gbps": number_values}))
    if noisy:
        link_names = draw(st.sets(st.sampled_from(["tile", "gpu", "port", "host", "nic"])))
    else:  # the links the shape needs, and sometimes one it does not
        link_names = {"host"}
        link_names |= {"tile"} if nodes.get("tiles_per_gpu", 1) > 1 else set()
        link_names |= {"gpu"} if nodes["gpus"] > 1 else set()
        if nodes.get("count", 1) > 1:
            nodes["nics"] = max(1, nodes.get("nics", 1))
        link_names |= {"nic"} if nodes.get("nics", 0) > 0 else set()
        link_names |= draw(st.sets(st.sampled_from(["tile", "gpu", "port"]), max_size=1))
    required = st.fixed_dictionaries({"bandwidth_gbps": number_values,
                                      "latency_us": number_values})
    links = {name: draw(_link(number_values) if noisy else required) for name in link_names}
    if "gpu" in links and draw(st.booleans()):
        links["gpu"]["fabric"] = draw(st.one_of(st.sampled_from(["switch", "all-to-all"]),
                                                texts))
    doc: dict = {"nodes": nodes, "tile": tile, "links": links}
    if draw(st.integers(0, 3)) == 0:
        doc["preset"] = draw(st.one_of(st.sampled_from(sorted(PRESETS)), texts))
    if draw(st.booleans()):
        doc["name"] = draw(st.one_of(texts, scalars))
    if draw(st.booleans()):
        doc["fabric"] = {"latency_us": draw(number_values)}
    if noisy and draw(st.booleans()):  # stray keys anywhere
        table = draw(st.sampled_from([doc, nodes, tile, links]))
        table[draw(keys)] = draw(toml_values)
    return doc


@st.composite
def mutated(draw, text: str) -> str:
    """A few random edits (delete, insert, replace) of a valid file's text."""
    chars = list(text)
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(chars)))
        edit = draw(st.sampled_from(["delete", "insert", "replace"]))
        char = draw(st.one_of(st.sampled_from(list("[]{}=\".,#\n 0-x")), st.characters()))
        if edit == "delete" and position < len(chars):
            del chars[position]
        elif edit == "insert":
            chars.insert(position, char)
        elif position < len(chars):
            chars[position] = char
    return "".join(chars)


VALID_TOPOLOGY = """name = "fuzz"
[nodes]
count = 2
gpus = 2
tiles_per_gpu = 2
nics = 1
[tile]
tflops = 100.0
memory_gbps = 1000.0
[links.tile]
bandwidth_gbps = 100.0
latency_us = 1.0
[links.gpu]
bandwidth_gbps = 20.0
latency_us = 2.0
fabric = "all-to-all"
[links.host]
bandwidth_gbps = 30.0
latency_us = 1.0
[links.nic]
bandwidth_gbps = 10.0
latency_us = 2.0
"""

topology_files = st.one_of(
    topology_docs().map(lambda doc: to_toml(doc).encode()),
    st.dictionaries(keys, toml_values, max_size=5).map(lambda doc: to_toml(doc).encode()),
    mutated(VALID_TOPOLOGY).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
    st.binary(max_size=200),
    st.sampled_from([b"", b"\n", b"[nodes]\n", b"\xff\xfe[nodes]", b"a = " + b"[" * 5000,
                     b"[" + b"a." * 3000 + b"b]\n", VALID_TOPOLOGY.encode()]),
)


def _moderate_topology(path: Path) -> bool:
    """Valid and small enough to simulate in a fraction of a second."""
    try:
        spec = load_topology(path)
    except TopologyError:
        return False
    links = [spec.tile_link, spec.gpu_link, spec.port_link, spec.host_link, spec.nic_link]
    values = [spec.tile_tflops, spec.tile_memory_gbps, spec.fabric_latency_us]
    values += [v for link in links if link is not None
               for v in (link.bandwidth_gbps, link.latency_us)]
    return spec.num_tiles <= 32 and all(v == 0 or 1e-2 <= v <= 1e6 for v in values)


_file_ids = itertools.count()


def test_fuzz_topology_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toml")

    @settings(SETTINGS, max_examples=int(250 * SCALE))
    @given(content=topology_files)
    def case(content: bytes) -> None:
        path = folder / f"t{next(_file_ids)}.toml"
        path.write_bytes(content)
        run_cli(["simulate", "--topology", str(path), "--model", "dit-xl-2", "--steps", "1",
                 "--resolution", REFUSED_RESOLUTION], "topology files")

    case()


# ---- model config.json files --------------------------------------------------------------

CLASSES = ["FluxTransformer2DModel", "Flux2Transformer2DModel", "SD3Transformer2DModel",
           "QwenImageTransformer2DModel", "WanTransformer3DModel", "PixArtTransformer2DModel",
           "DiTTransformer2DModel", "Transformer2DModel"]
INT_FIELDS = ["num_layers", "num_single_layers", "num_attention_heads", "attention_head_dim",
              "patch_size", "ffn_dim"]
config_ints = st.one_of(st.integers(1, 8), st.integers(-3, 0), huge_ints, any_floats,
                        st.booleans(), texts, st.none(), st.lists(st.integers(0, 3), max_size=4))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner,
                                                                         max_size=4)),
    max_leaves=12,
)


@st.composite
def model_configs(draw):
    noisy = draw(st.booleans())
    values = config_ints if noisy else st.integers(1, 4)
    config = {"_class_name": draw(st.one_of(st.sampled_from(CLASSES), json_values)
                                  if noisy else st.sampled_from(CLASSES))}
    for field in INT_FIELDS:
        if draw(st.integers(0, 9)) < 8:
            config[field] = draw(values)
    if config.get("_class_name") == "WanTransformer3DModel" and draw(st.booleans()):
        config["patch_size"] = draw(st.one_of(
            st.tuples(st.just(1), st.integers(1, 2)).map(lambda t: [1, t[1], t[1]]),
            st.lists(config_ints, max_size=4)))
    if draw(st.booleans()):
        config["norm_type"] = draw(st.one_of(st.sampled_from(["ada_norm_zero",
                                                              "ada_norm_single"]), texts))
    if draw(st.booleans()):
        config["mlp_ratio"] = draw(st.one_of(st.floats(0.5, 8), config_ints))
    if noisy and draw(st.booleans()):
        config[draw(texts)] = draw(json_values)
    return config


config_files = st.one_of(
    model_configs().map(lambda c: json.dumps(c).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=100),
    st.sampled_from([b"", b"{", b"[]", b"null", b"\xef\xbb\xbf{}", b"[" * 100000,
                     b'{"_class_name": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                     b'{"num_layers": 1e999}', b"NaN"]),
)


def _moderate_config(path: Path) -> bool:
    try:
        spec = load_model_spec(str(path))
    except ModelSpecError:
        return False
    return (spec.num_layers <= 64 and spec.num_heads <= 64 and spec.head_dim <= 512
            and spec.patch_size <= 4 and spec.mlp_ratio <= 16)


def test_fuzz_model_configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")

    @settings(SETTINGS, max_examples=int(250 * SCALE))
    @given(content=config_files)
    def case(content: bytes) -> None:
        path = folder / f"c{next(_file_ids)}" / "config.json"
        path.parent.mkdir()
        path.write_bytes(content)
        run_cli(["simulate", "--model", str(path), "--topology", "cluster", "--steps", "1",
                 "--resolution", REFUSED_RESOLUTION], "model configs")

    case()


# ---- valid files, simulated end to end ---------------------------------------------------

def test_known_simulator_livelock(tmp_path):
    """The case the fuzzer found: a completion due sooner than the clock's resolution
    (1e-16 s at t = 1 s) once stopped simulated time from advancing."""
    path = tmp_path / "livelock.toml"
    path.write_text('preset = "dgx-h100"\n[nodes]\ngpus = 3\ncount = 2\n[tile]\n'
                    'tflops = 3057.3626322288665\nmemory_gbps = 6256.726572717829\n'
                    '[links]\nnic = {latency_us = 5557.0}\n')
    with time_limit(5):  # it simulates in a fraction of a second once fixed
        try:
            code = main(["simulate", "--topology", str(path), "--model", "dit-xl-2",
                         "--steps", "1", "--resolution", "256", "--schedule", "flat"])
        except Hang:
            pytest.fail("hang: the simulator livelocked")
    assert code == 0


@pytest.mark.slow
def test_fuzz_valid_inputs_simulate_end_to_end(tmp_path_factory):
    """Valid, small topologies and configs (the noise-free halves of the strategies above)
    must simulate: exit 0, or one line and 2 for what the simulator refuses."""
    folder = tmp_path_factory.mktemp("valid")

    @settings(SETTINGS, max_examples=int(150 * SCALE))
    @given(toml=topology_files, config=config_files)
    def case(toml: bytes, config: bytes) -> None:
        index = next(_file_ids)
        topology = folder / f"t{index}.toml"
        topology.write_bytes(toml)
        model = folder / f"c{index}.json"
        model.write_bytes(config)
        if _moderate_topology(topology):
            run_cli(["simulate", "--topology", str(topology), "--model", "dit-xl-2",
                     "--steps", "1", "--resolution", "256"], "valid topologies, simulated",
                    limit_s=SIMULATE_LIMIT_S)
        if _moderate_config(model):
            run_cli(["simulate", "--model", str(model), "--topology", "cluster", "--steps", "1",
                     "--resolution", "128"], "valid configs, simulated", limit_s=SIMULATE_LIMIT_S)

    case()


# ---- command lines ------------------------------------------------------------------------

# Argument values that may look right. Kept to what simulates in well under a second when
# valid: large machines, models and step counts are slow to simulate by nature (and
# --sweep, the paper's whole grid, is a batch job), so "huge" here means beyond the limits
# the boundary enforces.
path_like = st.sampled_from(["{tmp}/out.json", "{tmp}/no/such/dir/x.json", "{tmp}", "",
                             "{tmp}/o\u00fc\u2028t.png", "-", "/dev/null/x",
                             "{tmp}/new\nline/x.json", "{tmp}/x\r.json"])
SIMULATE_OPTIONS = {
    "--topology": st.one_of(st.sampled_from([*sorted(PRESETS), "{tmp}/valid.toml",
                                             "{tmp}/missing.toml", "{tmp}", "x.toml"]), argv_texts),
    "--nodes": st.one_of(st.sampled_from(["1", "2", "0", "-1", "x", "1e3", "\u0661",
                                          str(10**7), str(10**30), " 2", ""]), argv_texts),
    "--model": st.one_of(st.sampled_from([*REGISTRY, "{tmp}/valid.json", "{tmp}",
                                          "{tmp}/missing.json", "no-such-model"]), argv_texts),
    "--resolution": st.one_of(st.sampled_from(["128", "256x128", "8x12", "0", "x", "-16",
                                               "128x", "x128", "1e3", "16" * 20, "128X64",
                                               "\u0661\u0662\u0668"]), argv_texts),
    "--frames": st.sampled_from(["1", "5", "0", "-1", "x", str(10**30)]),
    "--steps": st.sampled_from(["1", "2", "0", "-3", "y", "1.5"]),
    "--schedule": st.one_of(st.sampled_from(["flat", "tapa", "vfirst", "cocodiff",
                                             "flat,tapa", ",", "", "flat,,vfirst", "FLAT"]),
                            argv_texts),
    "--chunks": st.sampled_from(["1", "2", "0", "-1", "z"]),
    "--collective": st.one_of(st.sampled_from(["auto", "ideal", "aurora", "nope"]), argv_texts),
    "--vmajor-ratio-schedule": st.one_of(
        st.sampled_from(["linear", "linear:0.5", "linear:2", "constant:0.3", "constant:x",
                         "constant:nan", "constant:-1", "cubic", "linear:inf"]), argv_texts),
    "--vmajor-warmup": st.sampled_from(["0", "1", "-1", "x", str(10**20)]),
    "--vmajor-refresh": st.sampled_from(["0", "2", "-5", "q"]),
    "--activity-trace": st.sampled_from(["{tmp}/missing.json", "{tmp}/valid.json",
                                         "{tmp}/junk.txt", "{tmp}"]),
    "--json": path_like,
    "--trace": path_like,
    "--plot": path_like,
}
RUN_OPTIONS = {
    "--schedule": st.one_of(st.sampled_from(["flat", "nope", "", "FLAT"]), argv_texts),
    "--transport": st.one_of(st.sampled_from(["auto", "torch", "mpi", "sim", "carrier-pigeon",
                                              ""]), argv_texts),
    "--timeout": st.sampled_from(["60", "0", "-1", "nan", "inf", "1e300", "x", "1e7", ""]),
    "--seed": st.sampled_from(["0", "-1", str(2**64), str(-(2**63) - 1), "x", "1.5"]),
    "--resolution": st.sampled_from(["128", "x", "0", "-5", "8x"]),
    "--dtype": st.sampled_from(["float32", "bfloat16", "float8", "int"]),
    "--steps": st.sampled_from(["2", "0", "x"]),
    "--frames": st.sampled_from(["1", "0", "x"]),
    "--grid": st.one_of(st.sampled_from(["1x1x1", "2x1x1", "1x2", "0x1x1", "axbxc", ""]),
                        argv_texts),
    "--parallel-layout": st.sampled_from(["auto", "pure", "nope", ""]),
    "--output": path_like,
    "--json": path_like,
    "--save-latents": path_like,
}
# Values run refuses before it imports torch or loads a model (one per option).
RUN_BAD = {
    "--schedule": "nope", "--transport": "carrier-pigeon", "--timeout": "nan",
    "--seed": str(2**64), "--resolution": "x", "--dtype": "float8", "--steps": "0",
    "--frames": "x", "--grid": "2x1x1", "--output": "{tmp}/no/such/dir/x.png",
    "--json": "{tmp}", "--save-latents": "{tmp}/no/such/dir/x.pt",
}
junk_args = st.one_of(st.sampled_from(["--", "-", "--nope", "-x", "--json", "--nodes=", "-h"]),
                      argv_texts)


@st.composite
def simulate_argv(draw):
    chosen = draw(st.lists(st.sampled_from(sorted(SIMULATE_OPTIONS)), max_size=6,
                           unique=True))
    argv = ["simulate", "--model", "dit-xl-2", "--topology", "cluster", "--resolution", "128",
            "--steps", "1"]
    for option in chosen:
        value = draw(SIMULATE_OPTIONS[option])
        argv += [f"{option}={value}"] if draw(st.booleans()) else [option, value]
    if draw(st.integers(0, 4)) == 0:
        argv.insert(draw(st.integers(1, len(argv))), draw(junk_args))
    return argv


@st.composite
def run_argv(draw):
    bad = draw(st.sampled_from(sorted(RUN_BAD)))
    chosen = draw(st.lists(st.sampled_from(sorted(RUN_OPTIONS)), max_size=5, unique=True))
    argv = ["run", "--quiet"]
    for option in chosen:
        argv += [option, draw(RUN_OPTIONS[option])]
    argv += [bad, RUN_BAD[bad]]  # last wins: the command never gets to load a model
    if draw(st.integers(0, 4)) == 0:
        argv.insert(draw(st.integers(1, len(argv))), draw(junk_args))
    return argv


def _fill(argv: list[str], tmp: Path) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)) for arg in argv]


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "valid.toml").write_text(VALID_TOPOLOGY)
    (tmp / "valid.json").write_text((REPO / "tests/data/configs/dit-xl-2.json").read_text())
    (tmp / "junk.txt").write_bytes(b"\x00\xff not json")
    return tmp


@pytest.mark.slow
def test_fuzz_simulate_command_lines(cli_files, monkeypatch):
    monkeypatch.chdir(cli_files)  # relative outputs ("-", "") land here, not in the repo

    @settings(SETTINGS, max_examples=int(300 * SCALE))
    @given(argv=simulate_argv())
    def case(argv: list[str]) -> None:
        for output in cli_files.glob("out*"):
            output.unlink()
        run_cli(_fill(argv, cli_files), "simulate command lines")

    case()


@pytest.mark.slow
def test_fuzz_run_command_lines(cli_files, monkeypatch):
    monkeypatch.chdir(cli_files)

    @settings(SETTINGS, max_examples=int(300 * SCALE))
    @given(argv=run_argv())
    def case(argv: list[str]) -> None:
        before = set(cli_files.iterdir())
        code = run_cli(_fill(argv, cli_files), "run command lines")
        assert code == 2 or "-h" in argv, f"run {argv!r} did not stop before loading a model"
        assert set(cli_files.iterdir()) == before, "run wrote a file"

    case()


# ---- valid input made hostile (issue 18) --------------------------------------------------

# Names a user may well choose, or a file system may hand over: rich markup and emoji
# codes, bytes that are not UTF-8 (surrogate-escaped), blanks, control characters, and
# lengths past the 255 bytes a file name may have.
hostile_names = st.one_of(
    st.sampled_from(["[/]", "[bold]x", "[link=a]b[/link]", ":smile:", "[", "]", "\\[x]",
                     " ", "\t", "a" * 300, "\u00fc" * 130, "x\ny", "\x1b[31mred", "\u202e",
                     "\udcff", "o\udcfe\udc80", "-", "--nodes", "%s%n", "\ufeff"]),
    st.text(min_size=1, max_size=20),
    st.binary(min_size=1, max_size=20).map(os.fsdecode),
    st.integers(200, 400).map(lambda n: "n" * n),
)
# File and directory names: the same, minus what no directory entry can hold.
hostile_files = hostile_names.map(lambda name: name.replace("/", "_").replace("\0", "_")
                                  ).filter(lambda name: name not in ("", ".", ".."))
# Values past what a run can afford, inside what the flags accept.
resource_nodes = st.sampled_from(["1", "2", "3", "50", "500", "5000", "83333"])
resource_chunks = st.sampled_from(["1", "2", "4", "12", "13", "64", "1000", "100000"])
resource_steps = st.sampled_from(["1", "2", "28", "1000", "10000"])
# Numbers that are finite and positive, so only physical sense can refuse them.
extreme_numbers = st.sampled_from([5e-324, 1e-300, 1e-12, 1e-9, 1e-6, 0.001, 0.5, 1e6,
                                   1e9, 1e12, 1e300, 1e308, 1.7976931348623157e308])
EXTREME_KEYS = [("links.gpu", "bandwidth_gbps"), ("links.gpu", "latency_us"),
                ("links.nic", "bandwidth_gbps"), ("links.nic", "latency_us"),
                ("links.host", "bandwidth_gbps"), ("tile", "tflops"), ("tile", "memory_gbps"),
                ("fabric", "latency_us")]


def nested_json(depth: int, kind: str) -> str:
    return {"arrays": "[" * depth + "]" * depth,
            "objects": '{"a": ' * depth + "1" + "}" * depth,
            "open": "[" * depth}[kind]


nested = st.tuples(st.sampled_from([2, 63, 64, 65, 1000, 100_000]),
                   st.sampled_from(["arrays", "objects", "open"]))


@st.composite
def hostile_cases(draw):
    """One command line and the files it needs: (argv template, files) where files maps
    a relative path (which may itself be hostile) to its bytes."""
    files: dict[str, bytes] = {}
    command = draw(st.sampled_from(["simulate", "simulate", "simulate", "plan", "export-tiny"]))
    if command == "export-tiny":
        name = draw(st.sampled_from(["tiny-flux", "tiny-nope", "", "TINY-FLUX"]))
        target = draw(hostile_files)
        shape = draw(st.sampled_from(["file", "under-file", "non-empty", "long"]))
        if shape == "file":
            files[target] = b""
        elif shape == "under-file":
            files["plain"] = b""
            target = f"plain/{target}"
        elif shape == "non-empty":
            files[f"full/{target}"] = b"x"
            target = "full"
        else:
            target = "t" * 256
        return ["export-tiny", name, "{tmp}/" + target], files
    argv = [command, "--resolution", "256"]
    preset = draw(st.sampled_from(["aurora", "cluster", "dgx-h100"]))
    lines = [f'preset = "{preset}"']
    if draw(st.booleans()):
        # Inside a UTF-8 file a name holds characters, not the bytes of a file name.
        name = draw(hostile_names).encode("utf-8", "replace").decode("utf-8")
        lines.append(f"name = {_toml_string(name)}")
    if draw(st.booleans()):
        table, key = draw(st.sampled_from(EXTREME_KEYS))
        lines += [f"[{table}]", f"{key} = {draw(extreme_numbers)!r}"]
    topology = draw(hostile_files) + ".toml"
    files[topology] = ("\n".join(lines) + "\n").encode()
    argv += ["--topology", "{tmp}/" + topology, "--nodes", draw(resource_nodes)]
    model = draw(st.sampled_from(["registry", "directory", "long name"]))
    if model == "registry":
        argv += ["--model", "dit-xl-2"]
    elif model == "long name":
        argv += ["--model", draw(hostile_names)]
    else:
        directory = draw(hostile_files)
        files[f"{directory}/config.json"] = (REPO / "tests/data/configs/dit-xl-2.json"
                                             ).read_bytes()
        if draw(st.booleans()):
            depth, kind = draw(nested)
            files[f"{directory}/cocodiff_tiny.json"] = nested_json(depth, kind).encode()
        argv += ["--model", "{tmp}/" + directory]
    if command == "plan":
        argv += ["--schedule", draw(st.sampled_from(["flat", "tapa"])), "--top", "3"]
        return argv, files
    schedule = draw(st.sampled_from(["flat", "tapa", "vfirst", "cocodiff", "flat,tapa"]))
    argv += ["--schedule", schedule, "--steps", draw(resource_steps)]
    if schedule != "flat" and draw(st.booleans()):
        argv += ["--chunks", draw(resource_chunks)]
    if draw(st.integers(0, 3)) == 0:
        trace = draw(hostile_files) + ".json"
        depth, kind = draw(nested)
        files[trace] = nested_json(depth, kind).encode()
        argv += ["--activity-trace", "{tmp}/" + trace]
    for option in draw(st.lists(st.sampled_from(["--json", "--trace", "--plot"]),
                                max_size=2, unique=True)):
        directory = draw(st.sampled_from(["", "missing/", "plain/", "d" * 256 + "/"]))
        if directory == "plain/":
            files["plain"] = b""
        argv += [option, "{tmp}/" + directory + draw(hostile_files)]
    return argv, files


def _write_files(folder: Path, files: dict[str, bytes]) -> None:
    """Create what the case needs; a name the file system refuses stays missing (the
    command must then refuse it in one line)."""
    for relative, content in files.items():
        path = folder / relative
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        except OSError:
            pass


@pytest.mark.slow
def test_fuzz_hostile_valid_inputs(tmp_path_factory, monkeypatch):
    """Valid input with hostile names, paths, nesting, lengths and sizes, the way the
    outside fuzzer of issue 18 wrote it: each of its nine classes is one draw away."""
    monkeypatch.setenv("COCODIFF_MAX_SIM_S", str(GUARD_LIMIT_S))
    root = tmp_path_factory.mktemp("hostile")
    cases = itertools.count()

    @settings(SETTINGS, max_examples=int(60 * SCALE))
    @given(case=hostile_cases())
    def case(case) -> None:
        argv, files = case
        folder = root / f"h{next(cases)}"
        folder.mkdir()
        _write_files(folder, files)
        run_cli(_fill(argv, folder), f"hostile {argv[0]}")

    case()


# ---- a handful through a real process -----------------------------------------------------

REAL_CASES = [
    ["simulate", "--topology", "{tmp}/valid.toml", "--model", "dit-xl-2", "--resolution", "128",
     "--steps", "1"],
    ["simulate", "--topology", "{tmp}/junk.toml"],
    ["simulate", "--model", "{tmp}/\udcff/config.json", "--topology", "cluster",
     "--resolution", "128", "--steps", "1"],
    ["simulate", "--json", "{tmp}/\udcff-missing/\u2603.json"],
    ["simulate", "--nodes", "\u0662"],
    ["simulate", "--resolution", "\x1b[31mred"],
    ["run", "--schedule", "\udcfe", "--timeout", "inf"],
    ["run", "--output", "{tmp}/\udcff/x.png"],
]


@pytest.mark.slow
def test_real_processes(cli_files):
    (cli_files / "junk.toml").write_bytes(b"\xff\xfe\x00[nodes")
    odd = cli_files / "\udcff"
    odd.mkdir(exist_ok=True)
    (odd / "config.json").write_text((REPO / "tests/data/configs/dit-xl-2.json").read_text())
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(REPO)
    for argv in REAL_CASES:
        args = [os.fsencode(arg) for arg in _fill(argv, cli_files)]
        result = subprocess.run([sys.executable, "-m", "cocodiff", *args], cwd=cli_files,
                                env=env, capture_output=True, timeout=120,
                                stdin=subprocess.DEVNULL)
        err = result.stderr.decode("utf-8", "backslashreplace")
        if result.returncode == 0:
            assert "Traceback" not in err, (argv, err)
            TALLY.add("real processes", "worked")
        else:
            assert result.returncode == 2, (argv, result.returncode, err[-3000:])
            check_one_line_error(err)
            TALLY.add("real processes", "refused")
