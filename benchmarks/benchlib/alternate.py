"""Alternated rounds on a shared machine, and the statistics over them.

A *round* runs one step of every variant, in an order rotated each round, so slow phases of a noisy machine hit
every variant alike; speedups are medians of the per-round ratio, not ratios of medians. Alternating is not
enough where the noise is not symmetric: a token pipeline keeps both cores busy, so one foreign process slows it
by up to 2x, while stock 1F1B at m = 1 mostly computes on one stage at a time and barely notices. So rank 0
measures foreign CPU load (:class:`benchlib.meters.CpuMeter`) during every step, a round is *clean* when it
stayed low in all of them, and rounds go on until enough are clean; the statistics use the clean rounds.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["alternate", "median", "median_index", "paired_ratios", "rounds_in_use"]


def _broadcast_from_rank0(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def alternate(names: list[str], run_step: Callable[[str, int | None], dict], *, warmup: int, steps: int,
              max_rounds: int, quiet_wait: float, foreign_max: float, cpu: Any | None, rank: int, label: str,
              broadcast: Callable[[Any], Any] = _broadcast_from_rank0) -> list[dict]:
    """Run ``warmup`` untimed rounds, then timed rounds until ``steps`` clean ones (or ``max_rounds``).

    ``run_step(name, round)`` runs one step of variant ``name`` on this rank and returns its summary, with
    ``step_ms`` and ``foreign_cores`` (rank 0's CpuMeter reading over the step; NaN elsewhere); ``round`` is
    None in warm-up, else the timed round's index. Before each timed round rank 0 waits up to ``quiet_wait``
    seconds for foreign load to settle. Rank 0 decides whether a round was clean (every step's foreign load
    below ``foreign_max``) and whether to go on, and ``broadcast`` hands the decision to every rank, so all
    ranks run the same rounds. Returns one record per timed round: ``round``, ``clean``, ``waited_s``,
    ``foreign_cores`` per variant. Rank 0 prints one progress line per round, starting ``[rank 0] {label}``.
    """
    rounds: list[dict] = []
    rnd = clean = 0
    while True:
        warm = rnd < warmup
        waited = cpu.wait_quiet(quiet_wait) if cpu is not None and not warm else 0.0
        foreign: dict[str, float] = {}
        last_ms: dict[str, float] = {}
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:   # rotated order
            summary = run_step(name, None if warm else rnd - warmup)
            foreign[name] = summary["foreign_cores"]
            last_ms[name] = summary["step_ms"]
        rnd += 1
        if warm:
            continue
        is_clean = cpu is None or max(foreign.values()) < foreign_max
        clean += int(is_clean)
        done = clean >= steps or rnd - warmup >= max_rounds
        is_clean, done, waited, foreign = broadcast((is_clean, done, waited, foreign))
        rounds.append({"round": rnd - 1 - warmup, "clean": is_clean, "waited_s": waited, "foreign_cores": foreign})
        if rank == 0:
            line = " ".join(f"{name}={last_ms[name]:.0f}ms" for name in names)
            load = " ".join(f"{foreign[name]:.2f}" for name in names)
            print(f"[rank 0] {label} round {rnd - 1 - warmup} {'clean' if is_clean else 'NOISY'} "
                  f"(waited {waited:.0f}s; foreign cores {load}) {line}", flush=True)
        if done:
            return rounds


def rounds_in_use(rounds: Iterable[Mapping], steps: int) -> set[int]:
    """The rounds statistics should use: the clean ones if there are at least ``min(3, steps)``, else all."""
    rounds = list(rounds)
    clean = {r["round"] for r in rounds if r["clean"]}
    return clean if len(clean) >= min(3, steps) else {r["round"] for r in rounds}


def median(xs: Iterable[float]) -> float:
    """The median, NaN for no values (a row without measurements prints as such rather than failing)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def median_index(xs: list[float]) -> int:
    """Index of the value nearest the median (the median step itself, for its timeline)."""
    med = median(xs)
    return min(range(len(xs)), key=lambda i: abs(xs[i] - med))


def paired_ratios(baseline: Mapping[int, float], variant: Mapping[int, float]) -> list[float]:
    """baseline / variant per round that both ran (round -> time): the speedup of each round."""
    return [baseline[r] / t for r, t in variant.items() if r in baseline]
