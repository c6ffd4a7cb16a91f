"""Every CLI that takes a checkpoint, over every kind of checkpoint we write (issue 47): a checkpoint
file, a sharded checkpoint's folder, an exported pipeline folder, a LoRA run's checkpoint and the LoRA
file's folder that `models.export --lora` writes. Each either does its work or ends with one line
that says why not and what to give instead: never a traceback, never a file-not-found of a file the
user never named (evaluation.evaluate once asked a sharded folder for its model_index.json)."""

import json
from pathlib import Path

import pytest
from PIL import Image

from demo import judge
from evaluation import evaluate
from models import build_model, export, generate
from recipes import build_trainer, load_config
from recipes.file_to_sharded import write_sharded
from recipes.load_check import load_path_problem
from tests.conftest import REPO
from tests.test_cli_mistakes import one_line_exit

pytestmark = pytest.mark.fit

LORA_FOLDER = "holds a LoRA adapter (pytorch_lora_weights.safetensors), not a checkpoint or a pipeline"


@pytest.fixture(scope="module")
def kinds(tiny_checkpoint, tiny_pipeline, shapes_mds, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    write_sharded(tiny_checkpoint, root / "sharded")
    export.main([str(tiny_checkpoint), str(root / "pipeline")])
    overrides = [
        f"model.pretrained={tiny_pipeline[0]}", "model.preset=tiny", "model.lora.rank=4",
        f"data.train.local={shapes_mds / 'mds'}", "data.train.resolution=32", "global_train_batch_size=4",
        "trainer.device=cpu", "trainer.precision=fp32", "trainer.max_duration=1ba", "scheduler.t_warmup=0ba",
        f"trainer.save_folder={root / 'lora-run'}", "trainer.progress_bar=false", "callbacks.samples=null",
    ]  # fmt: skip
    trainer = build_trainer(load_config(REPO / "yamls/sd2-lora.yaml", overrides))
    trainer.fit()
    trainer.close()
    export.main([str(root / "lora-run" / "ep0-ba1-rank0.pt"), str(root / "lora"), "--lora"])
    return {
        "file": tiny_checkpoint,
        "sharded": root / "sharded",
        "pipeline": root / "pipeline",
        "lora checkpoint": root / "lora-run" / "ep0-ba1-rank0.pt",
        "lora file": root / "lora",
    }


# kind -> the line a CLI ends with, None where it does its work
EXPORT = {
    "file": None,
    "sharded": None,
    "pipeline": "is an exported pipeline folder already (model_index.json), not a training checkpoint",
    "lora checkpoint": "is a LoRA checkpoint: --lora writes the adapter file, --merge-lora a full",
    "lora file": LORA_FOLDER,
}
SAMPLE = {"file": None, "sharded": None, "pipeline": None, "lora checkpoint": None, "lora file": LORA_FOLDER}
LOAD_PATH = {
    "file": None,
    "sharded": None,
    "pipeline": "not a training checkpoint: generate, evaluate and demo.judge read it as it is; a run starts "
    "from it with model.pretrained=",
    "lora checkpoint": "tensors differ",
    "lora file": LORA_FOLDER,
}


@pytest.mark.parametrize("kind", list(EXPORT))
def test_export(kinds, kind, tmp_path):
    argv = [str(kinds[kind]), str(tmp_path / "out")]
    if EXPORT[kind] is None:
        export.main(argv)
        assert (tmp_path / "out" / "model_index.json").is_file()
    else:
        assert EXPORT[kind] in one_line_exit(export.main, argv)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", list(SAMPLE))
def test_generate(kinds, kind, tmp_path):
    argv = [str(kinds[kind]), "a red circle", "--out", str(tmp_path / "grid.png"), "--n-per-prompt", "1",
            "--steps", "2", "--device", "cpu"]  # fmt: skip
    if SAMPLE[kind] is None:
        generate.main(argv)
        assert Image.open(tmp_path / "grid.png").size == (32, 32)
    else:
        assert SAMPLE[kind] in one_line_exit(generate.main, argv)


@pytest.mark.parametrize("kind", list(SAMPLE))
def test_evaluate(kinds, kind, shapes_mds, tmp_path):
    argv = [str(kinds[kind]), "--data", str(shapes_mds / "mds"), "--out", str(tmp_path / "eval"),
            "--num-captions", "10", "--guidance", "1", "--steps", "2", "--batch-size", "10",
            "--extractors", "tiny"]  # fmt: skip
    if SAMPLE[kind] is None:
        rows = evaluate.main(argv)
        assert rows[0]["n"] == 10
        assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == rows
    else:
        assert SAMPLE[kind] in one_line_exit(evaluate.main, argv)


@pytest.mark.parametrize("kind", list(SAMPLE))
def test_judge(kinds, kind, tmp_path, monkeypatch):
    """demo.judge loads the model as generate does; its judging (tests/test_demo.py) is left out here."""
    judged = []

    def judging(model, out, per_prompt, seed):
        judged.append(model)
        return {
            "color": 1.0,
            "shape": 1.0,
            "images": 12 * per_prompt,
            "manifest": Path(out) / "manifest.json",
        }

    monkeypatch.setattr(judge, "evaluate", judging)
    argv = [str(kinds[kind]), "--out", str(tmp_path / "judge"), "--per-prompt", "1"]
    if SAMPLE[kind] is None:
        judge.main(argv)
        assert len(judged) == 1 and judged[0].denoiser is not None
    else:
        assert SAMPLE[kind] in one_line_exit(judge.main, argv)
        assert not judged


@pytest.mark.parametrize("kind", list(LOAD_PATH))
def test_train_load_path(kinds, kind):
    problem = load_path_problem(str(kinds[kind]), build_model("tiny"), "tiny")
    if LOAD_PATH[kind] is None:
        assert problem is None
    else:
        assert problem is not None and LOAD_PATH[kind] in problem and "\n" not in problem


def test_export_help_names_every_kind_it_takes(capsys):
    with pytest.raises(SystemExit):
        export.main(["--help"])
    text = capsys.readouterr().out
    assert "FluxPipeline" in text and "sharded checkpoint's folder" in text and "--merge-lora" in text
