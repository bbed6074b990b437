"""Tables and reports: markdown rows, target checks, and the JSON report with the commit and machine measured.

Every benchmark's report goes to ``benchmarks/results/<name>.json`` unless told otherwise (:func:`results_path`),
and carries what a reader needs to trust or redo it (:func:`write_report`): the command, the commit (with a
dirty flag: measured code that differs from the commit is not that commit's), and the machine.
"""
from __future__ import annotations

import argparse

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "RESULTS_DIR", "fmt", "git_commit", "machine_info", "markdown_table", "print_checks",
           "results_path", "write_report", "chosen_variants"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
#: what a benchmark measures: a change here makes the measured code differ from the commit
MEASURED_PATHS = ("ds_terapipe", "benchmarks", ":(exclude)benchmarks/results")


def results_path(name: str) -> Path:
    """Where benchmark ``name`` writes its report by default: the committed latest run."""
    return RESULTS_DIR / f"{name}.json"


def fmt(x: float | None, spec: str) -> str:
    """``x`` formatted, or "-" for a value that does not apply."""
    return "-" if x is None else format(x, spec)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table as lines: ``| a | b |``, ``|---|---|``, then one line per row (cells already strings)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def print_checks(checks: Sequence[dict]) -> None:
    """One line per target: ``[met ]`` or ``[MISS]``, its text and value."""
    for c in checks:
        print(f"  [{'met ' if c['met'] else 'MISS'}] {c['target']}: {c['value']:.3f}")


def git_commit(root: Path = ROOT, paths: Sequence[str] = MEASURED_PATHS) -> dict | None:
    """The commit measured: ``{"sha", "short", "dirty", "describe"}``; dirty when tracked files under ``paths``
    differ from it (``describe`` is ``short`` plus ``+dirty`` then). None outside a git checkout."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

        sha = git("rev-parse", "HEAD")
        short = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", *paths))
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"sha": sha, "short": short, "dirty": dirty, "describe": short + ("+dirty" if dirty else "")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(**extra: Any) -> dict:
    """The machine as far as this process can see it: CPU model, cores (and how many this process may use),
    memory, OS, Python, torch, DeepSpeed; ``extra`` adds what only the workers know (threads per rank, ...)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    info = {"cpus": os.cpu_count(), "cpus_usable": usable, "cpu": _cpu_model(), "memory_gib": _memory_gib(),
            "platform": platform.platform(), "python": sys.version.split()[0],
            "torch": _version("torch"), "deepspeed": _version("deepspeed")}
    info.update(extra)
    return info


def write_report(report: dict, path: Path, *, machine: dict | None = None) -> Path:
    """Add ``command``, ``git`` (short sha, ``+dirty``), ``commit`` (:func:`git_commit`) and ``machine`` to
    ``report`` (keys it already has stay) and write it as JSON to ``path``; return the path."""
    commit = git_commit()
    report.setdefault("command", " ".join([Path(sys.executable).name, *sys.argv]))
    report.setdefault("git", commit["describe"] if commit else None)
    report.setdefault("commit", commit)
    report.setdefault("machine", machine if machine is not None else machine_info())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path


def write_ranks_report(report: dict, name: str, json_path: str | None, ranks: Sequence[dict]) -> Path:
    """:func:`write_report` at ``json_path`` (default: ``results/<name>.json``) with the machine the worker ranks
    measured on (their torch and DeepSpeed, one pinned core each); prints the path."""
    machine = machine_info(torch=ranks[0]["torch"], deepspeed=ranks[0]["deepspeed"], threads_per_rank=1,
                           cores_pinned=True)
    path = write_report(report, Path(json_path) if json_path else results_path(name), machine=machine)
    print(f"report: {path}")
    return path


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark script's argument parser: its docstring's first line as the description."""
    return argparse.ArgumentParser(description=doc.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def chosen_variants(ap: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    """``--variants``' comma-separated names, each one of ``known`` (else the parser's error, listing them)."""
    variants = [v.strip() for v in text.split(",")]
    unknown = [v for v in variants if v not in known]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(known)}")
    return variants
