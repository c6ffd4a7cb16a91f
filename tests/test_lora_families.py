"""`model.lora` on every family (issue 51): on the layers diffusers' own LoRA scripts train for it
(models/registry.py `lora_targets`), the base loaded from a pipeline folder, only the adapter trains;
its diffusers file, written with the family pipeline's own save_lora_weights, loads with that
pipeline's load_lora_weights and samples the image `generate` samples from the adapted model, and the
merged export the same. The SD UNet's whole path through Composer and models.export: tests/test_lora.py."""

from pathlib import Path

import pytest
import torch

from models import build_model
from models.export import export_pipeline
from models.registry import of
from models.training.lora import base_components, merge_lora, save_lora
from tests.test_families import FAMILIES, PROMPTS, SAMPLING, load_pipeline, pipeline_images

pytestmark = pytest.mark.heavy


@pytest.fixture(scope="module", params=list(FAMILIES.values()), ids=list(FAMILIES))
def adapted(request, tmp_path_factory):
    """(base folder, the model with a trained adapter): a tiny preset exported as its pipeline, loaded
    back as a LoRA run's base, and two optimizer steps of its loss."""
    preset = request.param
    root = tmp_path_factory.mktemp(f"lora-{preset}")
    torch.manual_seed(0)
    base = export_pipeline(build_model(preset).eval(), root / "base")
    components = [name for name in of(preset).components if (base / name).is_dir()]
    model = build_model(preset, pretrained=str(base), pretrained_components=components, lora={"rank": 4})
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=3e-2)
    batch = {"image": torch.rand(2, 3, 32, 32) * 2 - 1, **model.conditioner.ids(model, PROMPTS)}
    for _ in range(2):
        optimizer.zero_grad()
        model.loss(model(batch), batch).backward()
        optimizer.step()
    return preset, base, model.eval()


def test_only_the_family_s_target_layers_train(adapted):
    preset, _, model = adapted
    targets = of(preset).lora_targets
    adapted_layers = {n.rsplit(".lora_", 1)[0] for n, p in model.denoiser.named_parameters() if "lora_" in n}
    assert adapted_layers and all(any(n.endswith(t) for t in targets) for n in adapted_layers)
    assert {t for t in targets if any(n.endswith(t) for n in adapted_layers)} == set(targets)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_its_diffusers_file_and_merged_export_sample_generate_s_image(adapted, tmp_path):
    preset, base, model = adapted
    expected = model.generate(PROMPTS, seed=3, **SAMPLING)
    family = of(preset)
    save_lora(model.denoiser, tmp_path / "lora", family.pipeline, family.denoiser)
    pipe = load_pipeline(base)
    before = pipeline_images(pipe, base, seed=3)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    torch.testing.assert_close(pipeline_images(pipe, base, seed=3), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(before, expected, atol=1e-3)  # the adapter changes the images

    merge_lora(model.denoiser)
    merged = export_pipeline(model, tmp_path / "merged")
    assert not any("lora" in k for k in load_pipeline(merged).components[family.denoiser].state_dict())
    torch.testing.assert_close(
        pipeline_images(load_pipeline(merged), merged, seed=3), expected, atol=1e-4, rtol=0
    )


def test_a_base_without_a_network_the_checkpoint_will_not_hold_is_refused():
    needed = base_components("flux-tiny")
    assert needed == ["transformer", "vae", "text_encoder", "text_encoder_2"]
    with pytest.raises(ValueError, match=r"load \['transformer', 'vae', 'text_encoder', 'text_encoder_2'\]"):
        build_model("flux-tiny", pretrained=str(Path("base")), pretrained_components=["transformer"], lora={})


@pytest.mark.fit
def test_a_flux_lora_run_exports_with_the_cli_and_its_file_loads_in_flux_pipeline(shapes_mds, tmp_path):
    """The user's path on a transformer family: yamls/tiny-flux-cpu.yaml with model.lora on a FLUX
    folder, `models.export --lora` and `--merge-lora` of its checkpoint (the record's flow options
    rebuild it: a DDPM option given to a flow preset was refused)."""
    from models import export
    from models.export import load_model_from_checkpoint
    from recipes import load_config, train
    from tests.conftest import REPO

    torch.manual_seed(0)
    base = export_pipeline(build_model("flux-tiny").eval(), tmp_path / "base")
    components = [name for name in of("flux-tiny").components if (base / name).is_dir()]
    overrides = [
        f"data.train.local={shapes_mds / 'mds'}", "~data.train.prepare", f"model.pretrained={base}",
        f"model.pretrained_components=[{','.join(components)}]", "+model.lora={rank: 4, alpha: 8}",
        "optimizer.lr=3e-2", "trainer.max_duration=2ba", f"trainer.save_folder={tmp_path / 'ckpt'}",
        "callbacks.samples=null", "trainer.progress_bar=false",
    ]  # fmt: skip
    train(load_config(REPO / "yamls/tiny-flux-cpu.yaml", overrides))
    checkpoint = tmp_path / "ckpt" / "latest-rank0.pt"
    expected = load_model_from_checkpoint(checkpoint).generate(PROMPTS, seed=3, **SAMPLING)
    export.main([str(checkpoint), str(tmp_path / "lora"), "--lora"])
    pipe = load_pipeline(base)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    torch.testing.assert_close(pipeline_images(pipe, base, seed=3), expected, atol=1e-5, rtol=0)
    export.main([str(checkpoint), str(tmp_path / "merged"), "--merge-lora"])
    merged = tmp_path / "merged"
    torch.testing.assert_close(
        pipeline_images(load_pipeline(merged), merged, seed=3), expected, atol=1e-4, rtol=0
    )
