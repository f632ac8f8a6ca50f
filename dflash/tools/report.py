"""`dflash report RUN_DIR [--compare RUN_DIR2]`: plots and a one-page summary from metrics.jsonl.

Writes RUN_DIR/report/*.png and RUN_DIR/report/report.md:
loss and accuracy (loss per bucket as colored points: a bucket-driven, "fluffy" loss shows as
separated bands), bucket mix per tick, longest same-bucket run, grad norm, queue depths,
per-drafter loss and optimizer step, eval tau against tau_sim with the acceptance histogram,
GPU utilization and power per device (when the run had NVML telemetry), and the figures a
drafter variant adds (DSpark's, DFlash2's: every other `train/` key, grouped by kind). A panel
with nothing logged for it says so instead of staying blank. With --compare, the main curves of
two runs overlaid.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from dflash.errors import exit_for_user_error
from dflash.pipeline.roles import role_lines


def load_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found (is {run_dir} a dflash run directory?)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"dflash report: skipping unreadable line {path}:{number}")
    return rows


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if not points:
        return np.array([]), np.array([])
    steps, values = zip(*points)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def keys_matching(rows: list[dict], pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return sorted(
        {k for r in rows for k in r if regex.fullmatch(k)},
        key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)],
    )


def bucket_mix_per_tick(rows: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """batch/ stats are cumulative; the share of each bucket among batches dispatched per tick."""
    pct_keys = keys_matching(rows, r"batch/bucket_\d+_pct")
    ticks = [r for r in rows if "batch/dispatched" in r and all(k in r for k in pct_keys)]
    if len(ticks) < 1 or not pct_keys:
        return np.array([]), {}
    counts = np.array([[r[k] * r["batch/dispatched"] / 100 for k in pct_keys] for r in ticks])
    per_tick = np.diff(np.vstack([np.zeros(len(pct_keys)), counts]), axis=0)
    totals = per_tick.sum(axis=1, keepdims=True)
    shares = np.divide(per_tick, totals, out=np.zeros_like(per_tick), where=totals > 0) * 100
    steps = np.array([r["step"] for r in ticks], dtype=float)
    return steps, {k.split("/")[1].removesuffix("_pct"): shares[:, i] for i, k in enumerate(pct_keys)}


# Every series of one axis gets its own colour, marker and line style, so a figure stays readable
# in grey print and for colour-blind readers, and its legend names each series by the same look.
_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", "-.", ":")


def series_style(index: int, points: int) -> dict:
    """The look of an axis's `index`-th series: about a dozen markers along it, however long."""
    return {
        "color": _COLORS[index % len(_COLORS)],
        "marker": _MARKERS[index % len(_MARKERS)],
        "linestyle": _LINESTYLES[index % len(_LINESTYLES)],
        "markersize": 4,
        "markevery": max(1, points // 12),
    }


def plot_series(ax, steps: np.ndarray, values: np.ndarray, *, label: str) -> None:
    """A line on `ax` in the next look of its own (series_style), labelled for the legend."""
    if len(values):
        ax.plot(steps, values, label=label, **series_style(len(ax.lines), len(values)))


def has_points(ax) -> bool:
    """Whether anything with data was drawn on `ax` (an empty line or scatter does not count)."""
    lines = any(len(line.get_xdata()) for line in ax.lines)
    collections = any(c.get_offsets().size or c.get_paths() for c in ax.collections)
    return lines or collections or bool(ax.patches)


def explain_empty(ax, reason: str) -> None:
    """A panel with nothing to draw says why, in place of blank axes (once)."""
    if has_points(ax) or ax.texts:
        return
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, reason, ha="center", va="center", wrap=True, transform=ax.transAxes)


# The train/ keys the standard panels draw, and bookkeeping no panel needs. Every other train/
# key of metrics.jsonl is a figure of the drafter variant's own (dflash/step/variant.py:
# `figure_names` and its per-position families), drawn on the variant page.
STANDARD_TRAIN = re.compile(
    r"train/(loss|acc|tau_sim|tau_block|tau_decode|grad_norm|lr|window_steps|nonfinite_steps|opt_step"
    r"|loss_bucket_\d+|acc_pos_\d+)"
)


def variant_groups(rows: list[dict]) -> dict[str, list[str]]:
    """The variant's own figures present in `rows`, by panel: a per-position family (`NAME_pos_j`)
    each, acceptance lengths, loss terms, the other rates; evaluation figures per benchmark other
    than acceptance lengths (those join the acceptance page)."""
    groups: dict[str, list[str]] = {}
    for key in keys_matching(rows, r"train/.+"):
        if STANDARD_TRAIN.fullmatch(key):
            continue
        name = key.split("/", 1)[1]
        family = re.fullmatch(r"(.+)_pos_\d+", name)
        if family:
            title = f"{family.group(1)} by block position"
        elif "tau" in name:
            title = "acceptance length (tokens per round)"
        elif name.endswith(("ce", "l1", "loss")):
            title = "loss terms (per unit of weight)"
        else:
            title = "rates and calibration"
        groups.setdefault(title, []).append(key)
    evaluation = [k for k in keys_matching(rows, r"eval/[^/]+/[^/]+") if "tau" not in k.rsplit("/", 1)[1]]
    if evaluation:
        groups["evaluation, per benchmark"] = evaluation
    return groups


def plot_variant_figures(rows: list[dict], save) -> None:
    """One panel per group of variant_groups: each figure against the step (with the held-out
    split's `val/` twin where logged), a per-position family as its values by position at the
    first and the last logged window."""
    import matplotlib.pyplot as plt

    groups = variant_groups(rows)
    if not groups:
        return  # a plain DFlash run: the standard pages hold every figure
    columns = min(3, len(groups))
    panels = -(-len(groups) // columns)
    fig, axes = plt.subplots(panels, columns, figsize=(6 * columns, 4.2 * panels), squeeze=False)
    cells = list(axes.flat)
    for ax in cells[len(groups) :]:
        fig.delaxes(ax)  # no blank cell in the grid
    for ax, (title, keys) in zip(cells, groups.items()):
        if title.endswith("by block position"):
            plot_by_position(ax, rows, keys)
        else:
            for key in keys:
                plot_series(ax, *series(rows, key), label=key)
                if key.startswith("train/"):  # the held-out split's figure of the same name
                    twin = "val/" + key.removeprefix("train/")
                    plot_series(ax, *series(rows, twin), label=twin)
            ax.set(xlabel="optimizer step")
        ax.set(title=title)
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
        explain_empty(ax, "logged, but never a finite value")
    save(fig, "variant_figures")


def plot_by_position(ax, rows: list[dict], keys: list[str]) -> None:
    """`NAME_pos_j` against j, at the first and the last window that logged the family."""
    positions = [int(k.rsplit("_", 1)[1]) for k in keys]
    logged = [r for r in rows if all(r.get(k) is not None for k in keys)]
    for row in logged[:1] + logged[1:][-1:]:  # the first window, and the last when it is another
        values = np.asarray([row[k] for k in keys])
        plot_series(ax, np.asarray(positions, float), values, label=f"step {row['step']}")
    ax.set(xlabel="block position (tokens after the anchor)", ylabel=keys[0].rsplit("_pos_", 1)[0])
    ax.set_xticks(positions)


def plot_run(rows: list[dict], out: Path, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str, empty: dict | None = None) -> None:
        """Write `fig`; a panel with nothing drawn says why (`empty`: its reason, per axis)."""
        for ax in fig.axes:
            explain_empty(ax, (empty or {}).get(ax, "nothing logged for this panel"))
        fig.suptitle(f"{title}: {name.replace('_', ' ')}")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        written.append(f"{name}.png")

    plot_loss_accuracy(rows, save)
    plot_buckets(rows, save)
    plot_grad_norm_queues(rows, save)
    plot_drafters(rows, save)
    if series(rows, "eval/tau")[0].size:
        plot_acceptance(rows, save)
    plot_variant_figures(rows, save)
    plot_gpus(rows, save)
    return written


def legend_where_drawn(*axes, fontsize: int = 8) -> None:
    """A legend on each axis that has lines (an empty one would only warn)."""
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=fontsize)


def plot_loss_accuracy(rows: list[dict], save) -> None:
    """The loss, its points colored by length bucket, beside accuracy and tau_sim per block."""
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.2))
    for index, key in enumerate(keys_matching(rows, r"train/loss_bucket_\d+")):
        steps, values = series(rows, key)
        look = series_style(index + 1, len(values))  # index 0 is the all-buckets line's look
        ax_loss.scatter(
            steps,
            values,
            s=14,
            alpha=0.7,
            color=look["color"],
            marker=look["marker"],
            label=key.split("_", 1)[1].replace("_", " "),
        )
    plot_series(ax_loss, *series(rows, "train/loss"), label="all buckets")
    ax_loss.set(xlabel="optimizer step", ylabel="weighted CE loss", title="loss, colored by length bucket")
    ax_loss.legend(fontsize=8)
    for key, label in (("train/acc", "accuracy (k >= 1)"), ("train/tau_sim", "tau_sim / block")):
        steps, values = series(rows, key)
        if key == "train/tau_sim" and len(values):
            block = 1 + len(keys_matching(rows, r"train/acc_pos_\d+"))
            values = values / block
        plot_series(ax_acc, steps, values, label=label)
    ax_acc.set(xlabel="optimizer step", ylim=(0, 1), title="accuracy and simulated acceptance")
    ax_acc.legend(fontsize=8)
    save(fig, "loss_accuracy")


def plot_buckets(rows: list[dict], save) -> None:
    """Each tick's bucket mix beside its longest run of same-bucket batches."""
    import matplotlib.pyplot as plt

    fig, (ax_mix, ax_run) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps, shares = bucket_mix_per_tick(rows)
    if shares:
        ax_mix.stackplot(steps, *shares.values(), labels=list(shares), alpha=0.8)
        ax_mix.legend(fontsize=8, loc="upper right")
    ax_mix.set(xlabel="optimizer step", ylabel="% of batches in the tick", ylim=(0, 100), title="bucket mix")
    steps, values = series(rows, "batch/same_bucket_run_max")
    ax_run.step(steps, values, where="post")
    ax_run.set(xlabel="optimizer step", ylabel="batches", title="longest same-bucket run per tick")
    no_batches = "no batch/ statistics in this run"
    save(fig, "buckets", {ax_mix: no_batches, ax_run: no_batches})


def plot_grad_norm_queues(rows: list[dict], save) -> None:
    """The pre-clip gradient norm beside the pipeline's queue depths."""
    import matplotlib.pyplot as plt

    fig, (ax_grad, ax_queue) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps, values = series(rows, "train/grad_norm")
    ax_grad.plot(steps, values)
    ax_grad.set(xlabel="optimizer step", ylabel="pre-clip grad norm", title="grad norm", yscale="log")
    for key in keys_matching(rows, r"queue/(hs_depth|prefetch_target\d+_depth)"):
        plot_series(ax_queue, *series(rows, key), label=key.split("/")[1])
    ax_queue.set(xlabel="optimizer step", ylabel="items", title="queue depths")
    legend_where_drawn(ax_queue)
    save(fig, "grad_norm_queues", {ax_queue: "no queues (pipeline=sync)"})


def plot_drafters(rows: list[dict], save) -> None:
    """Each drafter replica's loss, and how far its optimizer step runs from the logged step."""
    import matplotlib.pyplot as plt

    fig, (ax_dl, ax_ds) = plt.subplots(1, 2, figsize=(12, 4.2))
    for key in keys_matching(rows, r"drafter\d+/loss"):
        plot_series(ax_dl, *series(rows, key), label=key.split("/")[0])
        steps, opt = series(rows, key.replace("/loss", "/opt_step"))
        plot_series(ax_ds, steps, opt - steps, label=key.split("/")[0])
    ax_dl.set(xlabel="optimizer step", ylabel="loss", title="loss per drafter replica")
    ax_ds.set(xlabel="optimizer step", ylabel="drafter step - logged step", title="drafter step skew")
    legend_where_drawn(ax_dl, ax_ds)
    no_replicas = "no drafter{i}/ rows in this run"
    save(fig, "drafters", {ax_dl: no_replicas, ax_ds: no_replicas})


def plot_gpus(rows: list[dict], save) -> None:
    """Each GPU's utilization and power from the NVML telemetry."""
    import matplotlib.pyplot as plt

    util_keys = keys_matching(rows, r"gpu/cuda\d+/util_pct")
    fig, (ax_util, ax_power) = plt.subplots(1, 2, figsize=(12, 4.2))
    for key in util_keys:
        device = key.split("/")[1]
        plot_series(ax_util, *series(rows, key), label=device)
        plot_series(ax_power, *series(rows, f"gpu/{device}/power_w"), label=device)
    ax_util.set(xlabel="optimizer step", ylabel="%", title="GPU utilization", ylim=(0, 100))
    ax_power.set(xlabel="optimizer step", ylabel="W", title="GPU power")
    legend_where_drawn(ax_util, ax_power)
    no_nvml = "no NVML telemetry in this run"
    save(fig, "gpus", {ax_util: no_nvml, ax_power: no_nvml})


def plot_acceptance(rows: list[dict], save) -> None:
    """Speculative-decoding tau (periodic and final evaluations) against training's tau_sim and
    block runs and the held-out split's (a widening gap is a train/inference mismatch), and the
    last acceptance-length histogram."""
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_hist) = plt.subplots(1, 2, figsize=(12, 4.2))
    # Block runs (what verification accepts on training contexts) and the held-out split's
    # figures, where the run logged them: the gap between these and eval tau is new prompts'.
    for key in (
        "train/tau_sim",
        "train/tau_block",
        "train/tau_decode",
        "val/tau_sim",
        "val/tau_block",
        "val/tau_decode",
        "eval/tau",
    ):
        plot_series(
            ax_tau, *series(rows, key), label=key + (" (all benchmarks)" if key == "eval/tau" else "")
        )
    # Per benchmark: tau, and a variant's own acceptance lengths (DSpark's confidence_tau,
    # its confidence head's prediction, beside accepted_tau, the one measured).
    for key in keys_matching(rows, r"eval/[^/]+/\w*tau"):
        plot_series(ax_tau, *series(rows, key), label=key)
    ax_tau.set(xlabel="optimizer step", ylabel="tokens per target forward", title="acceptance length")
    ax_tau.legend(fontsize=8)
    last = next(r for r in reversed(rows) if "eval/tau" in r)
    hist_keys = keys_matching([last], r"eval/accept_len_\d+_frac")
    lengths = [int(k.split("_")[2]) for k in hist_keys]
    ax_hist.bar(lengths, [last[k] for k in hist_keys])
    ax_hist.set_xticks(lengths)
    ax_hist.set(
        xlabel="tokens produced per verification",
        ylabel="share of verifications",
        title=f"acceptance histogram at step {last['step']}",
    )
    save(fig, "acceptance", {ax_hist: "no eval/accept_len_* histogram in the last evaluation"})


def plot_compare(rows_a: list[dict], rows_b: list[dict], name_a: str, name_b: str, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("train/loss", "train/acc", "train/tau_sim", "perf/tokens_per_s")
    fig, axes = plt.subplots(1, len(keys), figsize=(16, 3.8))
    for ax, key in zip(axes, keys):
        for rows, name in ((rows_a, name_a), (rows_b, name_b)):
            plot_series(ax, *series(rows, key), label=name)
        ax.set(xlabel="optimizer step", title=key)
        legend_where_drawn(ax, fontsize=7)
        explain_empty(ax, f"{key} in neither run")
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)
    return "compare.png"


def run_labels(run_a: Path, run_b: Path) -> tuple[str, str]:
    """Legend names of two compared runs: their folder names, or their paths where the names
    are the same (two runs started at the same time of day on different dates)."""
    if run_a.name != run_b.name:
        return run_a.name, run_b.name
    return str(run_a), str(run_b)


def final_values(rows: list[dict]) -> dict[str, float]:
    last: dict[str, float] = {}
    for row in rows:
        last.update({k: v for k, v in row.items() if v is not None})
    return last


def summary_markdown(
    run_dir: Path, rows: list[dict], images: list[str], compare: tuple[Path, list[dict]] | None
) -> str:
    last = final_values(rows)
    keys = [
        "step",
        "train/loss",
        "train/acc",
        "train/tau_sim",
        "eval/tau",
        "eval/lossless_frac",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/data_wait_frac",
        "perf/target_busy_frac",
        "perf/drafter_busy_frac",
        "batch/padding_efficiency",
        "batch/bucket_entropy",
    ]
    # The variant's own figures too (DSpark's, DFlash2's), one number each: per-position
    # families are on the variant page only.
    keys += [
        key
        for each in ([rows] + ([compare[1]] if compare else []))
        for group in variant_groups(each).values()
        for key in group
        if "_pos_" not in key
    ]
    keys = list(dict.fromkeys(keys))
    lines = [f"# dflash run report: `{run_dir}`", ""]
    if compare:
        other = final_values(compare[1])
        name_a, name_b = run_labels(run_dir, compare[0])
        lines += [f"| metric | {name_a} | {name_b} |", "|---|---|---|"]
        lines += [
            f"| {k} | {last.get(k, float('nan')):.4g} | {other.get(k, float('nan')):.4g} |" for k in keys
        ]
    else:
        lines += ["| metric | final |", "|---|---|"]
        lines += [f"| {k} | {last[k]:.4g} |" for k in keys if k in last]
    lines.append("")
    summary_path = run_dir / "summary.json"
    roles = role_lines(json.loads(summary_path.read_text())) if summary_path.is_file() else []
    if roles:  # how busy each device role was, and the split that would balance them
        lines += ["## Device roles", "", "```", *roles, "```", ""]
    lines += [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="dflash report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--compare", type=Path, help="a second run dir whose main curves are overlaid")
    parser.add_argument("--out", type=Path, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        write_report(args)
    except (ValueError, OSError) as exc:  # a missing or unreadable run: one line, exit 2
        exit_for_user_error("dflash report", str(exc))


def write_report(args: argparse.Namespace) -> None:
    rows = load_rows(args.run_dir)
    out = args.out or args.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    images = plot_run(rows, out, args.run_dir.name)
    compare = None
    if args.compare:
        compare = (args.compare, load_rows(args.compare))
        name_a, name_b = run_labels(args.run_dir, args.compare)
        images.append(plot_compare(rows, compare[1], name_a, name_b, out))
    (out / "report.md").write_text(summary_markdown(args.run_dir, rows, images, compare))
    print(f"dflash report: wrote {len(images)} plots and report.md to {out}")


if __name__ == "__main__":
    main()
