"""Tier a: the documents and the code speak of the project only, and the documents say what the code does.

README, docs/ and the code describe the project as it is: no issue numbers (the tracker's history belongs in git),
and no pointer to a file outside the repository (a reader of a clone has only what it holds). Their relative links
lead to files (and headings) that exist. What a reader copies from the documents is checked against the code: the
README's key table against the config model, every `"terapipe"` section shown, the `ds_terapipe.*` names (also
those a `from ds_terapipe... import` line imports) and the repository's files named, the options given to a script or
`ds-terapipe`, what `ds-terapipe` prints in a console block, docs/sharding.md's gathers per step against the
lowering, README's GPU table, the docs' CPU speedup tables and every table headed as a committed report's table
against the reports, and the error messages docs/errors.md quotes against the package's source.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\bissues?[- ]?#?\d+", re.IGNORECASE)
# documents a reader is pointed to that are not in the repository
OUTSIDE = re.compile(r"\bDESIGN\.md\b|\bSTYLE\.md\b|\.\./shared\b")


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _texts() -> list[Path]:
    files = _documents()
    for folder in ("ds_terapipe", "benchmarks", "examples", "tests"):
        files += [p for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__).resolve()]
    return files


@pytest.mark.parametrize("pattern", [ISSUE, OUTSIDE], ids=["issue numbers", "files outside the repository"])
def test_documents_and_code_speak_of_the_project_only(pattern: re.Pattern) -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for path in _texts()
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_patterns_catch_what_they_are_for() -> None:
    assert ISSUE.search("the floor (issue 16)") and ISSUE.search("Issue-13's item") and ISSUE.search("issue #7")
    assert not ISSUE.search("an issue the planner has") and not ISSUE.search("DeepSpeed #3195")
    assert OUTSIDE.search("see DESIGN.md") and OUTSIDE.search("../shared/gpu") and not OUTSIDE.search("docs/design.md")


# a markdown link or image: [text](target) / ![alt](target)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The numbered lines outside fenced code blocks (a link inside one is an example, not a link)."""
    lines, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((n, line))
    return lines


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for _, line in _prose(path) if re.match(r"#{1,6} ", line)}


def _broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for n, line in _prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not a file of the repository
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(root)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(root)}:{n}: {target} (no such heading)")
    return broken


def test_relative_links_in_readme_and_docs_resolve() -> None:
    broken = [b for path in _documents() for b in _broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_what_it_is_for(tmp_path: Path) -> None:
    assert _slug('Repacking (`"freeze": {..., "repack": true}`)') == "repacking-freeze--repack-true"
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](page.md#a-page) [gone](missing.md) [no heading](#b-page) "
                    "![img](missing.png) [web](https://example.org)\n```\n[example](not_checked.md)\n```\n")
    assert [b.split(": ", 1)[1] for b in _broken_links(page, root=tmp_path)] == [
        "missing.md (no such file)", "#b-page (no such heading)", "missing.png (no such file)"]


# -- what the documents name and quote is what the code has ----------------------------------------------------------
def _fenced(path: Path, language: str) -> list[tuple[int, str]]:
    """The ```language blocks of a page: (first line's number, text)."""
    text = path.read_text(encoding="utf-8")
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(rf"^```{language}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


def _table(text: str, header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header line starts with ``header``, as stripped cells."""
    lines = text.split("\n" + header, 1)[1].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _readme_key_drift(readme: str) -> list[str]:
    from ds_terapipe.config_doc import render_config_table

    defaults = {key.strip("`"): default for key, default, _ in _table("\n" + render_config_table(), "| key |")}
    drift = []
    for key, default, _ in _table(readme, "| key | default | meaning |"):
        key = key.strip("`")
        name = key.removesuffix(".*")
        section = any(other.startswith(name + ".") for other in defaults)
        if name not in defaults:
            drift.append(f"{key}: not a key of the config model")
        elif key.endswith(".*") != section:
            drift.append(f"{key}: write a section as `name.*` and only a section")
        elif not section and not defaults[name].startswith(default):
            drift.append(f"{key}: default {default} here, {defaults[name]} in the model")
    return drift


def test_readme_key_table_names_config_keys_with_their_defaults() -> None:
    """README's short key table is hand-written: each key is the model's, each default the model's (or its start)."""
    drift = _readme_key_drift((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not drift, "README.md's key table differs from ds_terapipe/config.py:\n" + "\n".join(drift)


def test_the_key_table_check_catches_what_it_is_for() -> None:
    readme = "| key | default | meaning |\n| --- | --- | --- |\n" + "\n".join([
        "| `granularity` | `16` | x |", "| `granularty` | `8` | x |", "| `profile` | | x |", "| `seq_len.*` | | x |",
        "| `virtual_stages` | the schedule's | x |", "| `freeze.*` | none | x |"]) + "\n\nprose"
    assert [d.split(":")[0] for d in _readme_key_drift("\n" + readme)] == [
        "granularity", "granularty", "profile", "seq_len.*"]


def test_terapipe_sections_shown_in_the_documents_are_valid() -> None:
    """Every ```json block showing a "terapipe" section is a config the model accepts."""
    from ds_terapipe import parse_terapipe_config

    shown = [(path, n, block) for path in _documents() for n, block in _fenced(path, "json") if '"terapipe"' in block]
    assert len(shown) >= 4
    for path, n, block in shown:
        try:
            parse_terapipe_config(json.loads("{" + block + "}"))
        except ValueError as err:
            raise AssertionError(f"{path.relative_to(ROOT)}:{n}: {err}") from None


def _unresolved_names(text: str) -> list[str]:
    """``ds_terapipe.a.b.c`` names in ``text``, and the names a ``from ds_terapipe.a import b, c`` line imports, that
    neither import nor are attributes of what imports."""
    names = set(re.findall(r"\bds_terapipe(?:\.[A-Za-z_]\w*)+", text))
    for module, imported in re.findall(r"^\s*from (ds_terapipe(?:\.\w+)*) import ([\w, ]+)", text, re.MULTILINE):
        names |= {f"{module}.{name.split(' as ')[0].strip()}" for name in imported.split(",") if name.strip()}
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            missing.append(name)
    return missing


# where a path the documents give starts: the repository's root, the package, the runtime, the benchmarks
BASES = (ROOT, ROOT / "ds_terapipe", ROOT / "ds_terapipe" / "runtime", ROOT / "benchmarks")


def _missing_files(text: str, bases: tuple[Path, ...] = BASES) -> list[str]:
    """Backticked paths (`runtime/features/freeze.py`, `tests/test_x.py`) under a folder of the repository that are
    not there; a path whose first folder is none of the repository's (another project's file) is not checked."""
    return [file for file in re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|json|md|sh|png))`", text)
            if any((base / file.split("/")[0]).is_dir() for base in bases)
            and not any((base / file).exists() for base in bases)]


def test_names_and_files_the_documents_give_exist() -> None:
    """`ds_terapipe.x.y` names resolve, and the repository's files the documents name are there."""
    bad = []
    for path in _documents():
        text = path.read_text(encoding="utf-8")
        bad += [f"{path.relative_to(ROOT)}: {name}" for name in _unresolved_names(text)]
        bad += [f"{path.relative_to(ROOT)}: {file} (no such file)" for file in _missing_files(text)]
    assert not bad, "\n".join(bad)


def test_the_name_check_catches_what_it_is_for() -> None:
    text = "ds_terapipe.initialize, ds_terapipe.planner.sharding.shard_counts, ds_terapipe.initialise, " \
           "ds_terapipe.planner.shardng.x\n" \
           "from ds_terapipe.models.gpt import GPTConfig, gpt_layer_spec  # a comment\n" \
           "from ds_terapipe import initialize as init, Freezr"
    assert _unresolved_names(text) == ["ds_terapipe.Freezr", "ds_terapipe.initialise",
                                       "ds_terapipe.models.gpt.gpt_layer_spec", "ds_terapipe.planner.shardng.x"]
    files = "`runtime/features/freeze.py` `runtime/features/frozen.py` `tests/test_docs.py` `planner/lowering.py` " \
            "`ds_configs/cpu_2stage.json` `ds_configs/cpu_2stages.json` `pipeline_parallel/schedules.py`"
    assert _missing_files(files) == ["runtime/features/frozen.py", "ds_configs/cpu_2stages.json"]


# a command the documents give: the script (or ds-terapipe subcommand) and what follows it on the line
COMMAND = re.compile(r"((?:benchmarks|examples)/\w+\.py|ds-terapipe (?:plan|simulate|compare|schedules|presets))"
                     r"([^`\n]*)")


def _script_flags(script: str) -> set[str]:
    """The options a script of the repository defines: its own and those of its folder's helpers."""
    if script.startswith("ds-terapipe"):
        from ds_terapipe.cli import build_parser

        subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        return set(subparsers.choices[script.split()[1]]._option_string_actions)
    folder = ROOT / script.split("/")[0]
    sources = [ROOT / script, *folder.glob("*.py"), *folder.glob("benchlib/*.py")]
    return {"--deepspeed_config"} | {flag for source in sources
                                     for flag in re.findall(r"""["'](--[a-z][\w-]*)["']""", source.read_text())}


def _unknown_flags(text: str) -> list[str]:
    unknown = []
    for script, rest in COMMAND.findall(text.replace("\\\n", " ")):
        rest = re.split(r"[`);]", rest)[0]
        unknown += [f"{script} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)
                    if flag not in _script_flags(script)]
    return unknown


def test_the_options_the_documents_give_exist() -> None:
    unknown = [f"{path.relative_to(ROOT)}: {u}" for path in _documents()
               for u in _unknown_flags(path.read_text(encoding="utf-8"))]
    assert not unknown, "options no script defines:\n" + "\n".join(unknown)


def test_the_option_check_catches_what_it_is_for() -> None:
    text = ("`ds-terapipe plan --model gpt3-1b --seq-len 2048 --stage 2` and\n"
            "deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config c.json --steps 6 \\\n    --bind-core\n"
            "`python benchmarks/pipeline_speedup.py --quick`")
    assert _unknown_flags(text) == ["ds-terapipe plan --stage", "examples/train_gpt.py --bind-core"]


def _console_drift(path: Path) -> list[str]:
    """Each `$ ds-terapipe ...` block's output lines (bar `...` and the planning time) are, in order, lines the
    command prints now."""
    from ds_terapipe.cli import main

    drift = []
    for n, block in _fenced(path, "console"):
        command, *shown = block.replace("\\\n", " ").splitlines()
        assert command.startswith("$ ds-terapipe "), f"{path.name}:{n}: {command}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(command.split()[2:]) == 0
        printed = iter(line.rstrip() for line in out.getvalue().splitlines())
        for line in shown:
            if line.strip() != "..." and not line.startswith("planned in") and line.rstrip() not in printed:
                drift.append(f"{path.name}:{n}: `{command[2:]}` no longer prints {line.strip()!r}")
                break
    return drift


# the pages with a ```console block: every one is checked, these two at least
CONSOLE_PAGES = [path for path in _documents() if "```console\n" in path.read_text(encoding="utf-8")]


def test_the_console_pages_are_found() -> None:
    assert {"planning.md", "gpus.md"} <= {path.name for path in CONSOLE_PAGES}


@pytest.mark.parametrize("page", CONSOLE_PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_command_lines_shown_in_the_documents_print_what_they_show(page: Path) -> None:
    drift = _console_drift(page)
    assert not drift, "\n".join(drift) + "\n(run the command and paste what it prints)"


def test_the_console_check_catches_what_it_is_for(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```console\n$ ds-terapipe plan --model gpt3-175b --device h100 --stages 8 --seq-len 2048\n...\n"
                    "slices:      7 of granularity 8: 4x296 3x288\nplanned in 9 s\n```\n"
                    "```console\n$ ds-terapipe plan --model gpt3-175b --device h100 --stages 8 --seq-len 2048\n"
                    "slices:      6 of granularity 8: 4x296 3x288\n```\n")
    assert [d.split(": ", 1)[0] for d in _console_drift(page)] == ["page.md:8"]


def _sharding_table_drift(text: str) -> list[str]:
    """docs/sharding.md's gathers and reduce-scatters per rank and step (2 ranks, 2 slices) against the lowering."""
    from ds_terapipe.planner.lowering import lower
    from ds_terapipe.planner.registry import get_schedule
    from ds_terapipe.planner.sharding import shard_counts

    drift = []
    for names, gathers, scatters in _table(text, "| schedule | gathers per step | reduce-scatters per step |"):
        ms = [int(m) for m in re.findall(r"\d+", names.split("m =")[1])] if "m =" in names else [2, 4, 8]
        for name in re.findall(r"`([\w-]+)`", names):
            shown = [re.findall(r"\d+(?:-\d+)?", column.split("/")[i] if "/" in column else column)[0]
                     for column in (gathers, scatters) for i in range(len(ms))]
            counts = [shard_counts(lower(name, 2, m, 2, virtual_stages=get_schedule(name).virtual_stages,
                                         shard_params=True)) for m in ms]
            actual = [_span([c[k] for c in per_m]) for k in (0, 1) for per_m in counts]
            if shown != actual:
                drift.append(f"{name} at m = {ms}: shown {shown}, lowered {actual} (gathers, then reduce-scatters)")
    return drift


def _span(values: list[int]) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def test_sharding_counts_table_is_the_lowered_schedules() -> None:
    drift = _sharding_table_drift((ROOT / "docs" / "sharding.md").read_text(encoding="utf-8"))
    assert not drift, "docs/sharding.md's table of gathers differs from planner/sharding.shard_counts:\n" + \
        "\n".join(drift)


def test_the_sharding_table_check_catches_what_it_is_for() -> None:
    header = "| schedule | gathers per step | reduce-scatters per step |\n| --- | --- | --- |\n"
    good = header + "| `looped-bfs` (v = 2) | 3, whatever m | 2 |\n| `gpipe`, `1f1b` | 1 (whole) | 1 |\n"
    assert _sharding_table_drift("\n" + good) == []
    bad = header + "| `dualpipev`, m = 2 / 4 / 8 | 7-13 / 11-25 / 19-49 | 4-8 / 8-16 / 16-32 |\n"
    assert len(_sharding_table_drift("\n" + bad)) == 1


def _gpu_rows(report: dict) -> list[str]:
    """README's GPU table as the committed gpu_slices.py report gives it (the 175B-shaped layer)."""
    shape = "gpt3-175b-x1"
    total = {(r["n"], r["variant"]): r["total_ms"] for r in report["shapes"][shape]["rows"]}
    checks = {(c["n"], c["variant"], c["what"]): c for c in report["checks"] if c["shape"] == shape}
    rows = []
    for n in (1, 2, 4, 8, 16):
        cells = [f"{total[n, v]:.1f} / {checks[n, v, 'profile-predicted micro-batch']['predicted_ms']:.1f}"
                 for v in ("in-gemm", "unsynced", "fused")]
        rows.append(f"| {n} | {' | '.join(cells)} | {checks[n, 'fused', 'W(n)/W(1)']['ratio']:.2f} |")
    return rows


def test_readme_gpu_table_is_the_committed_report() -> None:
    report = json.loads((ROOT / "benchmarks" / "results" / "gpu_slices.json").read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    stale = [row for row in _gpu_rows(report) if row not in readme]
    assert not stale, "README.md's GPU table differs from benchmarks/results/gpu_slices.json; its rows are:\n" + \
        "\n".join(_gpu_rows(report))


SPEEDUP_HEADER = "| m | variant | slices | step ms | speedup vs stock |"


def _speedup_drift(report_table: str, full: str, summary: str) -> list[str]:
    """docs/performance.md's table holds every row of the committed pipeline_speedup.py report; the rows of
    docs/performance_summary.md's shorter table give that report's slices, step, speedup, efficiency and memory."""
    lines = report_table.splitlines()
    first = lines[2:next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]  # 1st table
    drift = [f"performance.md lacks the report's row {row}" for row in first if row not in full]
    rows = {(cells[0], cells[1]): cells for cells in _table("\n" + report_table, "| m | variant |")}
    for m, variant, slices, step, speedup, eff, _, act, peak in _table(summary, SPEEDUP_HEADER):
        name = re.sub(r"\s*\(.*?\)", "", variant).replace("auto, ", "auto/")   # "auto, gpipe (...)": auto/gpipe
        want = rows.get((m, name))
        shown = [slices, step, speedup.strip("*"), eff, act, peak]
        if want is None or shown != [want[2], want[3], want[4], want[6], want[11], want[12]]:
            drift.append(f"performance_summary.md m = {m} {variant}: {shown}, the report {want and want[2:13]}")
    return drift


def test_pipeline_speedup_tables_are_the_committed_report() -> None:
    report = json.loads((ROOT / "benchmarks" / "results" / "pipeline_speedup.json").read_text(encoding="utf-8"))
    docs = ROOT / "docs"
    drift = _speedup_drift(report["table"], (docs / "performance.md").read_text(encoding="utf-8"),
                           (docs / "performance_summary.md").read_text(encoding="utf-8"))
    assert not drift, "the speedup tables differ from benchmarks/results/pipeline_speedup.json's table:\n" + \
        "\n".join(drift)


def test_the_speedup_check_catches_what_it_is_for() -> None:
    report = ("| m | variant | slices | step ms | speedup | bound ms | eff | pred ms | pred err | re-prof ms | "
              "re-prof err | act MiB s0/s1 | peak MiB s0/s1 | rounds |\n|---|\n"
              "| 1 | stock | 1 | 3631 | 1.00x | 1721 | 47% | - | - | - | - | 128/133 | 142/141 | 7 |\n"
              "| 1 | auto/gpipe | 5 | 2269 | 1.60x | 1920 | 84% | 2324 | +2.4% | 2157 | -4.9% | 156/157 | 169/134 "
              "| 7 |")
    summary = (SPEEDUP_HEADER + " efficiency | planner error | activations | peak |\n|---|\n"
               "| 1 | stock | 1 | 3631 | 1.00x | 47% | - | 128/133 | 142/141 |\n"
               "| 1 | auto, gpipe (deferred W) | 5 | 2269 | **1.60x** | 84% | +2% | 156/157 | 169/134 |\n")
    assert _speedup_drift(report, report, "\n" + summary) == []
    assert len(_speedup_drift(report, report.replace("| 2269 |", "| 2296 |"), "\n" + summary)) == 1
    assert len(_speedup_drift(report, report, "\n" + summary.replace("| 84% |", "| 85% |"))) == 1
    assert len(_speedup_drift(report, report, "\n" + summary.replace("auto, gpipe", "auto, gpipf"))) == 1


def _report_tables() -> dict[str, list[str]]:
    """The markdown table of each committed report that prints one (its ``table``), by the report's file name."""
    tables = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        table = json.loads(path.read_text(encoding="utf-8")).get("table")
        if table:
            tables[path.name] = table if isinstance(table, list) else table.splitlines()
    return tables


def _numbers(row: str) -> tuple[str, ...]:
    """A table row's cells that hold numbers, bold dropped; a cell with a word in it (a variant's name, which a page
    may spell its own way) is left out."""
    cells = [cell.strip().replace("*", "") for cell in row.strip().strip("|").split("|")]
    return tuple(cell for cell in cells if re.search(r"\d", cell) and not re.search(r"[A-Za-z]{2}", cell))


def _report_table_drift(text: str, reports: dict[str, list[str]]) -> tuple[int, list[str]]:
    """How many tables of ``text`` are headed as a report's table, and which of them show a row whose numbers are not,
    in the page's order, those of a row of one such report."""
    lines, found, drift = text.splitlines(), 0, []
    for n, line in enumerate(lines):
        names = [name for name, table in reports.items() if table[0] == line]
        if not names:
            continue
        found += 1
        rows = []
        for row in lines[n + 2:]:
            if not row.startswith("|"):
                break
            rows.append(row)
        stray = []
        for name in names:
            left = iter(_numbers(row) for row in reports[name][2:])   # each row matched once, in the page's order
            stray.append([row for row in rows if not any(_numbers(row) == numbers for numbers in left)])
        if all(stray):
            drift.append(f"line {n + 1}: a table of {' or '.join(names)} shows {min(stray, key=len)[0]!r}, "
                         "not a row of the report")
    return found, drift


def test_tables_headed_as_a_committed_report_show_its_rows() -> None:
    """A table a page copies from a benchmark's report (same header) shows that report's numbers, row by row."""
    reports, found, drift = _report_tables(), 0, []
    for path in _documents():
        count, stale = _report_table_drift(path.read_text(encoding="utf-8"), reports)
        found += count
        drift += [f"{path.relative_to(ROOT)}: {d}" for d in stale]
    assert found >= 7, found   # the pages' report tables were found
    assert not drift, "tables that differ from the committed report they copy (copy its rows again):\n" + \
        "\n".join(drift)


def test_the_report_table_check_catches_what_it_is_for() -> None:
    header = "| m | variant | step s | vs stock | MiB stage 0 / 1 |"
    reports = {"a.json": [header, "|---|", "| 1 | deepspeed uniform | 1.06 | 1.00x | 74+74 / 68+68 |",
                          "| 1 | token: vocab parallel | 0.71 | 1.49x | 39+39 / 38+38 |",
                          "| 4 | token: vocab parallel | 2.65 | 1.30x | 39+39 / 38+38 |"]}
    page = (f"prose\n{header}\n|---|\n| 1 | DeepSpeed 1F1B uniform | 1.06 | 1.00x | 74+74 / 68+68 |\n"
            "| 4 | token, vocab parallel | **2.65** | **1.30x** | 39+39 / 38+38 |\n\n| 9 | not | a | table | row |\n")
    assert _report_table_drift(page, reports) == (1, [])
    assert _report_table_drift(page.replace("**2.65**", "2.56"), reports)[1] == [
        "line 2: a table of a.json shows '| 4 | token, vocab parallel | 2.56 | **1.30x** | 39+39 / 38+38 |', "
        "not a row of the report"]
    assert len(_report_table_drift(page.replace("| 1 | DeepSpeed", "| 9 | DeepSpeed"), reports)[1]) == 1   # m
    rows = page.split("\n")
    assert len(_report_table_drift("\n".join([*rows[:3], rows[4], rows[3], *rows[5:]]), reports)[1]) == 1   # order


def _log_patterns() -> list[re.Pattern]:
    """The package's `terapipe: ...` messages as patterns: each %-placeholder stands for any text."""
    constants = (node.value for path in (ROOT / "ds_terapipe").rglob("*.py")
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Constant))
    formats = {value for value in constants if isinstance(value, str) and value.startswith("terapipe: ")}
    return [re.compile(re.sub(r"%(?:\\\.)?\d*[sdrfgx]", ".*?", re.escape(f)) + "$") for f in formats]


def _unlogged(text: str, patterns: list[re.Pattern]) -> list[str]:
    """Lines of `text` that show a `terapipe: ` log line no message of the package prints."""
    return [line for line in text.splitlines()
            if line.startswith("terapipe: ") and not any(p.match(line) for p in patterns)]


def test_log_lines_shown_in_the_documents_are_the_packages_messages() -> None:
    patterns = _log_patterns()
    stale = [f"{path.relative_to(ROOT)}: {line[:120]}" for path in _documents()
             for line in _unlogged(path.read_text(encoding="utf-8"), patterns)]
    assert not stale, "log lines the package no longer prints (run the command and paste its output):\n" + \
        "\n".join(stale)


def test_the_log_line_check_catches_what_it_is_for() -> None:
    text = "terapipe: profiled 2 chunk(s) in 35.2s\nterapipe: profiled 2 stage(s) in 35.2s\nterapipe is a word"
    assert _unlogged(text, _log_patterns()) == ["terapipe: profiled 2 stage(s) in 35.2s"]


# -- docs/errors.md quotes the messages the code raises --------------------------------------------------------------
ERRORS_HEADER = "| the message starts with |"
# where the quoted messages come from: the package, and the test launcher's watchdog the page explains
MESSAGE_SOURCES = (*sorted((ROOT / "ds_terapipe").rglob("*.py")), ROOT / "tests" / "dist_worker.py")


def _source_strings(paths: tuple[Path, ...]) -> list[str]:
    """Every string literal of ``paths`` but docstrings, an f-string's replacement fields written `…` (a run of them
    as one; a module's own string constant, such as ``TERAPIPE_KEY``, as its value)."""
    strings = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {node.targets[0].id: node.value.value for node in tree.body
                     if isinstance(node, ast.Assign) and [type(target) for target in node.targets] == [ast.Name]
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
        skip = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}   # docstrings
        skip |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}

        def field(part: ast.FormattedValue) -> str:
            if isinstance(part.value, ast.Name) and part.value.id in constants and part.format_spec is None:
                value = constants[part.value.id]
                return repr(value) if part.conversion == ord("r") else value if part.conversion == -1 else "…"
            return "…"

        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(part.value if isinstance(part, ast.Constant) else field(part) for part in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                text = node.value
            else:
                continue
            strings.append(re.sub("…+", "…", text))
    return strings


def _error_quotes(text: str) -> list[str]:
    """The first column's quote of every row of the page's tables headed ``| the message starts with |``."""
    quotes = []
    for table in text.split("\n" + ERRORS_HEADER)[1:]:
        for line in table.splitlines()[2:]:
            if not line.startswith("|"):
                break
            quotes += re.findall(r"`([^`]+)`", line.strip("|").split("|")[0])[:1]
    return quotes


def _unquoted_messages(quotes: list[str], strings: list[str]) -> list[str]:
    """Quotes no source string starts with; a quote that starts with `…` (the message's start is filled in) is looked
    for anywhere in a string."""
    return [quote for quote in quotes
            if not any(quote[1:] in s if quote.startswith("…") else s.startswith(quote) for s in strings)]


def test_the_messages_docs_errors_quotes_are_the_packages() -> None:
    quotes = _error_quotes((ROOT / "docs" / "errors.md").read_text(encoding="utf-8"))
    assert len(quotes) >= 50, quotes   # every table was read
    missing = _unquoted_messages(quotes, _source_strings(MESSAGE_SOURCES))
    assert not missing, "docs/errors.md quotes messages the code no longer has (copy them from the code):\n" + \
        "\n".join(missing)


def test_the_error_quote_check_catches_what_it_is_for(tmp_path: Path) -> None:
    source = tmp_path / "source.py"
    source.write_text('KEY = "terapipe"\n\n\ndef f(x, n):\n    """terapipe: a docstring is no message."""\n'
                      '    raise ValueError(f"{KEY}.slices={x!r} must be " f"{n}{n} or more; set it")\n\n\n'
                      'def g(where):\n    return f"{KEY!r}: {where}: layer {where} gives different outputs"\n')
    strings = _source_strings((source, ))
    assert "terapipe.slices=… must be … or more; set it" in strings
    assert "'terapipe': …: layer … gives different outputs" in strings
    page = (f"\n{ERRORS_HEADER} meaning |\n| --- | --- |\n| `terapipe.slices=… must be … or more` | x |\n"
            "| `terapipe.slices=… must be at least` | x |\n| `…layer … gives different outputs` | x |\n"
            "| `…layer … gives other outputs` | x |\n\nprose `not a quote`\n"
            f"{ERRORS_HEADER} meaning |\n| --- | --- |\n| `terapipe: a docstring is no message.` | x |\n")
    quotes = _error_quotes(page)
    assert len(quotes) == 5 and "not a quote" not in quotes
    assert _unquoted_messages(quotes, strings) == [
        "terapipe.slices=… must be at least", "…layer … gives other outputs", "terapipe: a docstring is no message."]
