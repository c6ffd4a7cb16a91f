"""The scaling planner against the published SD2 base figures (mosaicml/diffusion README)."""

import json
import runpy
import sys

import pytest

from recipes.config import ConfigError
from recipes.plan import ROW_KEYS, build_parser, images_to_see, main, plan_rows, write_throughput
from tests.conftest import REPO

GPUS = [8, 16, 32, 64, 128, 256]
# SD2 base at 256 px with precomputed latents: 1,100 img/s on 8 A100s, $2 per A100-hour.
IMG_PER_SEC_PER_GPU = 1100 / 8  # 137.5

SD2_BASE_256 = """\
run_name: sd2-base-256
global_train_batch_size: 2048
model: {preset: sd2-base}
data:
  train: {local: /nonexistent/laion, resolution: 256}
optimizer: {_target_: torch.optim.AdamW, lr: 1.0e-4}
trainer:
  device: gpu
  max_duration: 550000ba
  device_train_microbatch_size: 16
"""


@pytest.fixture
def sd2_yaml(tmp_path):
    path = tmp_path / "sd2-base-256.yaml"
    path.write_text(SD2_BASE_256)
    return path


def _cost_table(out: str) -> list[list[str]]:
    """The cells of the cost table's lines (the memory table follows it after a blank line)."""
    lines = out.split("\n\n")[1].splitlines()
    assert lines[0].split()[:2] == ["GPUs", "per-device"]
    return [line.split() for line in lines[1:]]


def _run_json(capsys, yaml, *args) -> list[dict]:
    main([str(yaml), "--gpus", *map(str, GPUS), "--json", *args])
    return json.loads(capsys.readouterr().out)


@pytest.mark.heavy
def test_sd2_base_numbers_for_8_to_256_gpus(sd2_yaml, capsys):
    rows = _run_json(capsys, sd2_yaml, "--img-per-sec-per-gpu", str(IMG_PER_SEC_PER_GPU))
    images = 550_000 * 2048
    for row, gpus in zip(rows, GPUS, strict=True):
        seconds = images / (IMG_PER_SEC_PER_GPU * gpus)
        assert row["gpus"] == gpus
        assert row["images"] == images
        assert row["days"] == pytest.approx(seconds / 86400)
        assert row["gpu_hours"] == pytest.approx(seconds / 3600 * gpus)
        assert row["cost"] == pytest.approx(seconds / 3600 * gpus * 2.0)  # default $2/GPU-hour
        assert row["per_device_batch"] == 2048 // gpus
    # By hand for 8 A100s: 1,126,400,000 images / 1,100 img/s = 1,024,000 s = 11.85 days;
    # x 8 GPUs = 8,192,000 GPU-s = 2,275.56 GPU-hours = $4,551.11.
    eight = rows[0]
    assert eight["images"] == 1_126_400_000
    assert eight["days"] == pytest.approx(11.85, abs=0.005)
    assert eight["gpu_hours"] == pytest.approx(2275.56, abs=0.005)
    assert eight["cost"] == pytest.approx(4551.11, abs=0.005)
    assert (eight["microbatch"], eight["grad_accum"]) == (16, 16)
    # 256 A100s: 32,000 s = 8.9 hours, same GPU-hours (linear scaling).
    assert rows[-1]["days"] * 24 == pytest.approx(8.89, abs=0.005)


@pytest.mark.heavy
def test_json_rows_have_exactly_the_keys_and_the_microbatch_each_count_uses(sd2_yaml, capsys):
    rows = _run_json(capsys, sd2_yaml, "--img-per-sec-per-gpu", "137.5")
    assert all(list(row) == ROW_KEYS for row in rows)
    # The YAML's 16 is a cap: 2048 / 256 = 8 per device runs as one microbatch of 8.
    assert [row["microbatch"] for row in rows] == [16, 16, 16, 16, 16, 8]
    assert [row["grad_accum"] for row in rows] == [16, 8, 4, 2, 1, 1]


@pytest.mark.heavy
def test_the_sd2_base_recipe_plans_on_8_to_256_gpus_unchanged(capsys):
    """The issue's command, on the real recipe: no error row and exit status 0, with the microbatch
    each count uses (sd2-base's cap of 32)."""
    main([str(REPO / "yamls/sd2-base.yaml"), "--gpus", *map(str, GPUS), "--img-per-sec-per-gpu", "137.5"])
    out = capsys.readouterr().out
    assert "error" not in out
    table = {row[0]: row[1:4] for row in _cost_table(out)}
    assert table == {
        "8": ["256", "32", "8"],
        "16": ["128", "32", "4"],
        "32": ["64", "32", "2"],
        "64": ["32", "32", "1"],
        "128": ["16", "16", "1"],
        "256": ["8", "8", "1"],
    }
    assert "microbatch: at most 32 (trainer.device_train_microbatch_size)" in out


@pytest.mark.heavy
def test_the_sdxl_base_recipe_plans_on_8_to_256_gpus(capsys):
    """SDXL's recipe (global batch 2048, microbatch cap 4) on 8-256 GPUs: no error row."""
    main([str(REPO / "yamls/sdxl-base.yaml"), "--gpus", *map(str, GPUS), "--img-per-sec-per-gpu", "10"])
    out = capsys.readouterr().out
    assert "error" not in out
    table = {row[0]: row[1:4] for row in _cost_table(out)}
    assert table == {str(n): [str(2048 // n), "4", str(2048 // n // 4)] for n in GPUS}


@pytest.mark.heavy
def test_the_sd3_medium_recipe_plans_on_8_to_256_gpus(capsys):
    main([str(REPO / "yamls/sd3-medium.yaml"), "--gpus", *map(str, GPUS), "--img-per-sec-per-gpu", "50"])
    out = capsys.readouterr().out
    assert "error" not in out and [row[0] for row in _cost_table(out)] == [str(n) for n in GPUS]


@pytest.mark.parametrize("recipe, preset", [("sdxl-base", "sdxl-base"), ("sd3-medium", "sd3-medium")])
@pytest.mark.heavy
def test_a_rate_not_measured_on_the_preset_is_noted_above_the_table(recipe, preset, tmp_path, capsys):
    """Planning sdxl-base or sd3-medium with SD2's published rate (the flag), or with a throughput
    file bench/throughput.py wrote for sd2-base, says so above the table: no rate of theirs is
    measured here. sd2-base with the flag, or a file measured on the run's own preset, gets none."""
    yaml = str(REPO / f"yamls/{recipe}.yaml")
    main([yaml, "--gpus", "8", "--img-per-sec-per-gpu", "137.5"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{yaml}: preset {preset}, global batch ")
    assert out[2] == (
        f"note: 137.5 img/s per GPU is used for {preset} as given; this repo has measured only sd2-base's "
        "rate (137.5 img/s per A100 published, the H100 figures in docs/benchmarks.md), so a rate taken from "
        f"those is SD2's, not {preset}'s: measure {preset} with bench/throughput.py"
    )
    sd2 = tmp_path / "throughput-256.json"
    write_throughput(sd2, 361.8, resolution=256, device="1x H100", recipe=str(REPO / "yamls/sd2-base.yaml"))
    main([yaml, "--gpus", "8", "--throughput-file", str(sd2)])
    out = capsys.readouterr().out.splitlines()
    assert f"(from {sd2}, measured on preset sd2-base)" in out[1]  # read from the file's recipe
    assert out[2] == (
        f"note: the rate was measured on preset sd2-base ({sd2}), not {preset}: the days and cost below "
        f"are sd2-base's rate applied to {preset}; measure {preset} with bench/throughput.py for its own"
    )
    own = tmp_path / "own.json"
    write_throughput(own, 20.0, resolution=256, device="1x H100", preset=preset)
    main([yaml, "--gpus", "8", "--throughput-file", str(own)])
    assert "note:" not in capsys.readouterr().out
    main([str(REPO / "yamls/sd2-base.yaml"), "--gpus", "8", "--img-per-sec-per-gpu", "137.5"])
    assert "note:" not in capsys.readouterr().out


@pytest.mark.heavy
def test_the_note_goes_to_the_log_with_json(capsys, caplog):
    main([str(REPO / "yamls/sdxl-base.yaml"), "--gpus", "8", "--json", "--img-per-sec-per-gpu", "137.5"])
    assert json.loads(capsys.readouterr().out)[0]["gpus"] == 8  # stdout stays JSON
    assert "note: 137.5 img/s per GPU is used for sdxl-base as given" in caplog.text


def test_an_error_row_has_no_days_or_cost_and_the_planner_exits_1(sd2_yaml, capsys):
    args = [str(sd2_yaml), "--img-per-sec-per-gpu", "137.5", "--gpus", "8", "24"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    lines = capsys.readouterr().out.splitlines()
    assert next(line for line in lines if line.lstrip().startswith("24 ")).split() == [
        "24",
        "-",
        "-",
        "error",
        "1,126,400,000",
        "-",
        "-",
        "-",
    ]
    error = "error at 24 GPUs: global_train_batch_size=2048 is not divisible by the world size 24"
    assert any(line.startswith(error) for line in lines)
    memory = lines[next(i for i, line in enumerate(lines) if line.startswith("memory per GPU")) + 2 :]
    assert [line.split()[0] for line in memory] == ["8"]  # no memory for a run that does not exist
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--json"])
    assert exit_.value.code == 1
    eight, twenty_four = json.loads(capsys.readouterr().out)
    assert "error" not in eight and eight["days"] > 0
    assert [twenty_four[k] for k in ("per_device_batch", "microbatch", "days", "gpu_hours", "cost")] == [
        None
    ] * 5
    assert twenty_four["memory"] == [] and len(eight["memory"]) == 1


def test_microbatch_flag_and_trailing_overrides(sd2_yaml, capsys):
    rows = _run_json(capsys, sd2_yaml, "--img-per-sec-per-gpu", "137.5", "--microbatch", "8")
    assert all("error" not in row for row in rows)
    assert [row["grad_accum"] for row in rows] == [32, 16, 8, 4, 2, 1]
    # Overrides may follow --gpus, as after train.py's YAML.
    main(
        [
            str(sd2_yaml),
            "--img-per-sec-per-gpu",
            "137.5",
            "--json",
            "--gpus",
            "8",
            "global_train_batch_size=1024",
        ]
    )
    (eight,) = json.loads(capsys.readouterr().out)
    assert (eight["images"], eight["per_device_batch"], eight["grad_accum"]) == (550_000 * 1024, 128, 8)


def test_published_two_stage_cost_is_about_31k():
    # The README's whole run: 550k batches at 256 px (1,100 img/s on 8 A100s) then 850k at 512 px
    # (290 img/s), 2.87B images, "about $31k" at $2/A100-hour.
    stage_256 = plan_rows(2048, "550000ba", 16, [8], 1100 / 8, 2.0)[0]
    stage_512 = plan_rows(2048, "850000ba", 16, [8], 290 / 8, 2.0)[0]
    assert stage_256["images"] + stage_512["images"] == pytest.approx(2.87e9, rel=0.001)
    assert stage_256["cost"] + stage_512["cost"] == pytest.approx(31_000, rel=0.01)


def test_max_duration_units():
    assert images_to_see("550000ba", 2048) == 1_126_400_000
    assert images_to_see("1000sp", 2048) == 1000
    for duration in ("3ep", 3, None):  # epochs need the dataset size, which the config does not give
        with pytest.raises(ConfigError, match="needs it in batches"):
            images_to_see(duration, 2048)


def test_throughput_file_and_resolution_check(sd2_yaml, tmp_path, capsys, caplog):
    measured = tmp_path / "throughput.json"
    write_throughput(measured, 137.5, resolution=512, device="8x A100-40GB", gpus=8)
    assert json.loads(measured.read_text())["img_per_sec_per_gpu"] == 137.5
    from_file = _run_json(capsys, sd2_yaml, "--throughput-file", str(measured))
    from_flag = _run_json(capsys, sd2_yaml, "--img-per-sec-per-gpu", "137.5")
    assert from_file == from_flag
    assert "measured at 512 px but data.train.resolution is 256 px" in caplog.text


def test_without_a_throughput_the_plan_is_the_memory_and_what_needs_one_refuses(sd2_yaml, tmp_path, capsys):
    main([str(sd2_yaml), "--gpus", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert "no throughput given: memory per GPU only; for days and cost pass --img-per-sec-per-gpu" in out
    assert "memory per GPU in GB" in out and "GPU-hours" not in out
    rows = _run_json(capsys, sd2_yaml)
    assert all(row["days"] is None and row["cost"] is None and row["memory"] for row in rows)
    with pytest.raises(SystemExit) as exit_:
        main([str(sd2_yaml), "--gpus", "8", "--plot", str(tmp_path / "p.png")])
    assert exit_.value.code == 2 and "--plot needs a throughput: pass" in capsys.readouterr().err


def test_a_bad_throughput_fails_clearly(sd2_yaml, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"resolution": 256}')
    with pytest.raises(SystemExit, match="needs a positive 'img_per_sec_per_gpu'"):
        main([str(sd2_yaml), "--throughput-file", str(bad)])
    with pytest.raises(SystemExit, match="unknown config key 'trainer.max_durations'"):
        main([str(sd2_yaml), "--img-per-sec-per-gpu", "1", "trainer.max_durations=1ba"])


POSITIVE = "must be a positive, finite number of"
WHOLE = "must be a whole number of"
# Every number the planner takes on its command line, with values that are no such number (issue 47):
# (flag, value, what the error says after "argument FLAG: ").
BAD_NUMBERS = [
    *[("--img-per-sec-per-gpu", v, f"{POSITIVE} images/s per GPU, got {v}") for v in ("nan", "inf", "-inf")],
    *[
        ("--img-per-sec-per-gpu", v, f"{POSITIVE} images/s per GPU, got {v}")
        for v in ("-1", "0", "-1e3", "x")
    ],
    *[("--price-per-gpu-hour", v, f"{POSITIVE} $ per GPU-hour, got {v}") for v in ("nan", "inf", "-inf")],
    *[("--price-per-gpu-hour", v, f"{POSITIVE} $ per GPU-hour, got {v}") for v in ("-2", "0")],
    *[("--gpu-memory", v, f"{POSITIVE} GB, got {v}") for v in ("nan", "inf", "-inf", "-80", "0")],
    *[("--gpus", v, f"{WHOLE} GPUs, at least 1, got {v}") for v in ("nan", "inf", "-inf", "0", "-8", "1.5")],
    *[("--shard", v, f"{WHOLE} GPUs, at least 1, got {v}") for v in ("nan", "inf", "0", "-2")],
    *[("--gpus-per-node", v, f"{WHOLE} GPUs, at least 1, got {v}") for v in ("nan", "-inf", "0")],
    *[("--per-gpu-batch", v, f"{WHOLE} samples per GPU, at least 1, got {v}") for v in ("nan", "inf", "0")],
    *[
        ("--microbatch", v, f"must be auto or a whole number of samples, at least 1, got {v}")
        for v in ("nan", "0")
    ],
]


@pytest.mark.parametrize("flag, value, says", BAD_NUMBERS, ids=[f"{f} {v}" for f, v, _ in BAD_NUMBERS])
def test_a_number_that_is_no_number_is_an_argparse_error_naming_flag_and_value(
    flag, value, says, sd2_yaml, capsys
):
    """`--flag nan` and the like: exit 2 with argparse's one error line, before the YAML is read, where
    they gave a traceback or a plan of "0.00 days, $0"."""
    rate = [] if flag == "--img-per-sec-per-gpu" else ["--img-per-sec-per-gpu", "137.5"]
    with pytest.raises(SystemExit) as exit_:
        main([str(sd2_yaml), *rate, flag, value])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.splitlines()[-1] == f"python -m recipes.plan: error: argument {flag}: {says}"
    assert "Traceback" not in err


def test_a_negative_number_among_several_values_is_its_flag_s_error(sd2_yaml, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(sd2_yaml), "--img-per-sec-per-gpu", "137.5", "--gpus", "8", "16", "-inf"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m recipes.plan: error: argument --gpus: {WHOLE} GPUs, at least 1, got -inf"
    )


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_throughput_file_of_no_number_is_a_config_error(value, sd2_yaml, tmp_path, capsys):
    path = tmp_path / "throughput.json"
    path.write_text(f'{{"img_per_sec_per_gpu": {value}}}')  # what Python's json writes for nan and inf
    with pytest.raises(SystemExit) as exit_:
        main([str(sd2_yaml), "--throughput-file", str(path)])
    assert (
        exit_.value.code
        == f"config error: throughput file {path} needs a positive 'img_per_sec_per_gpu', got "
        + ({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[value])
    )


def test_help_states_the_linear_scaling_assumption():
    assert "linear scaling" in " ".join(build_parser().format_help().split())


def test_plot_writes_a_png(sd2_yaml, tmp_path, capsys):
    png = tmp_path / "plan.png"
    _run_json(capsys, sd2_yaml, "--img-per-sec-per-gpu", "137.5", "--plot", str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, harmless
def test_cli_prints_the_table(sd2_yaml, capsys, monkeypatch):
    # The module's real entry point (`python -m recipes.plan ...`), run in this process.
    args = [
        str(sd2_yaml),
        "--gpus",
        *map(str, GPUS),
        "--img-per-sec-per-gpu",
        "137.5",
        "--price-per-gpu-hour",
        "2",
    ]
    monkeypatch.setattr(sys, "argv", ["recipes.plan", *args])
    runpy.run_module("recipes.plan", run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert "GPUs  per-device batch  microbatch  grad accum" in out
    assert "assumes linear scaling" in out
    eight = next(line.split() for line in out.splitlines() if line.lstrip().startswith("8 "))
    assert eight == ["8", "256", "16", "16", "1,126,400,000", "11.85", "2,275.6", "$4,551"]
    last = next(line.split() for line in out.splitlines() if line.lstrip().startswith("256 "))
    assert last == ["256", "8", "8", "1", "1,126,400,000", "0.37", "2,275.6", "$4,551"]


@pytest.mark.fit
def test_throughput_benchmark_writes_what_the_planner_reads(shapes_mds, tmp_path, monkeypatch, capsys):
    """bench/throughput.py trains the sd2-base recipe's wiring (tiny preset, CPU) a few batches and
    writes a file the planner then uses; its rate is the measured one, not a constant. Both run
    through their real entry points, in this process."""
    out = tmp_path / "throughput.json"
    overrides = [
        "model.preset=tiny",
        "~model.pretrained_components",
        "~model.low_precision_norms",
        "global_train_batch_size=8",
        "trainer.device_train_microbatch_size=8",
        "data.train.resolution=32",
        "data.train.num_workers=0",
        "data.train.num_canonical_nodes=1",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "_step=eager",  # the recipe's CUDA graphs: GPU only
    ]
    args = [
        str(REPO / "yamls/sd2-base.yaml"),
        *overrides,
        "--batches",
        "3",
        "--warmup",
        "1",
        "--out",
        str(out),
        "callbacks.memory_monitor=null",  # overrides may also follow the options (bench/gpu/gpu_check.py)
    ]
    args += ["--data", str(shapes_mds / "mds")]  # an existing folder: the bench makes none
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script points sys.path[0] at the repo
    monkeypatch.setattr(sys, "argv", ["bench/throughput.py", *args])
    runpy.run_path(str(REPO / "bench/throughput.py"), run_name="__main__")
    record = json.loads(out.read_text())
    assert record["resolution"] == 32 and record["global_batch"] == 8 and record["timed_batches"] == 3
    assert record["img_per_sec_per_gpu"] == pytest.approx(8 * record["batches_per_sec"])
    assert record["algorithms"] == [] and "WandBLogger" not in record["loggers"]  # sd2-base has wandb
    assert record["preset"] == "tiny"  # what it was measured on, for the planner's note
    capsys.readouterr()
    main(
        [str(REPO / "yamls/sd2-base.yaml"), "--gpus", "8", "--json", "--throughput-file", str(out)]
        + [*overrides[:3], "data.train.resolution=32"]  # the tiny preset: sd2-base's UNet needs 64 px
    )
    (row,) = json.loads(capsys.readouterr().out)
    assert row["days"] == pytest.approx(row["images"] / (8 * record["img_per_sec_per_gpu"]) / 86400)


@pytest.mark.heavy
def test_a_lora_recipe_prices_the_adapter_as_what_trains(capsys):
    """yamls/sd2-lora.yaml: the adapter's weights, gradients and AdamW state are megabytes, the frozen
    UNet, VAE and text encoder gigabytes (the planner checks model.lora with the preset's family)."""
    args = ["--gpus", "8", "--json", "--img-per-sec-per-gpu", "10", "model.pretrained=/base"]
    main([str(REPO / "yamls/sd2-lora.yaml"), *args])  # its global batch 16: 8 GPUs at most
    memory = json.loads(capsys.readouterr().out)[0]["memory"][0]
    assert memory["optimizer"] < 0.1 and memory["weights"] < 0.05 and memory["frozen"] > 4
