"""Build the composer Trainer for a run config, and train.

Reads top to bottom in the order things are built: check the config and the batch arithmetic,
build the model, the data, the optimizer and scheduler, the `_target_` objects, then the Trainer.
"""

import dataclasses
import logging
import os
from urllib.parse import urlparse

import torch
from composer import Trainer
from composer.loggers import MLFlowLogger
from composer.utils import dist, reproducibility
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig

from common.secrets import protect_config_secrets, redact
from compat.composer import (
    cache_fsdp_enabled,
    mlflow_run_id,
    poll_remote_checkpoints_every,
    skip_cpu_probe,
    step_without_closure,
    upload_in_threads,
)
from data.latent_dataset import read_empty_caption
from data.loader import build_image_caption_dataloader
from extensions.callbacks import IsolateEvalRng, RestoreRngOnResume
from extensions.checkpointing import install_atomic_checkpoint_writes
from extensions.ema import find_ema
from extensions.master_weights import MasterWeightAdamW, needs_masters
from extensions.persistent_grads import PersistentGradients
from extensions.quality_target import QualityTarget
from extensions.sample_draws import SampleDraws
from models import Autoencoder, build
from models.build import check_pretrained
from models.checkpoints.record import ModelRecord, describe
from models.presets import size_multiple
from models.registry import MODEL_CLASSES, of_model
from models.training.fp8 import cpu_emulation
from models.training.torch_compile import compiles_with_cudagraphs
from recipes.config import ConfigError, RunConfig, check_device, parse_config
from recipes.data_checks import check_data
from recipes.dreambooth import PRIOR_SHARE, prepare_dreambooth
from recipes.evaluators import attach_keep_best, eval_dataloaders, trainer_options
from recipes.keep_checkpoints import adopt_earlier_checkpoints
from recipes.load_check import resume_and_check
from recipes.memory_check import check_memory
from recipes.prepare import ensure_dataset, prepare_pretrained
from recipes.run_parallelism import shape_of, with_parallelism
from recipes.scaling import BatchPlan, plan_batches
from recipes.shm import clean_shared_memory

log = logging.getLogger(__name__)
# Seconds between Composer's checks that a checkpoint has reached a remote save_folder, after which it
# uploads the `latest` pointer (Composer's default is 30; one HEAD request each, while the upload runs).
REMOTE_POINTER_POLL_S = 2.0


def build_trainer(cfg: RunConfig | DictConfig | dict) -> Trainer:
    run = cfg if isinstance(cfg, RunConfig) else parse_config(cfg)
    protect_config_secrets(dataclasses.asdict(run))  # before a logger (wandb) records the command line
    check_device(run)
    world_size = dist.get_world_size()
    plan = _plan(run, world_size)  # an uneven batch split fails here, before anything is built
    shape = shape_of(run, world_size)  # so does a shard x replicate that is not the world size
    check_memory(run, world_size, shape.shard, plan)  # and a model this device cannot hold
    sharded = shape.fsdp2
    reproducibility.seed_all(run.seed)
    # Up once, before streaming or the Trainer would each start (and streaming destroy) their own;
    # when the Trainer would start one (composer/trainer/trainer.py), so one process stays without.
    if dist.get_world_size() > 1 or run.trainer.get("parallelism_config") or sharded:
        dist.initialize_dist(run.trainer.get("device"), run.trainer.get("dist_timeout", 300.0))
    data_cfgs = [c for c in (run.data.train, run.data.eval) if c is not None]
    clean_shared_memory([c.local for c in data_cfgs if c.local])  # a killed run's, for our folders
    install_atomic_checkpoint_writes()
    skip_cpu_probe()  # Composer's Trainer would run py-cpuinfo in a subprocess (1.1 s) to log the CPU's name
    upload_in_threads()  # Composer's upload processes would outlive a killed run (tests/test_killed_run.py)
    if run.dreambooth is not None:  # data.train from its folders, class images drawn where missing
        run = _dreambooth_data(run)
    for split, data_cfg in (("train", run.data.train), ("eval", run.data.eval)):
        try:
            if data_cfg is not None:
                ensure_dataset(data_cfg, _size_multiple(run.model["preset"]), key=f"data.{split}")
                batch = run.global_train_batch_size if split == "train" else None
                check_data(data_cfg, f"data.{split}", run.model["preset"], batch)
        except (FileNotFoundError, ValueError) as err:  # ensure_dataset's own messages name the key
            message = str(err)
            raise ConfigError(
                message if message.startswith(f"data.{split}") else f"data.{split}: {message}"
            ) from err
    if run.prepare_pretrained is not None:
        prepare_pretrained(run.model.get("pretrained"), run.prepare_pretrained)
    if run.model.get("pretrained") is not None:
        try:
            check_pretrained(run.model["pretrained"])  # before the model: a typo is one line
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from err

    # The checkpoint a rerun resumes from: one decision for all ranks (recipes/resume.py), local or
    # remote; it, or the run's load_path, checked against the model before anything trains.
    kwargs = resume_and_check(trainer_kwargs(run, world_size), run.model["preset"], run.run_name)
    # Sharding (FSDP2: recipes/parallelism.py), also for a run that resumes a sharded checkpoint.
    kwargs = with_parallelism(kwargs, run, world_size)
    fsdp = kwargs.get("parallelism_config") and run.trainer.get("device") != "cpu"
    if fsdp and torch.cuda.is_available():
        place_unsharded(kwargs["model"], torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))))
    trainer = Trainer(**kwargs)
    adopt_earlier_checkpoints(trainer, kwargs.get("save_folder"), kwargs.get("save_filename"), run.run_name)
    attach_keep_best(trainer, run)  # after the CheckpointSaver: it links what the saver saved
    cache_fsdp_enabled(trainer.state)  # Composer walks every module once a batch to ask this otherwise
    step_without_closure(trainer)  # no loss.item() between the backward and the optimizer's kernels
    # The remote `latest` pointer up to 2 s behind its checkpoint, not 30 s; so too the wait at a run's end.
    poll_remote_checkpoints_every(trainer, REMOTE_POINTER_POLL_S)
    trainer.state.callbacks.append(RestoreRngOnResume(trainer))
    trainer.state.callbacks.append(IsolateEvalRng())  # evaluating leaves training's random draws unchanged
    params = redact(dataclasses.asdict(run))  # what wandb/MLflow show: masked (common/secrets.py)
    for destination in trainer.logger.destinations:
        # MLflow keeps a param per top-level key as one string; dotted keys (optimizer.lr) can be
        # compared and filtered across runs.
        destination.log_hyperparameters(_flat(params) if isinstance(destination, MLFlowLogger) else params)
    return trainer


def _dreambooth_data(run: RunConfig) -> RunConfig:
    gpu = run.trainer.get("device") == "gpu" and torch.cuda.is_available()
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if gpu else "cpu"  # the rank that draws, its own GPU
    try:
        return prepare_dreambooth(run, device)
    except (ValueError, FileNotFoundError) as err:  # its messages name the key; a missing model.pretrained
        raise ConfigError(str(err)) from err


def place_unsharded(model: torch.nn.Module, device: torch.device) -> None:
    """Move the children FSDP leaves alone (`_fsdp_wrap = False`: the frozen VAE and text encoder) to
    `device`. Under FSDP, Composer moves only the modules it wraps (composer/distributed/
    dist_strategy.py skips the others and the Trainer skips `module_to_device`): left alone they
    stay on the CPU, and the first caption dropout, which runs the text encoder on the GPU batch,
    fails with a device mismatch."""
    for child in model.children():
        if getattr(child, "_fsdp_wrap", True) is False:
            child.to(device)


def _flat(params: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in params.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _size_multiple(preset: str) -> int:
    """What image sizes must be multiples of for this preset (aspect-ratio buckets)."""
    return size_multiple(preset.removesuffix("-vae"))


def loader_inputs(model) -> dict:
    """What the image data path hands `model` besides the image and CLIP ids (data/image_caption.py),
    as its family's conditioner says (models/engine/conditioners.py: a second tokenizer, T5's ids `t5_tokens`
    long when the model has a T5) and SDXL's micro-conditioning sizes."""
    if not hasattr(model, "conditioner"):  # an autoencoder run (models/autoencoder.py): images alone
        return {}
    family = of_model(model)
    return dict(family.conditioner.loader_inputs(model), micro_conditioning=family.micro_conditioning)


def _use_empty_caption(run: RunConfig, model) -> None:
    """Caption dropout on precomputed encodings takes the empty caption's that `sd-convert latents`
    stored beside the set (data/latent_dataset.py), not the model's own encoding of "" (the text
    encoders a run on such a set need not load, nor match); a set without them keeps the latter."""
    if not (run.data.train.latents and getattr(model, "caption_drop_prob", 0.0)):
        return
    try:
        empty = read_empty_caption(run.data.train)
    except ValueError as err:
        raise ConfigError(f"data.train: {err}") from err
    if empty is not None:
        model.set_empty_caption(empty)


def _plan(run: RunConfig, world_size: int):
    return plan_batches(
        run.global_train_batch_size, world_size, run.trainer.get("device_train_microbatch_size")
    )


def trainer_kwargs(run: RunConfig, world_size: int) -> dict:
    """The keyword arguments `build_trainer` gives composer.Trainer: the model, dataloaders,
    optimizer, scheduler and the `_target_` objects built from `run`, and `run.trainer` with the
    microbatch the batch plan uses (recipes/scaling.py: the YAML's is a cap).

    Needs neither the run's device nor a process group (a test checks a GPU recipe's wiring on a
    CPU with it); `build_trainer` checks the device, seeds, starts the process group and prepares
    the data and pretrained folder before calling it.
    """
    plan = _plan(run, world_size)
    batch_size = plan.per_device_batch
    try:
        with cpu_emulation(run.trainer.get("device") == "cpu"):  # model.fp8 on a CPU run: emulated
            model = build(**run.model)
    except FileNotFoundError as err:  # model.pretrained's folder or one of its components is missing
        raise ConfigError(str(err)) from err
    if run.dreambooth is not None:  # the class images' weight and share (models/engine/prior_loss.py)
        model.prior_loss_weight = run.dreambooth.prior_loss_weight
        model.prior_share = PRIOR_SHARE if run.dreambooth.with_prior_preservation else 0.0
    multiple = _size_multiple(run.model["preset"])
    extra = loader_inputs(model)
    train_loader = build_image_caption_dataloader(
        run.data.train, model.tokenizer, batch_size, multiple, **extra
    )
    _use_empty_caption(run, model)
    eval_loader = None
    if run.data.eval is not None:
        eval_loader = build_image_caption_dataloader(
            run.data.eval, model.tokenizer, batch_size, multiple, "eval", **extra
        )
        # Each new DataLoader iterator draws its workers' base seed from `generator`, else from the
        # global torch RNG; Composer starts one for every evaluation and spins the eval loader once at
        # fit start, which would shift the training's noise. (The training loader keeps the global
        # RNG: resuming relies on that draw, see RestoreRngOnResume.)
        eval_loader.generator = torch.Generator().manual_seed(run.seed)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(run.optimizer, trainable)
    scheduler = instantiate(run.scheduler) if run.scheduler is not None else None
    cap = run.trainer.get("device_train_microbatch_size")
    log.info(
        "run %s: preset %s, %.1fM trainable parameters; global batch %d = %d devices x %d per device "
        "(microbatch %s%s, gradient accumulation %s)",
        run.run_name,
        run.model["preset"],
        sum(p.numel() for p in trainable) / 1e6,
        run.global_train_batch_size,
        world_size,
        batch_size,
        plan.microbatch,
        f", capped by trainer.device_train_microbatch_size={cap}"
        if cap not in (None, plan.microbatch)
        else "",
        plan.grad_accum,
    )
    callbacks = [instantiate(spec) for spec in run.callbacks.values()]
    if compiles_with_cudagraphs(run.model.get("compile_unet")):  # gradients out of the graphs' memory
        callbacks.append(PersistentGradients(model.denoiser))
    if getattr(model, "train_draws", "rank") == "sample":  # the batch index its draws are keyed by
        callbacks.append(SampleDraws(run.seed))
    if isinstance(model, (*MODEL_CLASSES.values(), Autoencoder)):  # every checkpoint says what it holds
        callbacks.append(ModelRecord(describe(model)))
    return dict(
        run_name=run.run_name,
        seed=run.seed,
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=eval_dataloaders(run, train_loader, eval_loader, run.seed),
        optimizers=optimizer,
        schedulers=scheduler,
        algorithms=[instantiate(spec) for spec in run.algorithms.values()],
        callbacks=callbacks,
        loggers=[_instantiate_logger(spec) for spec in run.loggers.values()],
        **_trainer_options(run.trainer, plan),
    )


def _optimizer(spec: dict, trainable: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """`spec` (run.optimizer) over the trainable parameters; over bf16 ones (model.param_dtype), the
    same AdamW keeping fp32 master weights in its state (extensions/master_weights.py). Plain
    containers (`_convert_`): a YAML list (AdamW's betas) would stay an omegaconf ListConfig in the
    param groups, which torch distributed checkpoint refuses to save ("Unexpected value type")."""
    spec = {**spec, "_convert_": "all"}
    if not needs_masters(trainable):
        return instantiate(spec, params=trainable)
    if get_object(spec["_target_"]) is not torch.optim.AdamW:  # recipes/config.py refuses it first
        raise ConfigError(f"'optimizer._target_' {spec['_target_']} keeps no fp32 master weights")
    master_weight_adamw = f"{MasterWeightAdamW.__module__}.{MasterWeightAdamW.__qualname__}"
    return instantiate({**spec, "_target_": master_weight_adamw}, params=trainable)


def _trainer_options(trainer: dict, plan: BatchPlan) -> dict:
    """`run.trainer` for composer.Trainer, with the microbatch the plan uses in place of the cap
    (Composer would run the cap itself: a microbatch larger than the per-device batch, or one that
    leaves a smaller last microbatch), and autoresume off for a run that saves nothing
    (`save_folder: null`: nothing to resume from; Composer would refuse the pair)."""
    trainer = trainer_options(trainer)  # trainer.keep_best is the recipe's (recipes/evaluators.py)
    if trainer.get("save_folder") is None and trainer.get("autoresume"):
        trainer = {**trainer, "autoresume": False}
    if trainer.get("device_train_microbatch_size") is None:  # unset: Composer's default, one microbatch
        return trainer
    return {**trainer, "device_train_microbatch_size": plan.microbatch}


def _instantiate_logger(spec: dict):
    if spec["_target_"].rsplit(".", 1)[-1] == "MLFlowLogger":
        uri = str(spec.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or "")
        if uri and urlparse(uri).scheme in ("", "file"):
            # mlflow 3 refuses to open a file store (a folder or file://) unless this is set, steering
            # users to a database store, which mlflow-skinny cannot run (no SQLAlchemy). A run that
            # names a folder asked for a file store.
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    return instantiate(spec)


def train(cfg: RunConfig | DictConfig | dict) -> Trainer:
    """Build the Trainer for `cfg`, train it to `trainer.max_duration`, close it, and return it.

    Closing flushes every logger (MLflow's asynchronous queue, uploads of RemoteUploaderDownloader,
    wandb) and ends its run before this returns. Left to Composer's atexit hook, it would run after
    the interpreter has stopped the thread pools those loggers queue work on, and MLflow would keep
    nothing ("cannot schedule new futures after interpreter shutdown"). The returned trainer's state
    (model, EMA, timestamp, saved_checkpoints) stays usable; closing it again does nothing. A caller of
    `build_trainer` + `fit()` must call `trainer.close()` itself.
    """
    trainer = build_trainer(cfg)
    if _finished(trainer):
        return trainer
    try:
        trainer.fit()
    except BaseException:
        # Inside `except`, so loggers see the error (MLflow marks the run FAILED). Only this process's
        # loggers: no barrier, which would wait for ranks that may never come.
        trainer.engine.close()
        _mark_mlflow_runs_failed(trainer)
        raise
    trainer.close()
    return trainer


def _finished(trainer: Trainer) -> bool:
    """A rerun of a run that reached max_duration (autoresume loaded its last checkpoint): say so and
    train nothing, where Composer's fit() would raise "No training would occur". The EMA's average,
    which it restores at fit start, is restored here, so the returned trainer samples as the run's."""
    state = trainer.state
    if state.max_duration is None or state.timestamp.get(state.max_duration.unit) < state.max_duration:
        return False
    if (ema := find_ema(state.algorithms)) is not None:
        ema.bind(state.model)
    if any(
        isinstance(c, QualityTarget) and c.reached for c in state.callbacks
    ):  # it ended the run, and said so
        trainer.close()
        return True
    log.warning(
        "run %s is complete: its newest checkpoint has trained %s of trainer.max_duration=%s; nothing "
        "to do (raise trainer.max_duration to train on)",
        state.run_name,
        state.timestamp.get(state.max_duration.unit),
        state.max_duration,
    )
    trainer.close()
    return True


def _mark_mlflow_runs_failed(trainer: Trainer) -> None:
    """Composer 0.32's MLFlowLogger marks a run that raised FAILED, then calls mlflow.end_run(), which
    (mlflow 3) sets it FINISHED again: set it back."""
    for destination in trainer.logger.destinations:
        if isinstance(destination, MLFlowLogger) and (run_id := mlflow_run_id(destination)):
            from mlflow import MlflowClient

            MlflowClient(destination.tracking_uri).set_terminated(run_id, status="FAILED")
