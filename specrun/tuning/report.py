"""What `specrun tune` shows: the report, small charts, the plot, progress and the busy warning."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from specrun import sysinfo, ui
from specrun.decoding.pay.rules import predicted_pays
from specrun.errors import UsageError
from specrun.hardware.machine import Hardware

# Other work using more than this share of the CPU when tuning starts gets a warning.
BUSY_FRACTION = 0.25
# Budgets listed in charts.
CHART_BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Fewer calibration passes than this make tau(B) a rough estimate; the report says so.
MIN_CALIBRATION_STEPS = 10
# Plain decoding measured this much faster or slower in the check than in the cost curves means
# the machine's speed drifted during tuning; the report says so.
DRIFT_WARNING = 0.25
def profile_summary(profile: dict) -> dict:
    """Return the profile as printed by --json (everything but the per-step calibration records)."""
    out = dict(profile)
    if "calibration" in out:
        out["calibration"] = {k: v for k, v in out["calibration"].items() if k not in ("steps", "draft_ranks")}
    return out


# --------------------------------------------------------------------------------------------
# Output


def report_lines(profile: dict) -> list[str]:
    """Return the human-readable report: the choice, prediction vs measurement, small charts."""
    config = profile["config"]
    check = profile.get("check", {})
    lines = [f"{profile['models']['target']} with draft {profile['models']['draft']}, {profile['threads']} threads"]
    if config["kind"] == "plain":
        tree = profile.get("best_tree") or {}
        if predicted_pays(tree.get("predicted_speedup", 0.0)):
            lines.append("stored: no draft-model tree (the best tree was predicted faster but measured slower); "
                         "runs use lookup alone, sized online (--no-lookup: plain decoding)")
        else:
            lines.append("stored: no draft-model tree (it does not pay here); runs use lookup alone, sized online "
                         "(--no-lookup: plain decoding)")
        if tree and tree.get("kind") != "plain":
            lines.append(
                f"  best tree ({config_text(tree)}): predicted x{tree['predicted_speedup']:.2f}, "
                f"measured x{check.get('tree_measured_speedup', 0.0):.2f}"
            )
    elif profile.get("tuned_config"):
        slower = [name for name, w in (profile.get("workloads") or {}).items() if w.get("tuned_slower")]
        lines.append(f"stored: {config_text(config)} (the untuned default), with lookup branches sized online "
                     "(--no-lookup: without)")
        lines.append(f"  trees alone against plain decoding, measured: the tuned tree "
                     f"({config_text(profile['tuned_config'])}) x{check.get('tree_measured_speedup', 0.0):.2f}, "
                     f"this one x{profile['measured_speedup']:.2f}")
        lines.append(f"  with lookup branches the tuned tree ran slower than the untuned default on "
                     f"{', '.join(slower) or 'a workload'}: the untuned default is stored")
    else:
        lines.append(f"stored: {config_text(config)}, with lookup branches sized online (--no-lookup: without)")
        lines.append(
            f"  speedup over plain decoding: predicted x{profile['predicted_speedup']:.2f}, "
            f"measured x{profile['measured_speedup']:.2f} "
            f"({check.get('tree_tokens_per_s', 0):.1f} vs {check.get('plain_tokens_per_s', 0):.1f} tok/s, "
            f"{check.get('accepted_per_pass', 0):.2f} tokens per pass)"
        )
        if check.get("predicted_accepted_per_pass"):
            lines.append(
                f"  tokens per pass: predicted {check['predicted_accepted_per_pass']:.2f}, "
                f"measured {check['accepted_per_pass']:.2f}"
            )
        if not check.get("identical_output", True):
            lines.append("  warning: the tree's output differed from plain decoding on a held-out prompt")
    workloads = profile.get("workloads") or {}
    if workloads:
        lines.append("the default per workload, speedup over plain decoding (each prompt afresh, greedy):")
        for name, w in workloads.items():
            spread = w.get("measured_range")
            each = f" (x{spread[0]:.2f} to x{spread[1]:.2f} each)" if spread else ""
            expected = w.get("predicted_range")
            expected = f" (x{expected[0]:.2f} to x{expected[1]:.2f} expected)" if expected else ""
            held_out = f"{w['prompts'] // 2} held-out prompts" if w.get("prompts") else "held-out prompts"
            lines.append(f"  {name:>8} ({w['drafter']}): predicted x{w['predicted_speedup']:.2f}{expected}, "
                         f"measured x{w['measured_speedup']:.2f} on {held_out}{each}")
            if "untuned_speedup" in w:
                held = ("" if "untuned_measured_speedup" not in w else
                        f" (held-out: x{w['tuned_measured_speedup']:.2f} and x{w['untuned_measured_speedup']:.2f})")
                tuned = "lookup alone (tuned)" if w.get("tuned_drafter") == "lookup" else "tuned tree"
                lines.append(f"  {'':>8} {tuned} x{w['tuned_speedup']:.2f}, untuned default x{w['untuned_speedup']:.2f} "
                             f"on the predicting prompts{held}")
    if profile.get("attention"):  # (tuning.attention: a target whose attention runs on this CPU)
        lines.append(f"flash attention: {profile['attention']['advice']}")
    plain_predicted = check.get("plain_predicted_tokens_per_s")
    plain_measured = check.get("plain_tokens_per_s")
    if plain_predicted and plain_measured and abs(plain_measured / plain_predicted - 1) > DRIFT_WARNING:
        lines.append(
            f"  note: plain decoding ran at {plain_measured:.1f} tok/s in the check but "
            f"{plain_predicted:.1f} tok/s when measured: the machine's speed changed while tuning "
            "(other work running?), so predictions are rough"
        )
    n_steps = profile.get("calibration", {}).get("n_steps", MIN_CALIBRATION_STEPS)
    if n_steps < MIN_CALIBRATION_STEPS:
        lines.append(
            f"  note: calibration saw only {n_steps} target passes before its time ran out, so "
            "acceptance is a rough estimate (tune again on a quieter machine, or without --quick)"
        )
    curves = profile["curves"]
    lines.append("target pass time by tokens in the batch:")
    lines += _bars({f"{n:>5}": s * 1000 for n, s in zip(curves["target"]["sizes"], curves["target"]["seconds"])}, "ms")
    lines.append("draft pass time by batch width:")
    lines += _bars({f"{n:>5}": s * 1000 for n, s in zip(curves["draft"]["sizes"], curves["draft"]["seconds"])}, "ms")
    tau = {int(b): t for b, t in profile["acceptance"]["tau"].items()}
    shown = {b: tau[b] for b in CHART_BUDGETS if b in tau}
    largest = max(tau) if tau else 0
    if largest and largest not in shown:
        shown[largest] = tau[largest]
    lines.append("tokens per target pass tau(B) by tree budget B:")
    lines += _bars({f"{b:>5}": t for b, t in sorted(shown.items())}, "tok")
    return lines


def config_text(config: dict) -> str:
    """A stored tree configuration in words."""
    if config["kind"] == "sequoia":
        return f"Sequoia static tree of {config['budget']} draft tokens, depth {config['depth']}"
    grows = f", growing online to up to {config['grow']}" if config.get("grow") else ""
    return (
        f"SpecExec tree, budget {config['budget']}, depth {config['depth']}, width {config['width']}, "
        f"top-k {config['top_k']}{grows}"
    )


_EIGHTHS = " ▏▎▍▌▋▊▉█"


def _bars(values: dict[str, float], unit: str, width: int = 32) -> list[str]:
    """Return one unicode bar per value, scaled to the largest."""
    top = max(values.values(), default=0.0)
    lines = []
    for label, value in values.items():
        eighths = round(width * 8 * value / top) if top > 0 else 0
        bar = "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")
        lines.append(f"  {label} {bar:<{width}} {value:8.2f} {unit}")
    return lines


def curve_text(points: dict[int, float]) -> str:
    return ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in sorted(points.items()))


def gpu_note(hardware: Hardware) -> str:
    gpus = hardware.gpus
    if not gpus:
        return ", no GPU"
    return ", " + ", ".join(f"{g.name} ({g.free_bytes / 2**30:.1f} of {g.total_bytes / 2**30:.1f} GiB free)" for g in gpus)


def warn_if_busy(cores: int, what: str = "the profile may not fit a quiet machine") -> None:
    """Warn when other work is using the CPU: every timing would be slower and noisier."""
    busy = sysinfo.cpu_busy_fraction()
    if busy is not None:
        if busy > BUSY_FRACTION:
            ui.warn(
                f"the machine is busy ({busy:.0%} of {cores} cores in use by other work): "
                f"timings will be noisy and {what}"
            )
        return
    try:
        load = os.getloadavg()[0]  # no /proc/stat: the load average also counts work just ended
    except (OSError, AttributeError):
        return
    if load > 0.5 * cores + 0.5:
        ui.warn(f"the machine is busy (load {load:.1f} on {cores} cores): timings will be noisy and {what}")




@contextmanager
def progress():
    """Yield a Rich progress display on stderr (transient: it disappears when done)."""
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
        console=ui.err_console(), transient=True,
    )
    with progress:
        yield progress


# --------------------------------------------------------------------------------------------
# Plot


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'specrun[plot]' (or pip install matplotlib)") from None


def write_plot(profile: dict, path: Path) -> None:
    """Write the cost curves and tau(B) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = profile["curves"]
    tau = sorted((int(b), t) for b, t in profile["acceptance"]["tau"].items())
    fig, (ax_cost, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in (("target", curves["target"]), ("draft (incl. top-k)", curves["draft"])):
        ax_cost.plot(curve["sizes"], [s * 1000 for s in curve["seconds"]], marker="o", label=name)
    ax_cost.set_xscale("log", base=2)
    ax_cost.set_xlabel("tokens in the batch")
    ax_cost.set_ylabel("ms per forward pass")
    ax_cost.set_title("cost curves")
    ax_cost.legend()
    ax_tau.plot([b for b, _ in tau], [t for _, t in tau], marker=".")
    config = profile["config"]
    if config["kind"] == "specexec":
        ax_tau.axvline(config["budget"], color="grey", linestyle=":", label=f"chosen budget {config['budget']}")
        ax_tau.legend()
    ax_tau.set_xscale("log", base=2)
    ax_tau.set_xlabel("tree budget B (draft tokens)")
    ax_tau.set_ylabel("tokens per target pass")
    ax_tau.set_title("tau(B) from calibration")
    models = profile["models"]
    fig.suptitle(f"{models['target']} / {models['draft']}: {config_text(config) if config['kind'] != 'plain' else 'plain decoding'}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise UsageError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
