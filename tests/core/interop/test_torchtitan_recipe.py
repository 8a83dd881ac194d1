"""torchtitan's recipe (docs/guide/torchtitan.md): its trainer on CPU, shardkit's losses torch's.

Runs only where torchtitan is importable (0.3.0 was used; the guide says how to install it
beside the pinned torch). The training comparison also needs torchtitan's tokenizer files
(``tests/assets/tokenizer`` of a torchtitan checkout) in ``$TORCHTITAN_TOKENIZER``, and is
marked slow: two torchrun jobs of two ranks (31 s on two idle cores, more when shared). So are
the pipeline-parallel and context-parallel layouts of torchtitan's own integration tests
(``TITAN_LAYOUTS``; two or four ranks, 30 to 60 s a layout, both engines, on two cores), and
DeepSeek-V3's debug model with expert parallelism (``TITAN_EP_LAYOUTS``; 45 to 105 s a layout,
both engines, on two shared cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LAUNCHER = REPO / "demo" / "torchtitan_cpu.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None,
    reason="torchtitan (0.3.0, --no-deps) and triton, which it imports on every run, are not "
    "both importable (docs/guide/torchtitan.md says how to install them)",
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter: the launcher changes torchtitan's module state."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "demo"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )


def test_the_launcher_sets_the_cpu_and_gloo_for_every_later_torchtitan_module() -> None:
    job = _python(
        "import json, torchtitan_cpu\n"
        "torchtitan_cpu.use_cpu()\n"
        "import torch\n"
        "import torchtitan.components.metrics as metrics\n"
        "import torchtitan.distributed.utils as dist_utils\n"
        "import torchtitan.tools.utils as utils\n"
        "monitor = metrics.build_device_memory_monitor()\n"
        "print(json.dumps({'device_type': dist_utils.device_type,\n"
        "    'backend': torch.distributed.Backend.default_device_backend_map[\n"
        "        dist_utils.device_type],\n"
        "    'local_device': str(utils.get_local_device()),\n"
        "    'current_device': dist_utils.device_module.current_device(),\n"
        "    'monitor': monitor.device_name, 'peak': monitor.get_peak_stats().max_active_gib}))\n"
    )
    assert job.returncode == 0, job.stderr[-3000:]
    report = json.loads(job.stdout.strip().splitlines()[-1])
    assert report == {
        "device_type": "cpu",
        "backend": "gloo",
        "local_device": "cpu",
        "current_device": 0,
        "monitor": "CPU",
        "peak": -1 / 1024**3,
    }


def test_the_launcher_refuses_when_torchtitan_chose_its_device_before_it() -> None:
    job = _python(
        "import torchtitan.distributed.utils\nimport torchtitan_cpu\ntorchtitan_cpu.use_cpu()\n"
    )
    assert job.returncode != 0
    # The first module (by name) that copied torchtitan's choice is named.
    assert (
        "RuntimeError: torchtitan_cpu: torchtitan.distributed.parallel_dims was imported before "
        "the device was set to the CPU" in job.stderr
    ), job.stderr[-3000:]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Run:
    """One torchtitan layout: ranks, batch and the parallelism flags."""

    ranks: int = 2
    """Processes (torchrun's ``--nproc-per-node``)."""
    module: str = "llama3"
    """torchtitan's model (``--module``)."""
    config: str = "llama3_debugmodel"
    """torchtitan's configuration of that model (``--config``)."""
    local_batch: int = 1
    """Sequences per data-parallel rank and step; pipeline microbatches are 1 sequence each."""
    seq_len: int = 64
    """Tokens per sequence (context parallelism needs a multiple of cp x 128)."""
    flags: tuple[str, ...] = ()
    """torchtitan's flags for the layout."""


def _pp(degree: int, schedule: str, *more: str) -> tuple[str, ...]:
    """Pipeline-parallel flags as torchtitan's integration tests give them."""
    pp = ("--parallelism.pipeline_parallel_degree", str(degree))
    return (
        "--training.disable_cuda_graphs",
        *pp,
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        *more,
    )


# torchtitan 0.3.0's integration tests of these names (tests/integration_tests/features.py),
# with 4 microbatches per step. See docs/guide/torchtitan.md.
TITAN_LAYOUTS = {
    "pp_1f1b": _Run(
        local_batch=4, flags=_pp(2, "1F1B", "--parallelism.data_parallel_shard_degree", "1")
    ),
    "pp_dp_1f1b": _Run(
        ranks=4,
        local_batch=4,
        flags=_pp(2, "1F1B", "--parallelism.data_parallel_shard_degree", "2"),
    ),
    "pp_looped_1f1b": _Run(ranks=4, local_batch=4, flags=_pp(4, "Interleaved1F1B")),
    "pp_zbv": _Run(local_batch=4, flags=_pp(2, "ZBVZeroBubble", "activation-checkpoint:full")),
    # pp 2 x tp 2: FSDP on a dp axis of one rank beside TP; its grad norm differed from
    # torch's in the seventh digit before TP settled no-sync gradients once (note 009).
    "pp_tp_gpipe": _Run(
        ranks=4, local_batch=4, flags=_pp(2, "GPipe", "--parallelism.tensor_parallel_degree", "2")
    ),
    "cp": _Run(ranks=4, seq_len=512, flags=("--parallelism.context_parallel_degree=4",)),
}


def _deepseek_ep(ranks: int, *degrees: str) -> _Run:
    """DeepSeek-V3's debug model with expert parallelism 2; ``degrees``: the other flags."""
    flags = ("--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree", "2")
    return _Run(
        ranks=ranks, module="deepseek_v3", config="deepseek_v3_debugmodel", flags=flags + degrees
    )


# Expert parallelism: the experts go on their own (efsdp) mesh through torch's
# ShardPlacementResult. deepseek_v3_hsdp+ep is torchtitan 0.3.0's integration test of that name
# (tests/integration_tests/models.py); the other two have its flags with other data-parallel
# degrees: efsdp 1 (dp 2) and efsdp 2 (dp 4). See docs/guide/torchtitan.md.
TITAN_EP_LAYOUTS = {
    "deepseek_v3_fsdp+ep": _deepseek_ep(2),
    "deepseek_v3_hsdp+ep": _deepseek_ep(
        4,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ),
    "deepseek_v3_fsdp4+ep": _deepseek_ep(4, "--parallelism.data_parallel_shard_degree", "4"),
}


def _dataset(folder: Path) -> Path:
    """A c4_test-shaped dataset (JSON lines of {"text": ...}) from the demo corpus."""
    folder.mkdir()
    text = (REPO / "demo" / "data" / "corpus.txt").read_text(encoding="utf-8")
    parts = [part.strip() for part in text.split("\n\n") if len(part.strip()) > 200]
    lines = [json.dumps({"text": part}) for part in parts]
    (folder / "data.json").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def _train(engine: str, dump: Path, data: Path, tokenizer: str, run: _Run) -> list[float]:
    """Two steps of ``run`` (llama3's debug model at dp 2 by default); TensorBoard's losses."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={run.ranks}"]
    if engine == "shardkit":
        cmd += ["-m", "shardkit.core.run"]
    cmd += [str(LAUNCHER), "--module", run.module, "--config", run.config]
    cmd += ["--hf_assets_path", tokenizer, "--dataloader.dataset_path", str(data)]
    cmd += ["--training.steps", "2", "--training.seq_len", str(run.seq_len)]
    cmd += ["--training.local_batch_size", str(run.local_batch), "--validator.no-enable"]
    cmd += ["--metrics.log_freq", "1", "--parallelism.spmd_backend", "partial_dtensor"]
    cmd += ["--debug.seed", "42", "--metrics.enable-tensorboard", "--dump_folder", str(dump)]
    cmd += list(run.flags)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-3000:]
    assert f"torchtitan_cpu: fully_shard is {engine}'s" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # Under pipeline parallelism only the rank of the last stage writes (it has the loss).
    (events_file,) = dump.glob("tb/*/events.out.tfevents.*")
    events = EventAccumulator(str(events_file))
    events.Reload()
    return [event.value for event in events.Scalars("loss_metrics/global_avg_loss")]


def _assert_both_engines_train_alike(tmp_path: Path, run: _Run) -> None:
    """Two steps of ``run`` on torch's engine, then shardkit's: the same losses bit for bit."""
    data = _dataset(tmp_path / "c4_test")
    tokenizer = os.environ["TORCHTITAN_TOKENIZER"]
    theirs = _train("torch", tmp_path / "torch", data, tokenizer, run)
    ours = _train("shardkit", tmp_path / "shardkit", data, tokenizer, run)
    assert len(theirs) == 2
    assert ours == theirs


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("TORCHTITAN_TOKENIZER"),
    reason="set TORCHTITAN_TOKENIZER to torchtitan's tests/assets/tokenizer folder",
)
def test_llama3_debug_model_trains_on_shardkit_as_on_torch(tmp_path: Path) -> None:
    _assert_both_engines_train_alike(tmp_path, _Run())


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("TORCHTITAN_TOKENIZER"),
    reason="set TORCHTITAN_TOKENIZER to torchtitan's tests/assets/tokenizer folder",
)
@pytest.mark.parametrize("layout", list(TITAN_LAYOUTS))
def test_pipeline_and_context_parallel_layouts_train_on_shardkit_as_on_torch(
    layout: str, tmp_path: Path
) -> None:
    _assert_both_engines_train_alike(tmp_path, TITAN_LAYOUTS[layout])


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("TORCHTITAN_TOKENIZER"),
    reason="set TORCHTITAN_TOKENIZER to torchtitan's tests/assets/tokenizer folder",
)
@pytest.mark.parametrize("layout", list(TITAN_EP_LAYOUTS))
def test_expert_parallel_layouts_train_on_shardkit_as_on_torch(layout: str, tmp_path: Path) -> None:
    _assert_both_engines_train_alike(tmp_path, TITAN_EP_LAYOUTS[layout])
