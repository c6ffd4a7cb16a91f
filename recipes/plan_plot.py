"""`python -m recipes.plan --plot`: days and cost against the GPU count, as a PNG."""

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def write_plot(rows: list[dict], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster login node or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows = [row for row in rows if "error" not in row]  # nothing to draw for a split that fails
    gpus = [row["gpus"] for row in rows]
    fig, (ax_days, ax_cost) = plt.subplots(1, 2, figsize=(10, 4))
    ax_days.plot(gpus, [row["days"] for row in rows], "o-")
    ax_days.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="days", title="time to train")
    ax_cost.plot(gpus, [row["cost"] for row in rows], "o-")
    ax_cost.set(xscale="log", xlabel="GPUs", ylabel="$", title="cost (flat under linear scaling)")
    ax_cost.set_ylim(bottom=0)
    for ax in (ax_days, ax_cost):
        ax.set_xticks(gpus, [str(n) for n in gpus])
        ax.xaxis.set_minor_locator(NullLocator())  # only the planned counts
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    log.info("wrote %s", path)
