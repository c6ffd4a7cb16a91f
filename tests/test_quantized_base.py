"""`model.base_weights` (models/training/base_weights.py): a LoRA run's frozen base stored in bf16, float8
or NF4 trains an fp32 adapter on the CPU, its diffusers file loads on the full-precision base pipeline,
the planner prices each choice, and what cannot be served is one line."""

import json
import logging

import pytest
import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora.torchao import TorchaoLoraLinear
from torchao.quantization import Float8Tensor, NF4Tensor

from models import build_model
from models.build import check_model_options
from models.export import export_pipeline
from models.registry import of
from models.training.base_weights import _quantize_linears, linear_bytes
from models.training.lora import save_lora
from tests.conftest import REPO
from tests.test_families import PROMPTS, SAMPLING, load_pipeline, pipeline_images

log = logging.getLogger(__name__)

# The stored type of a frozen linear weight, and the peft layer that wraps an adapted one.
STORED = {"bf16": (torch.Tensor, LoraLinear), "fp8": (Float8Tensor, TorchaoLoraLinear)}
STORED["nf4"] = (NF4Tensor, LoraLinear)
# Largest difference (pixels in [0, 1]) between the images of the stored-base model's own `generate` and
# those of its adapter file loaded on the fp32 base pipeline: the storage's own error, not the file's (on
# the fp32 base model the file samples exactly, atol 1e-5 below). Measured on 2026-11-29: tiny bf16
# 0.0084, flux-tiny bf16 0.0106, fp8 0.0294, nf4 0.1254 (toy widths: small NF4 scale groups); the bounds
# leave about 3x.
IMAGE_BOUND = {("tiny", "bf16"): 0.025, ("flux-tiny", "bf16"): 0.035, ("flux-tiny", "fp8"): 0.09}
IMAGE_BOUND[("flux-tiny", "nf4")] = 0.35


def _weight_bytes(weight) -> int:
    names, _ = weight.__tensor_flatten__()
    return sum(getattr(weight, n).nbytes for n in names)


@pytest.mark.parametrize("shape", [(1024, 3072), (64, 48)])  # FLUX.1's scale group of 256; a toy one
def test_the_planner_s_bytes_per_weight_are_the_stored_tensors(shape):
    """linear_bytes, which the planner adds up, is the bytes of torchao's tensors exactly."""
    for kind, tensor in (("fp8", Float8Tensor), ("nf4", NF4Tensor)):
        layer = torch.nn.Linear(shape[1], shape[0], bias=False).to(torch.bfloat16).requires_grad_(False)
        assert _quantize_linears(layer, kind) == (1, 0)
        assert isinstance(layer.weight, tensor)
        assert _weight_bytes(layer.weight) == linear_bytes(*shape, kind)
    assert linear_bytes(3072, 3072, "nf4") / 3072**2 == pytest.approx(0.51575, abs=1e-5)  # docs' figure


def test_a_stored_layer_keeps_for_the_backward_what_a_bf16_one_keeps():
    """torchao's float8 linear would save a bf16 copy of its weight (FrozenFloat8Linear saves the float8
    one); NF4's saves the 4-bit weight: the activations the planner counts are the same for all three."""

    def saved(kind: str) -> int:
        torch.manual_seed(0)
        layers = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        layers.to(torch.bfloat16).requires_grad_(False)
        if kind != "bf16":
            _quantize_linears(layers, kind)
        params = list(layers.parameters())
        sizes = []

        def pack(t):
            if not any(t is p or t._base is p for p in params):  # a parameter is no activation
                sizes.append(t.numel() * t.element_size())
            return t

        x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layers(x)
        out.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        return sum(sizes)

    assert saved("fp8") == saved("nf4") == saved("bf16")


def test_what_a_stored_base_cannot_serve_is_one_line():
    flux = dict(preset="flux-tiny", pretrained="base", pretrained_components=list(of("flux-tiny").components))
    unet = dict(
        preset="tiny", pretrained="base", pretrained_components=["unet", "vae", "text_encoder"], lora={}
    )
    lora = dict(flux, lora={})
    for match, options in [
        (r"=nf4 stores a LoRA run's frozen base.*set model.lora", dict(flux, base_weights="nf4")),
        (r"='int4'; choose one of \['bf16', 'fp8', 'nf4'\]", dict(lora, base_weights="int4")),
        (r"'tiny' \(family sd\) is a UNet.*use model.base_weights=bf16", dict(unet, base_weights="fp8")),
        (r"param_dtype=bfloat16 would cast it", dict(lora, base_weights="bf16", param_dtype="bfloat16")),
        (r"=fp8 with model.fp8", dict(lora, base_weights="fp8", fp8=True)),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match) as error:
            check_model_options(**options)
        assert str(error.value).startswith("model.base_weights=") and "\n" not in str(error.value)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Each tiny preset exported as a pipeline folder: a LoRA run's base (built once per preset)."""
    folders = {}

    def base(preset):
        if preset not in folders:
            torch.manual_seed(0)
            folders[preset] = export_pipeline(
                build_model(preset).eval(), tmp_path_factory.mktemp(preset) / "base"
            )
        return folders[preset]

    return base


def _build(preset, folder, **options):
    components = [name for name in of(preset).components if (folder / name).is_dir()]
    return build_model(
        preset, pretrained=str(folder), pretrained_components=components, lora={"rank": 4}, **options
    )


@pytest.mark.heavy
@pytest.mark.parametrize("case", list(IMAGE_BOUND), ids="-".join)
def test_a_stored_base_trains_an_fp32_adapter_whose_file_loads_on_the_full_base(case, bases, tmp_path):
    preset, kind = case
    folder = bases(preset)
    model = _build(preset, folder, base_weights=kind)
    family = of(preset)
    weight_type, lora_type = STORED[kind]
    denoiser = model.denoiser
    linears = [
        m.weight
        for m in denoiser.modules()
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and m.weight.numel() % 64 == 0
    ]
    assert linears and all(isinstance(w, weight_type) and w.dtype == torch.bfloat16 for w in linears)
    adapted = [m for m in denoiser.modules() if hasattr(m, "lora_A")]
    assert adapted and all(type(m) is lora_type for m in adapted)
    for name in family.components:  # the large encoders (flux-tiny's T5) are stored too, the CLIPs not
        stored = name == family.denoiser or name == "text_encoder_2" and preset == "flux-tiny"
        if isinstance(getattr(model, name, None), torch.nn.Module) and name != family.denoiser:
            assert (next(getattr(model, name).parameters()).dtype == torch.bfloat16) == stored, name

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    before = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=3e-2)
    torch.manual_seed(0)
    batch = {"image": torch.rand(2, 3, 32, 32) * 2 - 1, **model.conditioner.ids(model, PROMPTS)}
    for _ in range(3):
        optimizer.zero_grad()
        loss = model.loss(model(batch), batch)
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
    assert all(not torch.equal(before[n], p) for n, p in trainable.items() if "lora_B" in n)
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    assert state and all(v.dtype == torch.float32 for v in state)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)

    ours = model.eval().generate(PROMPTS, seed=3, **SAMPLING)
    save_lora(denoiser, tmp_path / "lora", family.pipeline, family.denoiser)
    pipe = load_pipeline(folder)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    theirs = pipeline_images(pipe, folder, seed=3)
    full = _build(preset, folder).eval()  # the fp32 base with this adapter: the file, exactly
    full.load_state_dict({n: p.detach() for n, p in trainable.items()}, strict=False)
    torch.testing.assert_close(theirs, full.generate(PROMPTS, seed=3, **SAMPLING), atol=1e-5, rtol=0)
    difference = (theirs - ours).abs().max().item()
    log.info("%s %s: largest image difference %.4f", preset, kind, difference)  # the bound's measure
    assert difference <= IMAGE_BOUND[case]


FLUX_BASE = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"]
PLAN_LORA = ["model.pretrained=/base", f"model.pretrained_components=[{','.join(FLUX_BASE)}]"]


@pytest.mark.heavy
def test_the_planner_prints_the_memory_of_each_base(capsys):
    """yamls/tiny-flux-cpu.yaml with an adapter on an nf4 base: its row, then bf16's, fp8's and fp32's
    (null), each smaller base by the frozen networks alone, and the line that names those that fit."""
    from recipes.plan import main

    args = [str(REPO / "yamls/tiny-flux-cpu.yaml"), "--gpus", "1", "--img-per-sec-per-gpu", "1"]
    args += [*PLAN_LORA, "+model.lora={rank: 4}", "+model.base_weights=nf4"]
    main(args)
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("GPUs  shard"))) + 1 :][:4]
    # GPUs, shard x replicate (3 words), microbatch, base: the run's own first, the others "(if)"
    assert [line.split()[5] for line in table] == ["nf4", "fp32", "bf16", "fp8"]
    assert ["(if)" in line for line in table] == [False, True, True, True]
    assert lines[-1].startswith(
        "at 1 GPUs, by model.base_weights (how this LoRA run stores its frozen base; its own: nf4)"
    )
    main([*args, "--json"])  # the same rows, to the byte
    memory = {m["base_weights"]: m for m in json.loads(capsys.readouterr().out)[0]["memory"]}
    frozen = {base: m["frozen"] for base, m in memory.items()}
    assert frozen["nf4"] < frozen["fp8"] < frozen["bf16"] < frozen[None]
    assert memory["nf4"]["total"] < memory["fp8"]["total"] < memory["bf16"]["total"]
    assert [m["alternative"] for m in memory.values()] == [False, True, True, True]


@pytest.mark.heavy
def test_the_flux_lora_recipe_planned_as_a_user_types_it_names_the_bases_that_fit_24_gb(capsys):
    """`python -m recipes.plan yamls/flux-lora.yaml --gpu-memory 24`: no throughput (the memory alone)
    and no --gpus (a global batch of 4 plans 1, 2 and 4 GPUs, not 8..256, which cannot split it)."""
    from recipes.plan import main

    with pytest.raises(SystemExit) as exit_:  # its own base, bf16, does not fit: status 1
        main([str(REPO / "yamls/flux-lora.yaml"), "--gpu-memory", "24"])
    out = capsys.readouterr().out
    assert exit_.value.code == 1 and "no throughput given: memory per GPU only" in out
    by_base = [line for line in out.splitlines() if line.startswith("at 1 GPUs, by model.base_weights")]
    assert len(by_base) == 1 and by_base[0].endswith("fit in 24 GB: fp8, nf4"), out
    assert "at 4 GPUs" in out and "error at" not in out


@pytest.mark.fit
def test_a_stored_base_run_exports_its_adapter_and_merges_into_the_full_base(shapes_mds, tmp_path, capsys):
    """yamls/tiny-flux-cpu.yaml on an nf4 base through train.py's path: its checkpoint records the base,
    `models.export --lora` writes the usual file (the base is not in it) and `--merge-lora` folds the
    adapter into the fp32 base of the folder, the pipeline the file gives on that base."""
    from models import export
    from models.export import load_model_from_checkpoint
    from recipes import load_config, train

    torch.manual_seed(0)
    base = export_pipeline(build_model("flux-tiny").eval(), tmp_path / "base")
    overrides = [
        f"data.train.local={shapes_mds / 'mds'}", "~data.train.prepare", f"model.pretrained={base}",
        f"model.pretrained_components=[{','.join(FLUX_BASE)}]", "+model.lora={rank: 4, alpha: 8}",
        "+model.base_weights=nf4", "optimizer.lr=3e-2", "trainer.max_duration=2ba",
        f"trainer.save_folder={tmp_path / 'ckpt'}", "callbacks.samples=null", "trainer.progress_bar=false",
    ]  # fmt: skip
    train(load_config(REPO / "yamls/tiny-flux-cpu.yaml", overrides))
    checkpoint = tmp_path / "ckpt" / "latest-rank0.pt"
    stored = load_model_from_checkpoint(checkpoint)
    assert stored.base_weights == "nf4" and isinstance(stored.transformer.proj_out.weight, NF4Tensor)
    export.main([str(checkpoint), str(tmp_path / "lora"), "--lora"])
    export.main([str(checkpoint), str(tmp_path / "merged"), "--merge-lora"])
    capsys.readouterr()
    pipe = load_pipeline(base)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="pytorch_lora_weights.safetensors")
    on_base = pipeline_images(pipe, base, seed=3)
    merged = tmp_path / "merged"
    merged_images = pipeline_images(load_pipeline(merged), merged, seed=3)
    torch.testing.assert_close(merged_images, on_base, atol=1e-3, rtol=0)  # fused or not: 1.4e-4 measured
    ours = stored.generate(PROMPTS, seed=3, **SAMPLING)
    assert (ours - on_base).abs().max() <= IMAGE_BOUND[("flux-tiny", "nf4")]
