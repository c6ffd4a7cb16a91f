"""The Flux recipes' wiring, without building an 11.9 B model: yamls/flux-schnell-mlperf.yaml is the
MLPerf reference run (its settings are the reference runs' at its global batch, its validation is the
benchmark's, and it shards within a node and replicates across nodes, as the reference launches);
yamls/flux-finetune.yaml shards over a node; yamls/tiny-flux-cpu.yaml shards whenever it runs on more
than one process, and only then (its 2-process runs, sharded checkpoints: tests/test_fsdp2_flux.py)."""

import pytest
from composer.core import Time

from recipes import load_config, parse_config
from recipes.convergence import FLUX1, benchmark_of, run_settings
from recipes.parallelism import Parallelism, Shape, composer_parallelism, resolve
from tests.conftest import REPO

YAMLS = REPO / "yamls"
MLPERF = [
    "model.pretrained=/m",
    "data.train.remote=s3://b/t",
    "data.eval.remote=s3://b/e",
    "trainer.save_folder=/c",
]


def test_the_mlperf_recipe_trains_as_the_reference_runs_at_its_batch():
    run = parse_config(load_config(YAMLS / "flux-schnell-mlperf.yaml", MLPERF))
    assert benchmark_of(run) is FLUX1  # its preset, resolution, validation and target: the benchmark's
    assert run_settings(run) == FLUX1.settings(run.global_train_batch_size)  # lr, warmup, AdamW, clipping
    # Validation every 262,144 samples: a whole number of batches, so at the reference's steps.
    every = Time.from_timestring(run.trainer["eval_interval"])
    assert every.value == FLUX1.eval_every and every.value % run.global_train_batch_size == 0
    assert run.data.train.latents and run.data.eval.latents  # precomputed encodings, as the reference
    assert run.model["caption_drop_prob"] == 0.1


def test_the_mlperf_recipe_shards_per_node_and_replicates_across_nodes():
    """On 2 nodes of 8 GPUs: 2 copies x 8 shards (HSDP), each block its own FSDP2 unit and recomputed in
    the backward pass; on one node, one copy sharded over its 8."""
    run = parse_config(load_config(YAMLS / "flux-schnell-mlperf.yaml", MLPERF))
    assert resolve(run.parallelism, 16, 8) == Shape(8, 2, fsdp2=True)
    assert resolve(run.parallelism, 8, 8) == Shape(8, 1, fsdp2=True)
    config = composer_parallelism(
        resolve(run.parallelism, 16, 8), run.parallelism, bool(run.model["activation_checkpointing"])
    ).fsdp2
    assert (config.data_parallel_replicate_degree, config.data_parallel_shard_degree) == (2, 8)
    assert config.activation_checkpointing and config.mixed_precision == "DEFAULT"
    assert run.model["fsdp_wrap"] == run.model["activation_checkpointing"] == "blocks"


def test_the_finetune_recipe_shards_over_a_node():
    given = ["model.pretrained=/models/FLUX.1-dev", "data.train.local=/d", "trainer.save_folder=/c"]
    run = parse_config(load_config(YAMLS / "flux-finetune.yaml", given))
    assert run.model["preset"] == "flux-dev" and "transformer" in run.model["pretrained_components"]
    assert resolve(run.parallelism, 8, 8) == Shape(8, 1, fsdp2=True)
    assert not run.model["gradient_checkpointing"] and run.model["activation_checkpointing"] == "blocks"


def test_tiny_flux_shards_on_more_than_one_process_only(monkeypatch):
    """Under a launcher (LOCAL_WORLD_SIZE 2: composer -n 2, torchrun) it is `shard: node`; on one
    process, data parallelism (no FSDP2: one checkpoint file, the step of the demo and the tests)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = parse_config(load_config(YAMLS / "tiny-flux-cpu.yaml")).parallelism
    assert resolve(one, 1, 1) == Shape(1, 1, fsdp2=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # composer -n 1
    assert resolve(parse_config(load_config(YAMLS / "tiny-flux-cpu.yaml")).parallelism, 1, 1).fsdp2 is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two = parse_config(load_config(YAMLS / "tiny-flux-cpu.yaml")).parallelism
    assert resolve(two, 2, 2) == resolve(Parallelism(shard="node"), 2, 2) == Shape(2, 1, fsdp2=True)
    assert resolve(two, 4, 2) == Shape(2, 2, fsdp2=True)  # 2 nodes of 2: HSDP, as the full recipe


@pytest.mark.fit
def test_the_mlperf_recipe_shrunk_to_flux_tiny_stops_at_its_target(shapes_mds, tmp_path):
    """yamls/flux-schnell-mlperf.yaml as written, but for flux-tiny (from a folder of its frozen parts),
    the shapes' precomputed encodings as both sets, the CPU and a validation every 32 samples: FSDP2 on
    the one process (`shard: node`), validation at the 8 fixed timesteps on stored latents, and the
    quality target (set above any loss) ends the run at the first validation, saved there."""
    from models import build_model
    from recipes import build_trainer
    from tests.convert_fixtures import run_cli

    source = build_model("flux-tiny")
    for name in ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        getattr(source, name).save_pretrained(tmp_path / "flux" / name)
    latents = tmp_path / "latents"
    argv = ["latents", "--src", shapes_mds / "mds", "--out", latents, "--resolutions", 32]
    assert run_cli(*argv, "--preset", "flux-tiny", "--pretrained", tmp_path / "flux") == 0
    shrunk = [
        "model.preset=flux-tiny",
        f"model.pretrained={tmp_path / 'flux'}",
        *(
            f"data.{s}.{k}={v}"
            for s in ("train", "eval")
            for k, v in (("remote", "null"), ("local", latents))
        ),
        *(
            f"data.{s}.{k}={v}"
            for s in ("train", "eval")
            for k, v in (("resolution", 32), ("num_workers", 0))
        ),
        "global_train_batch_size=16",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "trainer.eval_interval=32sp",
        "trainer.max_duration=6ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "trainer.progress_bar=false",
        "callbacks.quality_target.target=100.0",
        "callbacks.memory_monitor=null",
        "callbacks.samples.per_prompt=1",
        "callbacks.samples.steps=2",
        "callbacks.samples.resolution=32",
        "~loggers.wandb",
    ]
    trainer = build_trainer(load_config(YAMLS / "flux-schnell-mlperf.yaml", shrunk))
    trainer.fit()
    trainer.close()
    assert int(trainer.state.timestamp.batch) == 2  # 32 samples: the first validation
    target = next(c for c in trainer.state.callbacks if type(c).__name__ == "QualityTarget")
    assert target.reached["samples"] == 32 and target.reached["loss"] <= 100.0
    assert "FixedTimestepLoss" in trainer.state.eval_metrics["eval"]
    assert (tmp_path / "ckpt" / "ep0-ba2" / ".metadata").is_file()  # sharded, as on a node of GPUs
