"""FID, KID and CLIP score from features, and the report files of an evaluation.

The features are computed image by image elsewhere (evaluation/evaluate.py), so they can be gathered
from every rank in one order and reused after a restart; torchmetrics does the statistics on them:
its FID and KID take a feature extractor module, and `Precomputed` is the identity.
"""

import json
import math
import warnings
from pathlib import Path

import torch
from torch import nn
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.image.kid import KernelInceptionDistance

from common.atomic import atomic_write_bytes

KID_SUBSET_SIZE, KID_SUBSETS = 1000, 100  # torch-fidelity's and torchmetrics' defaults
# The fewest images per guidance scale FID and KID are computed on, refused below before any sampling
# (evaluation/evaluate.py). FID fits a covariance: from fewer than 10 images its rank is 9 or less
# whatever the feature size, and the distance mostly measures N. KID's subsets are half the images
# (so they differ): below 10 images they would hold fewer than 5, and their spread says nothing.
MIN_IMAGES, KID_MIN_SUBSET = 10, 5
KEYS = ("guidance", "n", "fid", "kid_mean", "kid_std", "kid_subset_size", "small_n", "clip_score")


class Precomputed(nn.Module):
    """The 'feature extractor' for features that are already extracted: (N, D) in, (N, D) out."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def too_few(n: int) -> str | None:
    """Why `n` images per guidance scale are too few for FID and KID, or None."""
    if n >= MIN_IMAGES:
        return None
    return (
        f"FID and KID need at least {MIN_IMAGES} images per guidance scale ({n} would give a covariance "
        f"of rank {max(n - 1, 0)} and KID subsets of {n // 2}: numbers that measure the count, not the model)"
    )


def small_n(n: int, num_features: int) -> bool:
    """Fewer images than the usual protocol's minimums: FID's covariance is singular with N <= D
    features (and FID reads high, the more the fewer images), and KID's subsets are smaller than its
    standard 1000 (N < 2000). Such numbers compare only with runs of the same N and extractors."""
    return n <= num_features or n < 2 * KID_SUBSET_SIZE


def kid_subset_size(n: int) -> int:
    """KID_SUBSET_SIZE, or half the images when there are fewer than twice that (so subsets differ)."""
    return min(KID_SUBSET_SIZE, n // 2)


def fid(real: torch.Tensor, fake: torch.Tensor) -> float:
    """Fréchet distance between the Gaussians fitted to two (N, D) feature sets."""
    if problem := too_few(min(len(real), len(fake))):
        raise ValueError(problem)
    metric = FrechetInceptionDistance(Precomputed(real.shape[1]), sync_on_compute=False)
    metric.update(real, real=True)
    metric.update(fake, real=False)
    return float(metric.compute())


def kid(real: torch.Tensor, fake: torch.Tensor, seed: int = 0) -> tuple[float, float]:
    """Kernel Inception Distance (cubic polynomial kernel MMD over random subsets): (mean, std).
    Subsets are KID_SUBSET_SIZE images, or half the smaller set when it has fewer than twice that
    (so the subsets differ); they are drawn with `seed`, so the same features give the same KID."""
    subset = kid_subset_size(min(len(real), len(fake)))
    if subset < KID_MIN_SUBSET:
        raise ValueError(too_few(min(len(real), len(fake))))
    with warnings.catch_warnings():  # that it keeps every feature in memory: so does this module
        warnings.filterwarnings("ignore", "Metric `Kernel Inception Distance` will save", UserWarning)
        metric = KernelInceptionDistance(
            Precomputed(real.shape[1]), subsets=KID_SUBSETS, subset_size=subset, sync_on_compute=False
        )
    metric.update(real, real=True)
    metric.update(fake, real=False)
    with torch.random.fork_rng(devices=[]):  # torchmetrics draws the subsets from the global RNG
        torch.manual_seed(seed)
        mean, std = metric.compute()
    return float(mean), float(std)


def scores(
    real: torch.Tensor, fake: torch.Tensor, clip_scores: torch.Tensor, guidance: float, seed: int
) -> dict:
    """One row of metrics.json."""
    kid_mean, kid_std = kid(real, fake, seed)
    n = min(len(real), len(fake))
    return {
        "guidance": guidance,
        "n": len(fake),
        "fid": fid(real, fake),
        "kid_mean": kid_mean,
        "kid_std": kid_std,
        "kid_subset_size": kid_subset_size(n),
        "small_n": small_n(n, real.shape[1]),
        "clip_score": float(clip_scores.double().mean()),
    }


def write_report(
    out: Path, rows: list[dict], header: str = "", targets: dict | None = None
) -> dict[str, Path]:
    """metrics.json (the rows), metrics.md (a table, with pass/fail against `targets` like
    {"fid": 90, "clip_score": 0.15} when given) and fid-vs-clip.png (the guidance trade-off)."""
    paths = {"json": out / "metrics.json", "md": out / "metrics.md", "plot": out / "fid-vs-clip.png"}
    atomic_write_bytes(paths["json"], (json.dumps(rows, indent=1) + "\n").encode())
    atomic_write_bytes(paths["md"], markdown(rows, header, targets).encode())
    plot(rows, paths["plot"])
    return paths


SMALL_N_NOTE = (
    "\\* Few images: with no more images than Inception features FID's covariance is singular and FID "
    "reads high (the more, the fewer images), and KID's subsets are half the images instead of "
    f"{KID_SUBSET_SIZE}. Compare these numbers only with runs of the same image count and extractors, "
    "never with published ones."
)


def markdown(rows: list[dict], header: str = "", targets: dict | None = None) -> str:
    lines = [header, ""] if header else []
    lines += ["| guidance | images | FID | KID (x1000) | CLIP score |", "|---:|---:|---:|---:|---:|"]
    for row in rows:
        kid_text = f"{1000 * row['kid_mean']:.3g} ± {1000 * row['kid_std']:.2g}"
        n = f"{row['n']}\\*" if row.get("small_n") else str(row["n"])  # marked: see SMALL_N_NOTE
        fid_text, clip_text = f"{row['fid']:.4g}", f"{row['clip_score']:.4f}"
        lines.append(f"| {row['guidance']:g} | {n} | {fid_text} | {kid_text} | {clip_text} |")
    if any(row.get("small_n") for row in rows):
        lines += ["", SMALL_N_NOTE]
    if targets:
        lines += ["", f"Targets: FID <= {targets['fid']:g}, CLIP score >= {targets['clip_score']:g}."]
        for row in rows:
            ok = row["fid"] <= targets["fid"] and row["clip_score"] >= targets["clip_score"]
            lines.append(f"- guidance {row['guidance']:g}: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """FID (lower is better) against CLIP score (higher is better), one labelled point per guidance
    scale: the curve papers use to choose a guidance scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(4.5, 3.5), dpi=120)
    finite = [r for r in rows if math.isfinite(r["fid"])]
    axes.plot([r["clip_score"] for r in finite], [r["fid"] for r in finite], "o-")
    for row in finite:
        axes.annotate(
            f"{row['guidance']:g}", (row["clip_score"], row["fid"]), textcoords="offset points", xytext=(4, 4)
        )
    axes.set_xlabel("CLIP score")
    axes.set_ylabel("FID")
    axes.set_title("FID vs CLIP score by guidance scale")
    figure.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    figure.savefig(tmp, format="png")
    plt.close(figure)
    tmp.replace(path)
