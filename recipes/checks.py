"""What a run can train with: the checks across keys of a parsed config (model.param_dtype and
model.compile_unet with the optimizer, precision and FSDP; FSDP's activation checkpointing), and of
the config against this machine (device, precision, microbatching, FSDP).

Each returns the problem, one line that names the key and the way out, or None; recipes/config.py
raises it as a ConfigError (parse_config, check_device), so this module needs nothing of it.
"""


def param_dtype_problem(model: dict, optimizer: dict, trainer: dict) -> str | None:
    """model.param_dtype: a value models.build knows, and with bf16 weights what can train them:
    torch.optim.AdamW (which the recipe swaps for its master-weight version,
    extensions/master_weights.py), bf16 autocast or none, and no FSDP (whose mixed precision casts
    fp32 weights to bf16 once per step itself)."""
    from hydra.utils import get_object

    from models.build import PARAM_DTYPES

    value = model.get("param_dtype")
    if not isinstance(value, str | None) or value not in PARAM_DTYPES:
        return f"'model.param_dtype' must be one of {list(PARAM_DTYPES)}, got {value!r}"
    if PARAM_DTYPES[value] is None:
        return None
    import torch

    target = optimizer.get("_target_")
    if get_object(target) is not torch.optim.AdamW:
        return (
            f"'model.param_dtype' is {value}, which needs optimizer._target_ torch.optim.AdamW (it keeps "
            f"the fp32 master weights: extensions/master_weights.py), not {target}"
        )
    precision = trainer.get("precision") or "fp32"
    if precision not in ("fp32", "amp_bf16"):
        return (
            f"'model.param_dtype' is {value}, which trains under trainer.precision amp_bf16 or fp32, "
            f"not {precision}"
        )
    if (trainer.get("parallelism_config") or {}).get("fsdp") is not None:
        return (
            f"'model.param_dtype' is {value} with trainer.parallelism_config.fsdp: FSDP keeps fp32 "
            "weights and casts them to bf16 once per step itself (its mixed_precision); leave "
            "model.param_dtype unset"
        )
    return None


def cudagraphs_problem(model: dict, trainer: dict) -> str | None:
    """The denoiser under CUDA graphs (model.compile_unet with mode reduce-overhead or max-autotune)
    and FSDP do not go together: FSDP gathers each unit's weights into new memory at every forward,
    so the graphs, which read fixed addresses, would be recorded again at every step."""
    from models.training.torch_compile import compiles_with_cudagraphs

    compile_unet = model.get("compile_unet")
    if compiles_with_cudagraphs(compile_unet) and (trainer.get("parallelism_config") or {}).get("fsdp"):
        return (
            f"'model.compile_unet' is {compile_unet}, which replays CUDA graphs, with "
            "trainer.parallelism_config.fsdp: FSDP gathers its weights into new memory every step and "
            "the graphs would be recorded again each time; use compile_unet: true (no CUDA graphs) "
            "or no FSDP"
        )
    return None


def fsdp_problem(trainer: dict) -> str | None:
    """FSDP activation checkpointing must be non-reentrant: Composer 0.32 defaults to the reentrant
    wrapper, which gives back only the top-level tensors of a block's output with their graph, and a
    diffusers UNet down block returns its skip connections in a nested tuple: they come back
    detached, so the first backward fails ("backward through the graph a second time") or, where it
    does not, the gradient is silently partial."""
    fsdp = (trainer.get("parallelism_config") or {}).get("fsdp") or {}
    if fsdp.get("activation_checkpointing") and fsdp.get("activation_checkpointing_reentrant", True):
        return (
            "'trainer.parallelism_config.fsdp.activation_checkpointing' needs "
            "activation_checkpointing_reentrant: false (Composer's default, true, detaches the UNet "
            "blocks' skip connections); add "
            "trainer.parallelism_config.fsdp.activation_checkpointing_reentrant=false"
        )
    return None


def device_problem(trainer: dict, optimizer: dict | None = None) -> str | None:
    """The device and precision this machine can run, and on the CPU an optimizer that is not
    capturable (yamls/_step/compiled.yaml, a GPU recipe's default step, makes it so)."""
    import torch

    device = trainer.get("device") or ("gpu" if torch.cuda.is_available() else "cpu")
    if device == "gpu" and not torch.cuda.is_available():
        return "'trainer.device' is gpu but this machine has no CUDA GPU; use trainer.device=cpu"
    if device == "cpu" and (optimizer or {}).get("capturable"):
        # torch asserts it at the first step: its capturable update keeps the step counters on a GPU.
        return (
            "'optimizer.capturable' is true, which needs a GPU (the update CUDA graphs can replay); "
            "add _step=eager for a CPU run (the step without compile, CUDA graphs or bf16 weights: "
            "yamls/_step/eager.yaml)"
        )
    precision = trainer.get("precision") or "fp32"
    if device == "cpu" and precision != "fp32":
        return (
            f"'trainer.precision' is {precision}, which the CPU cannot run (Composer trains fp32 on CPU); "
            "use trainer.precision=fp32"
        )
    if device == "cpu" and trainer.get("device_train_microbatch_size") == "auto":
        # Composer's adaptive microbatching halves the microbatch on a CUDA out-of-memory error.
        return (
            "'trainer.device_train_microbatch_size' is auto, which needs a CUDA GPU (it adapts to CUDA "
            "out-of-memory errors); give a number, e.g. trainer.device_train_microbatch_size=4"
        )
    if device == "cpu" and (trainer.get("parallelism_config") or {}).get("fsdp") is not None:
        # Composer 0.32's prepare_fsdp_module calls torch.cuda.current_device() (tried: it fails).
        return (
            "'trainer.parallelism_config.fsdp' needs CUDA GPUs (Composer's FSDP does not run on CPU); "
            "remove it with ~trainer.parallelism_config for a CPU run"
        )
    return None


# model.<key>: (check, what it must be). The model classes check them too, but only once the data is
# prepared and the model built; here they fail before anything is.
_MODEL_RANGES = {
    "caption_drop_prob": (lambda v: 0.0 <= v <= 1.0, "a probability in [0, 1]"),
    "offset_noise": (lambda v: v >= 0.0, "zero or more"),
    "min_snr_gamma": (lambda v: v > 0.0, "a positive number or null"),
    "timestep_std": (lambda v: v > 0.0, "a positive number"),
    "timestep_shift": (lambda v: v == "auto" or v > 0.0, "a positive number, 'auto' or null"),
}
PREDICTION_TYPES = ("epsilon", "v_prediction")


def model_values_problem(model: dict) -> str | None:
    """Numbers of `model:` out of their range, and an unknown prediction type."""
    for key, (ok, must) in _MODEL_RANGES.items():
        value = model.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number or value == "auto") or not ok(value):
            return f"'model.{key}' must be {must}, got {value!r}"
    prediction = model.get("prediction_type")
    if prediction is not None and prediction not in PREDICTION_TYPES:
        return f"'model.prediction_type' must be one of {list(PREDICTION_TYPES)} or null, got {prediction!r}"
    return None


def resolution_problem(preset: str, key: str, resolution) -> str | None:
    """`data.<split>.resolution` positive and a multiple of what the preset's latents need: the VAE's
    factor (8: 30 px would silently train on 24 px crops of 3x3 latents), times the patch size for a
    transformer (its latents are cut into patches)."""
    from models.presets import denoiser_factor, vae_factor
    from models.registry import PRESETS, of

    base = preset.removesuffix("-vae") if preset not in PRESETS else preset
    if base not in PRESETS:
        return None  # the preset check names it
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution <= 0:
        return f"'{key}.resolution' must be a positive number of pixels, got {resolution!r}"
    patches = of(base).patches  # a UNet takes any latent size; a transformer's are cut into patches
    multiple = vae_factor(base) * (denoiser_factor(base) if patches else 1)
    if resolution % multiple:
        low, high = resolution // multiple * multiple, (resolution // multiple + 1) * multiple
        why = "the VAE's factor x the patch size" if patches else "the VAE's factor"
        nearest = f"{low} or {high}" if low else str(high)
        return (
            f"'{key}.resolution' is {resolution}, not a multiple of {multiple} ({why} for preset "
            f"{base}); use {nearest}"
        )
    return None


def save_folder_problem(trainer: dict, run_name: str) -> str | None:
    """A local save_folder that holds an earlier run's checkpoints, with autoresume off and
    save_overwrite off: Composer would refuse only once the model and data are built (a traceback),
    and with save_overwrite on it would replace them. Say so before anything is built."""
    from pathlib import Path

    from recipes.resume import SAVE_FILENAME, checkpoint_pattern, is_remote

    folder = trainer.get("save_folder")
    if folder is None or is_remote(folder) or trainer.get("autoresume") or trainer.get("save_overwrite"):
        return None
    folder = Path(str(folder).replace("{run_name}", run_name))
    pattern = checkpoint_pattern(trainer.get("save_filename") or SAVE_FILENAME, run_name)
    if pattern is None or not folder.is_dir():
        return None
    found = sorted(
        (int(m["batch"]), p.name) for p in folder.iterdir() if (m := pattern.match(p.name)) is not None
    )
    if not found:
        return None
    return (
        f"'trainer.save_folder' {folder} holds checkpoints of an earlier run (newest: {found[-1][1]}); "
        "rerun with trainer.autoresume=true to continue it, or give a new trainer.save_folder to start "
        "afresh (trainer.save_overwrite=true replaces them)"
    )
