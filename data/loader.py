"""`data.train` / `data.eval` of a run config, and the DataLoader they describe.

One set (`local` / `remote`) or several (`streams`), optionally aspect-ratio bucketed (`buckets`),
images or precomputed latents (`latents`), with streaming's settings (`cache_limit`, `predownload`,
...; values and reasons in yamls/_base.yaml, streams and buckets in data/streams.py).
"""

from dataclasses import dataclass

import torch
from streaming import Stream
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from compat.streaming import World
from data.buckets import bucket_ratio, bucket_size, check_size
from data.holdout import HeldOut, held_out_ids, leave_out
from data.image_caption import ImageCaptionDataset
from data.latent_dataset import LatentsDataset
from data.streams import check_settings, resolve_streams, streaming_settings
from models.engine.draw_keys import SAMPLE_INDEX


@dataclass
class ImageCaptionDataConfig:
    """`data.train` / `data.eval` in the run YAML."""

    local: str | None = None  # local MDS folder, or the cache folder for `remote`
    remote: str | None = None  # e.g. s3://bucket/prefix; None reads `local` directly
    # Several sets instead of local/remote: {name: {remote, local, proportion | repeat | choose}}.
    streams: dict | None = None
    buckets: bool = False  # the set(s) are `sd-convert --buckets` output: each bucket at its own size
    bucket_sizes: dict | None = None  # {ar0.75: [height, width]} instead of data/buckets.py's sizes
    resolution: int = 256
    hflip: bool = True
    shuffle: bool = True
    num_workers: int = 0
    num_canonical_nodes: int | None = None  # fix it so 1 and N nodes see the same sample order
    drop_last: bool = True
    image_key: str = "image"
    caption_key: str = "caption"
    prepare: str | None = None  # a name in recipes.prepare.PREPARERS: build `local` if missing
    latents: bool = False  # read precomputed `latents_{resolution}` + `text_embeds` (convert latents)
    # Samples kept out of training and evaluated as the run's held-out set: a fraction 0 < f < 1 or
    # a number of samples; the same ones on every rerun and process count (data/holdout.py).
    holdout: float | int | None = None
    # Streaming settings; None leaves streaming's default. yamls/_base.yaml sets them.
    cache_limit: str | int | None = None
    predownload: int | None = None
    download_timeout: float | None = None
    sampling_method: str = "balanced"
    batching_method: str = "random"
    shuffle_algo: str = "py1e"
    shuffle_block_size: int | None = None

    def __post_init__(self):
        check_settings(self)


@dataclass
class EvalDataConfig(ImageCaptionDataConfig):
    """`data.eval`: the same keys, but every sample once, in order, unaugmented."""

    hflip: bool = False
    shuffle: bool = False
    drop_last: bool = False

    def __post_init__(self):
        if self.holdout is not None:
            raise ValueError(
                "holdout: data.eval is evaluated whole; to keep part of the training set out and "
                "evaluate it, set data.train.holdout"
            )
        super().__post_init__()


def bucket_sizes(cfg: ImageCaptionDataConfig, labels, multiple: int) -> dict[str, tuple[int, int]]:
    """(height, width) per bucket label: `cfg.bucket_sizes` where given (checked), else computed."""
    given = cfg.bucket_sizes or {}
    sizes = {}
    for label in labels:
        if label in given:
            sizes[label] = check_size(f"bucket_sizes.{label}", given[label], multiple)
        else:
            sizes[label] = bucket_size(bucket_ratio(label), cfg.resolution, multiple)
    return sizes


def build_image_caption_dataloader(
    cfg: ImageCaptionDataConfig,
    tokenizer,
    batch_size: int,
    size_multiple: int = 64,
    split: str = "train",
    *,
    tokenizer_2=None,
    micro_conditioning: bool = False,
    t5_tokenizer=None,
    t5_tokens: int | None = None,
    caption_ids=None,
) -> DataLoader:
    """A DataLoader over the configured set(s) (recipes.prepare.ensure_dataset checks them);
    `batch_size` is per device; `size_multiple` is what bucket sizes must be multiples of.
    `tokenizer_2` and `micro_conditioning`: what an SDXL model reads besides (data/image_caption.py);
    `t5_tokenizer` and `t5_tokens`: T5's ids, for a model that reads T5 (SD3's optional `tokenizer_3`,
    Flux's `tokenizer_2`); `caption_ids`: caption -> id columns, instead of `tokenizer`'s (an LLM's chat
    prompt, models/engine/llm_conditioner.py);
    precomputed latents hold it already (data/latent_dataset.py)."""
    streaming = dict(
        shuffle=cfg.shuffle,
        batch_size=batch_size,
        num_canonical_nodes=cfg.num_canonical_nodes,
        **streaming_settings(cfg),
    )
    sizes = None
    if cfg.streams is None and not cfg.buckets:
        streaming.update(local=cfg.local, remote=cfg.remote)  # one set, read as before
    else:
        specs = resolve_streams(cfg, split)
        streaming["streams"] = [Stream(**spec.stream_kwargs()) for spec in specs]
        if cfg.buckets:
            by_label = bucket_sizes(cfg, {s.bucket for s in specs}, size_multiple)
            sizes = [by_label[s.bucket] for s in specs]
    if cfg.latents:
        dataset = LatentsDataset(resolution=cfg.resolution, **streaming)
    else:
        dataset = ImageCaptionDataset(
            tokenizer=tokenizer,
            resolution=cfg.resolution,
            hflip=cfg.hflip,
            image_key=cfg.image_key,
            caption_key=cfg.caption_key,
            sizes=sizes,
            tokenizer_2=tokenizer_2,
            micro_conditioning=micro_conditioning,
            t5_tokenizer=t5_tokenizer,
            t5_tokens=t5_tokens,
            caption_ids=caption_ids,
            **streaming,
        )
    if cfg.holdout is not None and split == "train":
        # Every rank keys the same global sample ids, so all leave out the same ones (data/holdout.py).
        leave_out(dataset, held_out_ids(dataset.num_samples, cfg.holdout), World.detect().num_ranks)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=cfg.num_workers,
        drop_last=cfg.drop_last,
        persistent_workers=cfg.num_workers > 0,
        # Page-locked batches: the host-to-GPU copy can run asynchronously (Composer copies with
        # non_blocking=True); nothing to gain without a GPU.
        pin_memory=torch.cuda.is_available(),
    )


def build_holdout_dataloader(train: DataLoader, cfg: ImageCaptionDataConfig) -> DataLoader:
    """The samples `data.train.holdout` keeps out of `train`'s dataset, each once per evaluation, in
    order and unaugmented, read through that dataset (its cache, its downloads). Split over the ranks
    as torch's DistributedSampler splits a set: a count the number of processes does not divide
    repeats its first few samples on the last ranks, so every rank runs as many batches."""
    view = HeldOut(train.dataset)
    world = World.detect()
    return DataLoader(
        view,
        batch_size=train.batch_size,
        sampler=DistributedSampler(view, world.num_ranks, world.rank, shuffle=False, drop_last=False),
        collate_fn=collate,
        num_workers=cfg.num_workers,
        drop_last=False,
        persistent_workers=cfg.num_workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


def collate(samples: list[dict]) -> dict:
    """torch's default collate, but each sample's index in its dataset (models/engine/draw_keys.py) stays a
    list of ints: Composer moves a batch's tensors to the GPU, and reading the indices back from there
    would wait for the GPU every step."""
    indices = [sample.pop(SAMPLE_INDEX) for sample in samples] if SAMPLE_INDEX in samples[0] else None
    batch = default_collate(samples)
    if indices is not None:
        batch[SAMPLE_INDEX] = indices
    return batch
