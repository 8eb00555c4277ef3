"""Reliability in one process: fault specs, numerics guards, signals during a write, and
safe loading (no pickle, no model code executed, nothing written outside the outputs).

The multi-rank failures (killed ranks, interrupted launchers) are in
``test_reliability_jobs.py``.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launching import LAUNCH_VARS, REPO
from safetensors.torch import load_file, save_file

from cocodiff.commands.cli import main
from cocodiff.runtime.failures import Interrupted, raise_on_signals
from cocodiff.runtime.faults import Fault, FaultyTransport, fault_from_env
from cocodiff.runtime.guards import NumericsError, NumericsGuard
from cocodiff.runtime.parallel import parallelize
from cocodiff.runtime.pipelines import ModelLoadError, export_tiny, load_pipeline, run_pipeline
from cocodiff.runtime.tiny import TINY_DEFAULTS, build_tiny
from cocodiff.util.atomic import atomic_write
from cocodiff.util.errors import CocodiffError

SOURCE_DIRS = ("cocodiff", "transports", "topology", "sim", "bench")


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)


# ---- fault specs --------------------------------------------------------------------------


def test_fault_spec_parses():
    assert Fault.parse("rank:1,point:exchange,count:3,action:kill") == Fault(1, "exchange", 3,
                                                                            "kill")
    assert Fault.parse(" rank:0 , point:step , action:mark ") == Fault(0, "step", 1, "mark")
    assert fault_from_env({}) is None
    assert fault_from_env({"COCODIFF_FAULT": "  "}) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rank:1", "needs rank, point and action"),
        ("rank:1,point:exchange,action:boom", "action 'boom' unknown; valid: kill"),
        ("rank:1,point:layer,action:kill", "point 'layer' unknown; valid: exchange, step"),
        ("rank:-1,point:step,action:kill", "rank must be a non-negative integer, got '-1'"),
        ("rank:１,point:step,action:kill", "rank must be a non-negative integer"),
        ("rank:0,point:step,count:0,action:kill", "count must be at least 1"),
        ("rank:0,point:step,action:nan", "action nan needs point:exchange"),
        ("rank 0", "bad COCODIFF_FAULT part 'rank 0'"),
    ],
)
def test_bad_fault_specs_are_one_line_errors(text, message):
    with pytest.raises(CocodiffError, match=message) as info:
        Fault.parse(text)
    assert "\n" not in str(info.value)


def test_a_bad_fault_spec_stops_cocodiff_run_with_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("COCODIFF_FAULT", "rank:0,point:step,action:explode")
    assert exit_code(["run", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "action 'explode' unknown" in err


# ---- numerics guards ----------------------------------------------------------------------


def _tiny_flux_run(pipe, guard: NumericsGuard, steps: int = 2) -> torch.Tensor:
    defaults = TINY_DEFAULTS["tiny-flux"]
    latents = run_pipeline(
        pipe, "a red cat", steps, defaults.width, defaults.height, seed=1,
        callback=lambda done, total: guard.end_step(),
        max_sequence_length=defaults.max_sequence_length,
    )
    guard.check_latents(latents)
    return latents


def test_nan_weights_are_reported_with_step_and_layer():
    pipe = build_tiny("tiny-flux")
    with torch.no_grad():  # the second attention layer (the single-stream block)
        pipe.transformer.single_transformer_blocks[0].attn.to_v.weight[3, 5] = float("nan")
    guard = NumericsGuard(rank=0).install(pipe.transformer)
    with pytest.raises(NumericsError) as info:
        _tiny_flux_run(pipe, guard)
    assert str(info.value) == "non-finite values at step 1, layer 1 (attention output) on rank 0"


def test_finite_runs_pass_the_guard_and_match_an_unguarded_run():
    pipe = build_tiny("tiny-flux")
    guard = NumericsGuard(rank=0).install(pipe.transformer)
    guarded = _tiny_flux_run(pipe, guard)
    guard.remove()
    unguarded = _tiny_flux_run(pipe, NumericsGuard(rank=0))
    assert torch.equal(guarded, unguarded)


def test_nan_in_an_exchange_is_reported_at_its_step_and_layer(monkeypatch):
    """A NaN sent in the 11th all-to-all (world of one: 9 per step, Q/K/V/out of 2 layers
    and the final gather) is step 2's layer 0, under parallelize."""
    from transports.registry import create_transport

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    transport = create_transport("torch", timeout_s=30)
    try:
        faulty = FaultyTransport(transport, Fault(0, "exchange", 11, "nan"))
        pipe = build_tiny("tiny-flux")
        parallelize(pipe, faulty)
        guard = NumericsGuard(rank=0).install(pipe.transformer)
        with pytest.raises(NumericsError) as info:
            _tiny_flux_run(pipe, guard, steps=3)
    finally:
        transport.close()
    assert str(info.value) == "non-finite values at step 2, layer 0 (attention output) on rank 0"


@pytest.fixture(scope="module")
def tiny_flux_dir(tmp_path_factory) -> Path:
    return export_tiny("tiny-flux", tmp_path_factory.mktemp("models") / "tiny-flux")


def test_cocodiff_run_stops_on_nan_weights_and_writes_nothing(tiny_flux_dir, tmp_path, capsys):
    model = tmp_path / "nan-flux"
    shutil.copytree(tiny_flux_dir, model)
    weights_file = next((model / "transformer").glob("*.safetensors"))
    weights = load_file(weights_file)
    name = next(key for key in weights if key.endswith("single_transformer_blocks.0.attn.to_v"
                                                       ".weight"))
    weights[name][0, 0] = float("inf")
    save_file(weights, weights_file, metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    argv = ["run", "--model", str(model), "--steps", "2", "--quiet",
            "--output", str(out / "a.png"), "--save-latents", str(out / "a.pt")]
    assert exit_code(argv) == 1
    err = capsys.readouterr().err
    assert err == ("cocodiff run: rank 0: NumericsError: non-finite values at step 1, layer 1 "
                   "(attention output) on rank 0\n")
    assert not list(out.iterdir())
    assert exit_code([*argv, "--no-guards"]) == 0  # what the guard is for: garbage written
    assert not torch.isfinite(torch.load(out / "a.pt", weights_only=True)).all()


# ---- signals ------------------------------------------------------------------------------


def test_a_signal_during_a_write_leaves_neither_file_nor_temporary(tmp_path):
    target = tmp_path / "image.png"

    def write(tmp: Path) -> None:
        tmp.write_bytes(b"half an image")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in here
        tmp.write_bytes(b"a whole image")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info, raise_on_signals():
        atomic_write(target, write)
    assert info.value.signal_name == "SIGTERM"
    assert not list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGTERM) is before  # restored


# ---- safe loading -------------------------------------------------------------------------


def _python_files() -> list[Path]:
    return sorted(path for folder in SOURCE_DIRS for path in (REPO / folder).rglob("*.py"))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in call.keywords)


def test_source_never_unpickles_or_runs_model_code():
    """Pinned by reading the source: no pickle modules, torch.load only with
    weights_only=True, from_pretrained only local and safetensors, never
    trust_remote_code / custom_pipeline, no eval/exec."""
    unsafe_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    problems = []
    files = _python_files()
    for path in files:
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [alias.name for alias in node.names]
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                bad = [n for n in names if n.split(".")[0] in unsafe_modules]
                if bad:
                    problems.append(f"{where}:{node.lineno} imports {bad}")
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            line = f"{where}:{node.lineno} {name}(...)"
            if name in ("eval", "exec", "compile", "__import__"):
                problems.append(f"{line}: runs code from data")
            if name.endswith("torch.load") and not _keyword_is_true(node, "weights_only"):
                problems.append(f"{line} without weights_only=True")
            if name.split(".")[-1] == "from_pretrained" and not (
                _keyword_is_true(node, "use_safetensors")
                and _keyword_is_true(node, "local_files_only")
            ):
                problems.append(f"{line} without use_safetensors=True, local_files_only=True")
            for keyword in node.keywords:
                if keyword.arg in ("trust_remote_code", "allow_pickle") and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                ):
                    problems.append(f"{line} passes {keyword.arg}")
                if keyword.arg == "custom_pipeline":
                    problems.append(f"{line} passes custom_pipeline")
    assert len(files) > 20, "found too few sources: wrong REPO?"
    assert not problems, "\n".join(problems)


_SENTINEL_CODE = (
    "import pathlib\n"
    "pathlib.Path({sentinel!r}).write_text('model code ran')\n"
    "class FluxTransformer2DModel: pass\n"
    "class EvilPipeline: pass\n"
)


def _edit_index(model: Path, key: str, value) -> None:
    index = json.loads((model / "model_index.json").read_text())
    index[key] = value
    (model / "model_index.json").write_text(json.dumps(index))


def _custom_transformer_code(model: Path, sentinel: Path) -> None:
    (model / "transformer" / "evil.py").write_text(_SENTINEL_CODE.format(sentinel=str(sentinel)))
    _edit_index(model, "transformer", ["evil", "FluxTransformer2DModel"])


def _custom_pipeline_code(model: Path, sentinel: Path) -> None:
    (model / "pipeline.py").write_text(_SENTINEL_CODE.format(sentinel=str(sentinel)))
    _edit_index(model, "_class_name", ["pipeline", "EvilPipeline"])


class _Unpickled:
    """Unpickling this creates the sentinel file: what a malicious .bin would do."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.write_text, (self.sentinel, "unpickled"))


def _pickle_weights_only(model: Path, sentinel: Path) -> None:
    for weights in (model / "transformer").glob("*.safetensors"):
        weights.unlink()
    # torch.save is a zip of pickles: torch.load without weights_only would run the reduce.
    torch.save({"weight": _Unpickled(sentinel)}, model / "transformer" /
               "diffusion_pytorch_model.bin")


@pytest.mark.parametrize("tamper", [_custom_transformer_code, _custom_pipeline_code,
                                    _pickle_weights_only])
def test_model_directories_are_read_never_executed(tiny_flux_dir, tmp_path, tamper):
    model = tmp_path / "model"
    shutil.copytree(tiny_flux_dir, model)
    sentinel = tmp_path / "sentinel"
    tamper(model, sentinel)
    with pytest.raises(ModelLoadError) as info:
        load_pipeline(str(model))
    assert "\n" not in str(info.value)
    assert not sentinel.exists(), "code from the model directory ran"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_cocodiff_run_writes_only_its_outputs(tiny_flux_dir, tmp_path):
    """A real process with HOME, caches, TMPDIR and the working directory all empty: after
    a run from a model directory, only the requested outputs exist and the model directory
    is untouched."""
    scratch = {name: tmp_path / name for name in ("home", "cache", "tmp", "cwd", "out")}
    for folder in scratch.values():
        folder.mkdir()
    model_before = _tree(tiny_flux_dir)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(
        PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
        HOME=str(scratch["home"]), XDG_CACHE_HOME=str(scratch["cache"]),
        XDG_CONFIG_HOME=str(scratch["home"] / ".config"), HF_HOME=str(scratch["cache"] / "hf"),
        TMPDIR=str(scratch["tmp"]), MPLCONFIGDIR=str(scratch["home"] / "mpl"),
    )
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_MODULES_CACHE"):
        env.pop(name, None)
    out = scratch["out"]
    result = subprocess.run(
        [sys.executable, "-m", "cocodiff", "run", "--model", str(tiny_flux_dir), "--steps", "1",
         "--quiet", "--output", str(out / "a.png"), "--json", str(out / "a.json")],
        cwd=scratch["cwd"], env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "a.png"]
    # Importing diffusers makes torch create an empty $TMPDIR/torchinductor_<user> (its
    # compile cache, unused here): the one thing tolerated, and only while empty.
    for inductor in scratch["tmp"].glob("torchinductor_*"):
        if inductor.is_dir() and not any(inductor.iterdir()):
            inductor.rmdir()
    for name in ("home", "cache", "tmp", "cwd"):
        assert not list(scratch[name].rglob("*")), f"{name}: {list(scratch[name].rglob('*'))}"
    assert _tree(tiny_flux_dir) == model_before
