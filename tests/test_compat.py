"""Every private or internal library name the project relies on exists, with the parameters we call
it with: after an upgrade of Composer, streaming, torch, transformers or diffusers, this one test
fails with one line per broken symbol (compat/ says why each one is needed).

A row of RELIED_ON is (where, name, what):
- where: a module, or `module:Class` (the name is looked up on the class, its bases included);
- what: a tuple of parameter names (they must appear in the callable's signature, in this order,
  `self` aside); None (the name need only exist); or ASSIGNED (an attribute set on instances: the
  source of `where`, a class with its bases or a module, must assign it).
Every library name compat/ imports or reaches as a private attribute must have a row.
"""

import ast
import importlib
import inspect
import re
import subprocess

import pytest

from tests.conftest import REPO

ASSIGNED = "assigned"
LIBRARIES = ("composer", "streaming", "torch", "transformers", "diffusers")

RELIED_ON = [
    # composer 0.32.1 (compat/composer.py)
    ("composer.utils", "checkpoint", None),
    ("composer.utils.checkpoint", "_write_checkpoint_file", ("state_dict", "filename")),
    ("composer.trainer.trainer:Trainer", "_rng_state", ASSIGNED),
    ("composer.trainer.trainer:Trainer", "_use_closures", ()),
    ("composer.loggers.mlflow_logger:MLFlowLogger", "_enabled", ASSIGNED),
    ("composer.loggers.mlflow_logger:MLFlowLogger", "_run_id", ASSIGNED),
    ("composer.loggers.mlflow_logger:MLFlowLogger", "tracking_uri", ASSIGNED),
    ("composer.devices:DeviceCPU", "_device", ASSIGNED),
    ("composer.devices:DeviceGPU", "_device", ASSIGNED),
    ("composer.core", "State", None),
    ("composer.core:State", "fsdp_enabled", None),
    ("composer.callbacks", "CheckpointSaver", None),
    ("composer.callbacks:CheckpointSaver", "_symlink_upload_wait_before_next_try_in_seconds", ASSIGNED),
    ("composer.utils", "collect_env", None),
    ("composer.utils", "remote_uploader", None),
    ("composer.utils.remote_uploader", "ProcessPoolExecutor", None),  # swapped by upload_in_threads
    ("composer.utils.remote_uploader", "multiprocessing", None),  # swapped by upload_in_threads
    ("composer.utils.remote_uploader:RemoteUploader", "upload_executor", ASSIGNED),
    ("composer.utils.remote_uploader:RemoteUploader", "check_remote_files_exist_executor", ASSIGNED),
    ("composer.utils.remote_uploader:RemoteUploader", "is_remote_upload_failed", ASSIGNED),
    ("composer.loggers", "RemoteUploaderDownloader", None),
    ("composer.loggers:RemoteUploaderDownloader", "__init__", ("bucket_uri", "use_procs")),
    ("composer.utils.collect_env", "get_cpu_model", ()),  # called by get_composer_env_dict
    ("composer.utils.collect_env", "get_composer_env_dict", ()),  # called by Trainer.__init__
    ("composer.utils", "FSDP2Config", None),
    ("composer.utils:FSDP2Config", "data_parallel_shard_degree", None),  # read by _create_device_mesh
    ("composer.utils:FSDP2Config", "data_parallel_replicate_degree", None),
    ("composer.core.state", "_create_device_mesh", ("device", "fsdp_config", "tp_config")),
    ("composer.algorithms.ema.ema", "EMAParameters", ("model",)),
    ("composer.algorithms.ema.ema", "compute_ema", ("model", "ema_model", "smoothing")),
    ("composer.callbacks.speed_monitor", "GPU_AVAILABLE_FLOPS", None),
    ("composer.algorithms.low_precision_groupnorm.low_precision_groupnorm", "LPGroupNorm", None),
    ("composer.algorithms.low_precision_layernorm.low_precision_layernorm", "LPLayerNorm", None),
    # mosaicml-streaming 0.13.0 (compat/streaming.py)
    ("streaming.base.compression", "decompress", ("algo", "data")),
    ("streaming.base.constant", "BARRIER_FILELOCK", None),
    ("streaming.base.constant", "CACHE_FILELOCK", None),
    ("streaming.base.constant", "LOCALS", None),
    ("streaming.base.constant", "SHM_TO_CLEAN", None),
    ("streaming.base.format", "reader_from_json", ("dirname", "split", "obj")),
    ("streaming.base.shared", "prefix", None),
    ("streaming.base.shared.prefix", "_get_path", ("prefix_int", "name")),
    ("streaming.base.shared.prefix", "_unpack_locals", ("data",)),
    ("streaming.base.shared.prefix", "_check_and_find", None),
    ("streaming.base.shared.prefix", "SharedMemory", ("auto_cleanup",)),
    ("streaming.base.shuffle", "algos", None),
    ("streaming.base.storage", "CloudDownloader", None),
    ("streaming.base.storage:CloudDownloader", "direct_download", ("remote", "local", "timeout")),
    ("streaming.base.storage.upload", "logger", None),  # compat.streaming.UPLOAD_LOGGER
    ("streaming.base.util", "bytes_to_int", ("bytes_str",)),
    ("streaming.base.util", "merge_index", None),
    ("streaming.base.util", "_merge_index_from_list", ("index_file_urls", "out")),  # merge_index(list, out)
    ("streaming.base.world", "World", None),
    ("streaming.base.world:World", "detect", ()),
    ("streaming.base.world:World", "detect_workers", ()),
    ("streaming.base.world:World", "is_local_leader", ASSIGNED),
    ("streaming:StreamingDataset", "_shm_prefix_int", ASSIGNED),
    ("streaming:StreamingDataset", "_unique_rank_world", ASSIGNED),
    ("streaming:StreamingDataset", "_parallel_rank_world", ASSIGNED),
    ("streaming:StreamingDataset", "_unique_worker_world", ASSIGNED),
    ("streaming:StreamingDataset", "_parallel_worker_world", ASSIGNED),
    ("streaming:StreamingDataset", "_resume_incr_epoch", ()),
    ("streaming:StreamingDataset", "_get_work", ("epoch", "sample_in_epoch")),
    ("streaming:StreamingDataset", "_iterator", ASSIGNED),
    ("streaming:StreamingDataset", "_executor", ASSIGNED),
    ("streaming.base.dataset:_Iterator", "exit", ()),
    # torch 2.14.1 (compat/torch.py)
    ("torch.distributed.fsdp", "FullyShardedDataParallel", None),
    ("torch.distributed.fsdp:FullyShardedDataParallel", "fsdp_modules", ("module",)),
    ("torch.distributed.fsdp:FullyShardedDataParallel", "_handle", ASSIGNED),
    ("torch.distributed.fsdp._init_utils", "_use_orig_params", ASSIGNED),
    ("torch.distributed.fsdp._flat_param:FlatParamHandle", "uses_sharded_strategy", None),
    ("torch.distributed.fsdp._flat_param:FlatParamHandle", "needs_unshard", ()),
    ("torch.distributed.fsdp._runtime_utils", "_reshard", ("state", "handle", "free_unsharded_flat_param")),
    ("torch.utils._python_dispatch", "TorchDispatchMode", None),
    (
        "torch.utils._python_dispatch:TorchDispatchMode",
        "__torch_dispatch__",
        ("func", "types", "args", "kwargs"),
    ),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl", None),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper:CheckpointImpl", "NO_REENTRANT", None),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "apply_activation_checkpointing",
        ("model", "checkpoint_wrapper_fn", "check_fn"),
    ),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        ("module", "checkpoint_impl"),
    ),
    ("torch._dynamo.utils", "counters", None),
    ("torch._dynamo", "explain", ("f",)),
    ("torch._inductor", "list_mode_options", ("mode", "dynamic")),
    ("torch._dynamo", "config", None),
    ("torch._dynamo.config", "recompile_limit", None),
    ("torch.nn:Module", "_compiled_call_impl", ASSIGNED),
    ("torch.fx.experimental", "_config", None),
    ("torch.fx.experimental._config", "meta_nonzero_assume_all_nonzero", None),
    # transformers 5.24.0 (compat/transformers.py)
    ("transformers.convert_slow_tokenizer", "bytes_to_unicode", ()),
    # diffusers 0.42.1 (compat/diffusers.py)
    ("diffusers.models.attention_processor", "Attention", None),
    ("diffusers.models.attention_processor", "AttnProcessor", ()),
    ("diffusers.models.attention_processor", "AttnProcessor2_0", ()),
    ("diffusers.models.autoencoders.vae", "DiagonalGaussianDistribution", ("parameters",)),
    ("diffusers.models.resnet", "ResnetBlock2D", None),
    (
        "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion",
        "rescale_noise_cfg",
        ("noise_cfg", "noise_pred_text", "guidance_rescale"),
    ),
    ("diffusers.utils", "convert_state_dict_to_diffusers", ("state_dict",)),
    ("diffusers.utils", "convert_state_dict_to_kohya", ("state_dict",)),
    ("diffusers.utils", "convert_unet_state_dict_to_peft", ("state_dict",)),
]


def _owner(where: str):
    module, _, cls = where.partition(":")
    owner = importlib.import_module(module)
    for part in cls.split(".") if cls else ():
        owner = getattr(owner, part)
    return owner


def _sources(owner) -> list[str]:
    if not inspect.isclass(owner):
        return [inspect.getsource(owner)]
    sources = []
    for klass in owner.__mro__[:-1]:  # object has no Python source
        try:
            sources.append(inspect.getsource(klass))
        except (OSError, TypeError):
            pass
    return sources


def in_order(wanted: tuple[str, ...], names: list[str]) -> bool:
    position = iter(names)
    return all(name in position for name in wanted)


def broken(where: str, name: str, what) -> str | None:
    """Why the row (where, name, what) no longer holds, or None."""
    try:
        owner = _owner(where)
    except Exception as err:  # noqa: BLE001 - any failure to import is the report
        return f"cannot import {where}: {type(err).__name__}: {err}"
    if what == ASSIGNED:
        # `.name = `, `.name: T = ` or a tuple target, `.name, .other = `
        assignment = re.compile(rf"(?:\.|^\s*){re.escape(name)}\s*(?::[^=\n]+|,[^=\n]+)?=(?!=)", re.M)
        if not any(assignment.search(source) for source in _sources(owner)):
            return "no longer assigned there"
        return None
    if not hasattr(owner, name):
        return "missing"
    if what is None:
        return None
    try:
        params = [p for p in inspect.signature(getattr(owner, name)).parameters if p != "self"]
    except (TypeError, ValueError) as err:
        return f"no signature ({err})"
    if not in_order(what, params):
        return f"parameters ({', '.join(params)}) lack ({', '.join(what)}) in that order"
    return None


def _unlisted_in_compat() -> list[str]:
    """Library names compat/ imports, or private attributes it reaches, that RELIED_ON lacks."""
    listed = {(where.partition(":")[0], name) for where, name, _ in RELIED_ON}
    names = {name for _, name, _ in RELIED_ON}
    bad = []
    for path in sorted((REPO / "compat").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        ours = {
            t.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
                bad += [
                    f"{path.name}: from {node.module} import {a.name}"
                    for a in node.names
                    if (node.module, a.name) not in listed
                ]
            elif isinstance(node, ast.Attribute) and re.fullmatch(r"_[a-z]\w*", node.attr):
                if node.attr not in names and node.attr not in ours:
                    bad.append(f"{path.name}: attribute .{node.attr}")
        module = importlib.import_module(f"compat.{path.stem}") if path.stem != "__init__" else None
        for name, source in getattr(module, "_LAZY", {}).items():
            if (source, name) not in listed:
                bad.append(f"{path.name}: lazy {source}.{name}")
    return [f"{line}: not in tests/test_compat.py's RELIED_ON" for line in bad]


@pytest.mark.heavy
def test_every_private_symbol_we_rely_on_still_holds():
    failures = [
        f"{where}.{name}: {why}" for where, name, what in RELIED_ON if (why := broken(where, name, what))
    ]
    failures += _unlisted_in_compat()
    assert not failures, f"{len(failures)} broken or unlisted library symbols:\n" + "\n".join(failures)


def test_the_check_reports_what_an_upgrade_breaks():
    assert broken("streaming.base.shared.prefix", "_get_path_renamed", ("prefix_int",)) == "missing"
    assert broken("streaming.base.shared.prefix", "_get_path", ("prefix", "name")).startswith("parameters")
    assert broken("composer.trainer.trainer:Trainer", "_rng_state_v2", ASSIGNED) == "no longer assigned there"
    assert broken("composer.no_such_module", "x", None).startswith("cannot import composer.no_such_module")


def test_the_environment_report_each_trainer_logs_starts_no_process(monkeypatch):
    """Composer's Trainer logs `get_composer_env_dict()`, whose CPU name py-cpuinfo finds by running
    itself in a subprocess (1.1 s of CPU a Trainer); build_trainer calls skip_cpu_probe first."""
    from composer.utils import collect_env

    from compat.composer import PROBING_CPU_MODEL, skip_cpu_probe

    class Started(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Started

    monkeypatch.setattr(collect_env, "get_cpu_model", PROBING_CPU_MODEL)  # as before any Trainer
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    with pytest.raises(Started):  # Composer's own, as the control
        collect_env.get_composer_env_dict()
    skip_cpu_probe()
    report = collect_env.get_composer_env_dict()
    assert report["cpu_model"] and report["composer_version"]


def test_composer_uploads_from_threads_of_this_process(monkeypatch):
    """A remote save_folder's RemoteUploader (and a RemoteUploaderDownloader) would spawn processes
    that outlive a killed run (tests/test_killed_run.py); after upload_in_threads, which build_trainer
    calls, every pool runs its work in this process and none is started. A process started here
    would also fail this unmarked test (tests/tiers.py)."""
    import os
    import threading
    from concurrent.futures import ProcessPoolExecutor

    from composer.loggers import RemoteUploaderDownloader
    from composer.utils import remote_uploader

    from compat.composer import PROCESS_POOL, upload_in_threads

    assert PROCESS_POOL is ProcessPoolExecutor  # what upload_in_threads replaces is Composer's own
    for name in ("ProcessPoolExecutor", "multiprocessing"):  # put back after the test
        monkeypatch.setattr(remote_uploader, name, getattr(remote_uploader, name))
    init = RemoteUploaderDownloader.__init__
    monkeypatch.setattr(init, "__defaults__", init.__defaults__)
    upload_in_threads()
    upload_in_threads()  # twice: no change

    uploader = remote_uploader.RemoteUploader(remote_folder="s3://bucket/run/checkpoints")
    try:
        for pool in (uploader.upload_executor, uploader.check_remote_files_exist_executor):
            assert pool.submit(os.getpid).result() == os.getpid()
        assert isinstance(uploader.is_remote_upload_failed, threading.Event)
    finally:
        uploader.wait_and_close()
    assert RemoteUploaderDownloader(bucket_uri="s3://bucket")._proc_class is threading.Thread
    assert inspect.signature(RemoteUploaderDownloader).parameters["use_procs"].default is False
