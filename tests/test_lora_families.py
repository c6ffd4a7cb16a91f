"""`model.lora` on every family (issue 51): on the layers diffusers' own LoRA scripts train for it
(models/registry.py `lora_targets`), the base loaded from a pipeline folder, only the adapter trains;
its diffusers file, written with the family pipeline's own save_lora_weights, loads with that
pipeline's load_lora_weights and samples the image `generate` samples from the adapted model, and the
merged export the same. The SD UNet's whole path through Composer and models.export: tests/test_lora.py."""

import dataclasses
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from models import build_model
from models.checkpoints.checkpoint_file import LORA_FILE
from models.export import export_pipeline
from models.registry import PRESETS, of
from models.training.lora import add_lora, base_components, merge_lora, save_lora
from models.training.lora_layouts import LayoutCheckError, adapter, kohya_file, save_kohya
from tests.test_families import FAMILIES, PROMPTS, SAMPLING, load_pipeline, pipeline_images

pytestmark = pytest.mark.heavy

# Why a family's tiny preset gets no kohya file (models.export says it; the others get one).
NO_KOHYA = {
    "mmdit": "the mmdit family has no kohya layout that diffusers reads back",  # no SD3 reader in diffusers
    "flux": "diffusers splits a single block's fused linear1 at FLUX.1's widths",  # flux-tiny is 64 wide
}
# Families whose kohya reader drops a module it does not know, with a warning, rather than failing: a
# foreign module reads back as the adapter (diffusers 0.42.1 lora_conversion_utils.py:2774-2776, FLUX.2's).
DROPS_FOREIGN = ("flux2",)


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
    diffusers_layout = pipeline_images(pipe, base, seed=3)
    torch.testing.assert_close(diffusers_layout, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(before, expected, atol=1e-3)  # the adapter changes the images

    # The kohya / ComfyUI layout, beside it: the same images through diffusers' converter.
    kohya, why_not = save_kohya(model.denoiser, tmp_path / "lora", family, "lora")
    if family.name in NO_KOHYA:
        assert kohya is None and why_not.startswith(NO_KOHYA[family.name])
    else:
        assert kohya == tmp_path / "lora" / "lora_kohya.safetensors" and why_not is None
        pipe.unload_lora_weights()
        pipe.load_lora_weights(kohya)
        torch.testing.assert_close(pipeline_images(pipe, base, seed=3), diffusers_layout, atol=1e-5, rtol=0)
        _refuses_what_differs(model.denoiser, family, tmp_path / "refused")

    merge_lora(model.denoiser)
    merged = export_pipeline(model, tmp_path / "merged")
    assert not any("lora" in k for k in load_pipeline(merged).components[family.denoiser].state_dict())
    torch.testing.assert_close(
        pipeline_images(load_pipeline(merged), merged, seed=3), expected, atol=1e-4, rtol=0
    )


def _refuses_what_differs(denoiser, family, folder: Path) -> None:
    """A kohya file that diffusers reads back other than the adapter (one tensor off, the alphas
    another scale, a module the adapter has not) is refused with one line and leaves no file."""
    folder.mkdir()

    def one_up_off(tensors):
        name = next(k for k in sorted(tensors) if k.endswith(".lora_up.weight"))
        return {**tensors, name: tensors[name] + 1e-3}

    def alphas_doubled(tensors):
        return {k: t * 2 if k.endswith(".alpha") else t for k, t in tensors.items()}

    def foreign_module(tensors):
        name = next(k for k in sorted(tensors) if k.endswith(".lora_down.weight")).split(".")[0]
        extra = {
            k.replace(name, f"{name}_foreign"): t for k, t in tensors.items() if k.startswith(name + ".")
        }
        return {**tensors, **extra}

    corruptions = (one_up_off, alphas_doubled) + (() if family.name in DROPS_FOREIGN else (foreign_module,))
    for corrupt in corruptions:
        corrupted = dataclasses.replace(
            family,
            lora_kohya=lambda state, alpha, model, corrupt=corrupt: corrupt(
                family.lora_kohya(state, alpha, model)
            ),
        )
        with pytest.raises(LayoutCheckError) as refused:
            save_kohya(denoiser, folder, corrupted, "bad")
        assert str(refused.value).startswith(f"{kohya_file('bad')} (kohya layout) was not written: ")
        assert "\n" not in str(refused.value), corrupt.__name__
        assert not list(folder.iterdir()), corrupt.__name__  # nor its temporary file


def test_a_run_starts_from_its_lora_files_and_refuses_another_family_s_or_rank(adapted, tmp_path):
    """`model.lora.init_from`: the adapter a run starts with is the file's (diffusers' layout, a folder
    holding it, and the kohya layout where the family has one), tensor for tensor; a file of another
    rank, or another family's, is one line naming the key."""
    preset, base, _ = adapted  # the fixture's model: another test merges its adapter away
    family = of(preset)
    components = [name for name in family.components if (base / name).is_dir()]

    def started(init_from=None, rank=4):
        lora = {"rank": rank} if init_from is None else {"rank": rank, "init_from": str(init_from)}
        return build_model(preset, pretrained=str(base), pretrained_components=components, lora=lora)

    model, generator = started(), torch.Generator().manual_seed(0)
    with torch.no_grad():  # an adapter of random values (its lora_B starts at zero)
        for name, p in model.denoiser.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    trained = adapter(model.denoiser)[0]
    save_lora(model.denoiser, tmp_path / "lora", family.pipeline, family.denoiser)
    kohya, _ = save_kohya(model.denoiser, tmp_path / "lora", family, "lora")

    for source in [tmp_path / "lora", tmp_path / "lora" / LORA_FILE, kohya][: 3 if kohya else 2]:
        fresh = started(source)
        assert "init_from" not in fresh.lora  # the record's: an export never looks for the file
        got = adapter(fresh.denoiser)[0]
        assert got.keys() == trained.keys()
        for name, value in trained.items():  # kohya's folded scale is a power of 2: exact too
            assert torch.equal(got[name], value), (source.name, name)
    with pytest.raises(ValueError, match=r"^model.lora.init_from=.*: a rank 4 LoRA; model.lora.rank is 8$"):
        started(tmp_path / "lora", rank=8)

    other = "sdxl-tiny" if preset == "tiny" else "tiny"  # another family's LoRA, as its pipeline saves it
    stranger = build_model(other)
    add_lora(stranger.denoiser, rank=4, alpha=4.0, target_modules=list(of(other).lora_targets), dropout=0.0)
    save_lora(stranger.denoiser, tmp_path / "other", of(other).pipeline, of(other).denoiser)
    with pytest.raises(ValueError, match=r"^model.lora.init_from=") as refused:
        started(tmp_path / "other")
    assert "\n" not in str(refused.value)


def _filled(module: torch.nn.Module) -> torch.nn.Module:
    """A meta-device `module` with weights: matrices of uniform values of a layer's scale, 1/sqrt(fan
    in), biases zero, norms one. Row i is the window at 61 i of one random pool (drawing FLUX.1 widths'
    180 M numbers takes seconds of a CPU; one pass over them a fraction of that)."""
    pool = torch.rand(1_000_003, generator=torch.Generator().manual_seed(0)) * 2 - 1
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() < 2:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                rows = pool.as_strided((p.shape[0], p[0].numel()), (61, 1))
                torch.mul(rows, p[0].numel() ** -0.5, out=p.view(p.shape[0], -1))
    return module


def test_the_flux_kohya_layout_at_flux_1_widths(tmp_path):
    """FLUX.1's widths, which flux-tiny lacks (diffusers' converter splits a single block's fused
    linear1 at 3072 x 3 + 12288 only): a transformer of one single block of them samples, in the tiny
    FluxPipeline, the same images from its kohya file as from the adapter and from diffusers' file, and a
    kohya file that differs is refused; every one of FLUX.1-schnell's 19 + 38 blocks' adapters comes back
    from its kohya file exactly, alpha / r (1/3 here) folded into the weights as diffusers folds it."""
    family = of("flux-tiny")
    model = build_model("flux-tiny")
    wide = dict(num_attention_heads=24, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(
            dict(model.transformer.config, num_layers=0, num_single_layers=1, **wide)
        )
    _filled(transformer)
    add_lora(transformer, rank=4, alpha=8.0, target_modules=family.lora_targets, dropout=0.0)
    torch.manual_seed(0)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(std=0.02)
    save_lora(transformer, tmp_path, FluxPipeline, "transformer")
    kohya, why_not = save_kohya(transformer, tmp_path, family, "wide")
    assert why_not is None
    _refuses_what_differs(transformer, family, tmp_path / "refused")
    parts = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    scheduler = model.sampling_scheduler(model.native_size())
    pipe = FluxPipeline(scheduler=scheduler, transformer=transformer, **{k: getattr(model, k) for k in parts})
    pipe.set_progress_bar_config(disable=True)
    call = dict(
        height=32, width=32, max_sequence_length=model.t5_tokens, num_inference_steps=2, guidance_scale=0.0
    )

    def images():
        return pipe(PROMPTS, generator=torch.Generator().manual_seed(3), output_type="pt", **call).images

    ours = images()
    transformer.delete_adapters(["default"])
    pipe.load_lora_weights(kohya)
    torch.testing.assert_close(images(), ours, atol=1e-5, rtol=0)
    pipe.unload_lora_weights()
    assert not torch.allclose(images(), ours, atol=1e-4)  # the adapter changes the images
    pipe.load_lora_weights(tmp_path, weight_name="pytorch_lora_weights.safetensors")
    torch.testing.assert_close(images(), ours, atol=1e-5, rtol=0)

    with torch.device("meta"):
        schnell = FluxTransformer2DModel(**PRESETS["flux-schnell"]["transformer"])
    add_lora(schnell, rank=3, alpha=1.0, target_modules=family.lora_targets, dropout=0.0)
    for name, module in schnell.named_modules():
        if name.endswith(("lora_A.default", "lora_B.default")):
            module.weight = torch.nn.Parameter(torch.randn(module.weight.shape))
    written, why_not = save_kohya(schnell, tmp_path / "schnell", family, "schnell")
    assert why_not is None and written.is_file()


def test_a_base_without_a_network_the_checkpoint_will_not_hold_is_refused():
    needed = base_components("flux-tiny")
    assert needed == ["transformer", "vae", "text_encoder", "text_encoder_2"]
    with pytest.raises(ValueError, match=r"load \['transformer', 'vae', 'text_encoder', 'text_encoder_2'\]"):
        build_model("flux-tiny", pretrained=str(Path("base")), pretrained_components=["transformer"], lora={})


@pytest.mark.fit
def test_a_flux_lora_run_exports_with_the_cli_and_its_file_loads_in_flux_pipeline(
    shapes_mds, tmp_path, capsys
):
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
    assert f"no kohya / ComfyUI file: {NO_KOHYA['flux']}" in capsys.readouterr().out  # flux-tiny's widths
    assert [p.name for p in (tmp_path / "lora").iterdir()] == ["pytorch_lora_weights.safetensors"]
    pipe = load_pipeline(base)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    torch.testing.assert_close(pipeline_images(pipe, base, seed=3), expected, atol=1e-5, rtol=0)
    export.main([str(checkpoint), str(tmp_path / "merged"), "--merge-lora"])
    merged = tmp_path / "merged"
    torch.testing.assert_close(
        pipeline_images(load_pipeline(merged), merged, seed=3), expected, atol=1e-4, rtol=0
    )
