"""`model.fp8` (models/training/fp8.py): torchao's Float8Linear on the transformer blocks' matmuls, emulated
on the CPU. Which layers it takes, that a step trains close to (and not equal to) the high-precision step,
that a run of the tiny Flux recipe trains and its export is the plain high-precision pipeline, the
errors, and that importing torchao (transformers and diffusers do it) logs nothing."""

import subprocess
import sys

import pytest
import torch
from torchao.float8.float8_linear import Float8Linear

from models import build_model
from models.build import check_model_options
from models.training.fp8 import cpu_emulation, emulated
from models.training.sharding import units
from tests.conftest import REPO, tiny_run

PROMPTS = ["a red circle", "a blue square"]
TRANSFORMERS = ("mmdit-tiny", "flux-tiny")


def _built(preset: str, **options):
    torch.manual_seed(0)
    with cpu_emulation():  # these run on the CPU, also on a machine with a GPU
        return build_model(preset, **options)


@pytest.mark.parametrize("preset", TRANSFORMERS)
@pytest.mark.heavy
def test_the_blocks_attention_and_mlp_matmuls_train_in_float8_and_nothing_else(preset):
    """Every linear layer of the blocks but the adaLN modulation becomes a Float8Linear (rowwise, the
    default of `true`); the embedders, time/text MLPs, final norm and output stay nn.Linear; the state
    dict is the same tensors under the same names, so checkpoints and exports do not change."""
    plain, fp8 = _built(preset).transformer, _built(preset, fp8=True).transformer
    in_blocks = {id(m) for block in units(fp8, "blocks") for m in block.modules()}
    swapped = {name for name, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    linears = {name for name, m in fp8.named_modules() if isinstance(m, torch.nn.Linear)}
    modulation = {name for name in linears if ".norm" in name}
    outside = {
        name for name, m in fp8.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in in_blocks
    }
    assert swapped and modulation and outside  # each kind is there to be told apart
    assert swapped == linears - modulation - outside
    assert {"proj_out", "context_embedder", "norm_out.linear"} <= outside
    assert all("axs" in repr(fp8.get_submodule(name)) for name in swapped)  # rowwise: scales per axis
    a, b = plain.state_dict(), fp8.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and type(b[k]) is torch.Tensor for k in a)


def _loss_and_grads(model, batch):
    torch.manual_seed(1)  # the same noise and timesteps for both models
    model.train()
    loss = model.loss(model(batch), batch)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.transformer.parameters()])


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.heavy
def test_an_emulated_float8_step_is_near_the_full_precision_step_and_not_equal_to_it(recipe):
    """The same model, batch and draws with and without float8 matmuls: the loss within 2% and the
    gradient pointing the same way (cosine > 0.99), but not bitwise equal: the casts do happen."""
    plain, fp8 = _built("flux-tiny"), _built("flux-tiny", fp8=recipe)
    generator = torch.Generator().manual_seed(0)
    batch = {"image": torch.rand(4, 3, 32, 32, generator=generator) * 2 - 1}
    batch.update(plain.conditioner.ids(plain, PROMPTS * 2))
    loss, grad = _loss_and_grads(plain, batch)
    loss8, grad8 = _loss_and_grads(fp8, batch)
    assert loss8 != loss and loss8 == pytest.approx(loss, rel=0.02)
    assert torch.nn.functional.cosine_similarity(grad, grad8, dim=0) > 0.99


@pytest.mark.fit
def test_the_tiny_flux_recipe_trains_in_float8_and_exports_the_high_precision_pipeline(shapes_mds, tmp_path):
    """yamls/tiny-flux-cpu.yaml with model.fp8=true for 3 batches: the losses are finite, the weights
    moved, the checkpoint holds plain tensors, and `models.export` writes a FluxPipeline folder whose
    transformer (plain nn.Linear layers) is the checkpoint's weights, loaded in bf16 and sampling."""
    from diffusers import FluxPipeline

    from models import export
    from recipes import build_trainer, load_config

    overrides = [
        *tiny_run(shapes_mds, 3),
        f"trainer.save_folder={tmp_path / 'run'}",
        "trainer.save_filename=ckpt.pt",
        "scheduler.t_warmup=0ba",  # the recipe's warmup would train these batches at lr 0
        "+model.fp8=true",
    ]
    trainer = build_trainer(load_config(REPO / "yamls/tiny-flux-cpu.yaml", overrides))
    transformer = trainer.state.model.transformer
    assert any(isinstance(m, Float8Linear) for m in transformer.modules())
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    trainer.fit()
    trainer.close()
    assert all(torch.isfinite(v).all() for v in transformer.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in transformer.state_dict().items())

    checkpoint = tmp_path / "run" / "ckpt.pt"
    saved = torch.load(checkpoint, weights_only=False)["state"]["model"]
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in saved.values())
    export.main([str(checkpoint), str(tmp_path / "export"), "--raw"])
    pipe = FluxPipeline.from_pretrained(tmp_path / "export", dtype=torch.bfloat16, local_files_only=True)
    exported = pipe.transformer
    assert not any(isinstance(m, Float8Linear) for m in exported.modules())
    weights = exported.state_dict()
    for name, value in saved.items():
        if name.startswith("transformer."):
            key = name.removeprefix("transformer.")
            assert weights[key].dtype == torch.bfloat16 and torch.equal(weights[key], value.bfloat16()), key
    pipe.set_progress_bar_config(disable=True)
    image = pipe(PROMPTS[:1], num_inference_steps=2, height=32, width=32, output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_a_unet_preset_and_an_unknown_recipe_are_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="model.fp8 trains transformer presets; .tiny. is a UNet"):
        check_model_options("tiny", fp8=True)
    with pytest.raises(ValueError, match=r"model.fp8='delayed'; choose true \(= rowwise\), false or one of"):
        check_model_options("flux-tiny", fp8="delayed")
    check_model_options("flux-tiny", fp8="tensorwise")
    check_model_options("tiny", fp8=False)


def test_float8_is_emulated_without_cuda_and_refused_on_a_gpu_without_float8_tensor_cores(monkeypatch):
    """On this CPU machine: emulated. A GPU below sm_89 (an A100) is an error naming it; an H100 is not
    emulated (the CUDA calls answered as those GPUs would); a run on the CPU emulates on either."""
    assert emulated() is (not torch.cuda.is_available())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        RuntimeError, match="this GPU, NVIDIA A100-SXM4-80GB, is sm_80: train without model.fp8"
    ):
        emulated()
    with cpu_emulation():  # a CPU run (trainer.device cpu) on that machine: emulated, no error
        assert emulated() is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert emulated() is False
    with cpu_emulation():
        assert emulated() is True


@pytest.mark.subprocess
def test_importing_our_packages_imports_torchao_and_logs_nothing_of_it():
    """transformers and diffusers import torchao when it is installed; compat/torchao.py drops what
    torch 2.14 and diffusers 0.42.1 log about it (evaluation/ imports transformers before models/)."""
    script = "import sys, evaluation.evaluate, models.export; assert 'torchao' in sys.modules"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for text in ("register_constant", "Unable to import `torchao`"):
        assert text not in result.stderr, result.stderr[-2000:]
