import pytest

from recipes import ConfigError, load_config, parse_config
from recipes.scaling import per_device_batch_size
from tests.conftest import REPO

TINY = REPO / "yamls" / "tiny-cpu.yaml"


def test_tiny_recipe_composes_and_validates():
    run = parse_config(load_config(TINY))
    assert run.model["preset"] == "tiny"
    assert run.data.train.resolution == 32
    assert run.optimizer["_target_"] == "torch.optim.AdamW"


def test_overrides_set_nested_and_unset_keys():
    run = parse_config(load_config(TINY, ["trainer.max_duration=4ba", "data.train.hflip=false", "seed=3"]))
    assert run.trainer["max_duration"] == "4ba"
    assert run.data.train.hflip is False
    assert run.seed == 3
    # A schema key the YAML leaves at its default can be set without Hydra's '+'.
    run = parse_config(load_config(TINY, ["data.train.num_canonical_nodes=8", "trainer.eval_interval=5ba"]))
    assert run.data.train.num_canonical_nodes == 8
    assert run.trainer["eval_interval"] == "5ba"


def test_eval_data_defaults_to_every_sample_in_order_unaugmented():
    run = parse_config(load_config(TINY, ["+data.eval.local=/tmp/eval", "data.train.local=/tmp/train"]))
    assert (run.data.eval.shuffle, run.data.eval.hflip, run.data.eval.drop_last) == (False, False, False)
    assert (run.data.train.shuffle, run.data.train.hflip, run.data.train.drop_last) == (True, True, True)
    assert run.data.eval.resolution == 256  # other keys keep the shared defaults


@pytest.mark.parametrize(
    "override, named, hint",
    [
        ("no_such_key=1", "no_such_key", None),
        ("data.train.resolutoin=64", "data.train.resolutoin", "resolution"),
        ("model.presett=tiny", "model.presett", "preset"),
        ("model.min_snr_gama=5", "model.min_snr_gama", "min_snr_gamma"),
        ("trainer.max_durations=2ba", "trainer.max_durations", "max_duration"),
    ],
)
def test_unknown_key_is_named_with_nearest_valid(override, named, hint):
    with pytest.raises(ConfigError, match=f"'{named}'") as err:
        parse_config(load_config(TINY, [override]))
    if hint:
        assert f"did you mean '{hint}'" in str(err.value)


def test_wrong_types_and_missing_required_keys():
    with pytest.raises(ConfigError, match="'data.train.resolution' must be int"):
        parse_config(load_config(TINY, ["data.train.resolution=big"]))
    with pytest.raises(ConfigError, match="'global_train_batch_size' is missing"):
        parse_config(load_config(TINY, ["~global_train_batch_size"]))
    with pytest.raises(ConfigError, match="'optimizer' needs a '_target_'"):
        parse_config(load_config(TINY, ["~optimizer._target_"]))
    with pytest.raises(ConfigError, match="set by the recipe"):
        parse_config(load_config(TINY, ["+trainer.optimizers=1"]))


def test_defaults_list_composes(tmp_path):
    (tmp_path / "_base.yaml").write_text((TINY.parent / "_base.yaml").read_text())
    (tmp_path / "base.yaml").write_text(TINY.read_text())
    (tmp_path / "child.yaml").write_text("defaults:\n  - base\n  - _self_\nrun_name: child\nseed: 5\n")
    run = parse_config(load_config(tmp_path / "child.yaml"))
    assert (run.run_name, run.seed, run.model["preset"]) == ("child", 5, "tiny")


def test_per_device_batch_is_validated():
    assert per_device_batch_size(2048, 256) == 8
    with pytest.raises(ConfigError, match="2048 is not divisible by the world size 3"):
        per_device_batch_size(2048, 3)


def test_cli_unknown_key_exits_nonzero_naming_it():
    import train as train_py

    with pytest.raises(SystemExit, match="config error: .*no_such_key") as exit:
        train_py.main([str(REPO / "yamls/tiny-cpu.yaml"), "no_such_key=1"])
    assert exit.value.code != 0  # a message as the code exits with status 1


def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, monkeypatch):
    import train as train_py

    monkeypatch.chdir(tmp_path)  # the message names the file as given, relative to here
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_name: x\nseed: [1, 2\nglobal_train_batch_size: 8\n")
    with pytest.raises(SystemExit) as exit_:
        train_py.main(["bad.yaml"])
    assert exit_.value.code == (
        "config error: bad.yaml, line 3, column 24: invalid YAML: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at line 2, column 7)"
    )
    # A mistake in a file the defaults list pulls in names that file.
    (tmp_path / "_base.yaml").write_text("seed: 1\n  optimizer: {}\n")
    (tmp_path / "child.yaml").write_text("defaults:\n  - _base\n  - _self_\nrun_name: child\n")
    with pytest.raises(ConfigError, match=r"^_base.yaml, line 2, column 12: invalid YAML: mapping values"):
        load_config(tmp_path / "child.yaml")
