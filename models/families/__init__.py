"""One folder per model family: family.py declares its `Family` (models/engine/family.py), model.py its
ComposerModel, presets.py its presets with where each number comes from, folder.py the export folder
where diffusers' pipeline needs more than its parts. models/registry.py lists them."""
