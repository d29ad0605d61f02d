"""README's figure tables, rendered from the benchmark records in bench/results/.

  python -m bench.tables            rewrite every marked block of README.md from its record
  python -m bench.tables --check    exit 1 naming each block that differs from its rendering

A block lies between `<!-- figures: NAME ... -->` and `<!-- /figures -->`; each NAME is the stem
of a record, bench/results/NAME.json (the step table names three). bench.step records named
STEM-COMMIT and STEM, in pairs, render as before (at that commit) and after. The benchmark that wrote the
record (its `command`) picks the table (bench/figures.py); every number comes from the record,
rounded as stated at each table. README quotes a few records in its prose only: PROSE_ONLY
names them and why.

Bad input (a record that does not exist or holds a failed case, a marker never closed, a README
without any marker) is one `error:` line and exit code 2; README is then left as it was.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from bench.figures import (context_table, gpu_compile_table, gpu_table, moe_table, pipeline_table, step_change_table,
                           step_table, tp_table, tune_table)
from cli import run_cli
from configs import ConfigError
from configs.parser import Parser

README = Path(__file__).resolve().parents[1] / "README.md"
OPEN = re.compile(r"<!-- figures: ([\w. -]+?) -->")
CLOSE = "<!-- /figures -->"
# records README names outside any table, and why they have none
PROSE_ONLY = {
    "checkpoint-125m-fsdp2": "a few save, restore and step figures, quoted in sentences",
    "attention-cpu-interpret-smoke": "a smoke run on tiny shapes: README quotes no figure of it",
    "collectives-cpu-smoke": "a smoke run: README describes its table's layout and trend in words",
    "gpu-cpu-smoke": "a smoke run of the GPU check on CPU: README quotes no figure of it",
    "moe-h100-1gpu": "one GPU at ep=1, quoted in a sentence: its table would hold one row",
    "expert-matmul-mixtral-h100-compiled": "deviceless compiles: README's table of it is written by hand, with the prose",
    "remat-full-dp-lhs-h100-compiled": "XLA GPU's compiled peak of 125m under remat full beside a data axis, "
                                       "quoted in sentences in the planner's memory paragraph",
    "lhs-off-h100-compiled": "XLA GPU's compiled peak with its latency-hiding scheduler on, off and limited, beside "
                             "the estimate: README's table of it is written by hand, with the prose",
    "search-1b-h100-compiled": "the top meshes of a search compiled for H100s, and the fsdp census and peak of "
                               "unrolled layers under remat none before and after the estimate counted their kept "
                               "gathers, quoted in sentences in the planner's memory paragraph",
    "gpipe-head-h100-compiled": "XLA GPU's compiled peak of gpipe and interleaved steps and the estimate before and "
                                "after their head and weights changed, quoted as ranges in the planner's memory paragraph",
    "gpipe-head-dealt-h100-compiled": "XLA GPU's compiled peak and stage census of gpipe and interleaved steps before "
                                      "and after their head was dealt out over the stages, with a CPU cost analysis "
                                      "and bench.pipeline rounds; README's table of it is written by hand",
    "embedding-in-f-cell-h100-compiled": "XLA GPU's tensor census of 1F1B-family steps before and after their "
                                         "embedding lookup moved into the F cell, quoted in one sentence of ratios",
    "embedding-backward-m-ticks-h100-compiled": "XLA GPU's tensor and sequence census of 1F1B-family steps before "
                                                "and after their embedding backward left the ticks that do not need "
                                                "it, quoted in one sentence of ratios",
    "pipeline-permutes-moving-ticks-h100-compiled": "XLA GPU's stage census of 1F1B-family steps before and after "
                                                    "their permutes left the ticks that move nothing, quoted in one "
                                                    "sentence of ratios",
    "tables-over-stage-h100-compiled": "XLA GPU's compiled peak and census of pipelined steps before and after the "
                                       "embedding and head were split over stage, and the estimate; README's table "
                                       "of it is written by hand",
    "head-over-stages-h100-compiled": "XLA GPU's census, peak and the planner's bubble and step of 1F1B-family "
                                      "steps before and after their head ran over the stages; README quotes its "
                                      "ratios in prose",
    "head-columns-h100-compiled": "XLA GPU's compiled peak and census of 1F1B-family steps before and after each "
                                  "stage took only its columns of the head, and the estimate; README's table of it "
                                  "is written by hand",
    "eval-region-h100-compiled": "XLA GPU's census and temp bytes of the pipelined evaluation step before and after "
                                 "it ran in the training step's region; README quotes its ratios in prose",
    "circular-stash-h100-compiled": "XLA GPU's compiled peak of gpipe and interleaved steps and the estimate before "
                                    "and after their ticks ran in a checkpoint; README's table of it is written by hand",
    "circular-fp32-sum-h100-compiled": "XLA GPU's compiled peak of gpipe and interleaved steps before and after they "
                                       "summed their layers' gradients in fp32, and the estimate; README's table of it "
                                       "is written by hand",
    "ring-home-cast-h100-compiled": "XLA GPU's census of the context-parallel ring before and after it cast dK and "
                                    "dV for their last send, quoted as ratios in the census notes",
    "memory-cast-h100-compiled": "the estimate against XLA GPU's compiled peak before and after the 1F1B family's "
                                 "cast weights were counted, quoted as ranges in the planner's memory paragraph",
    "scan-vs-unrolled-nvidia-h100-80gb-hbm3-20261126": "an inline script's twelve cases on one GPU, quoted in "
                                                       "sentences beside the gpu-check record of that session",
    "gpu-nvidia-h100-80gb-hbm3-20261126-second": "a second gpu-check on the same day and card, quoted as the "
                                                 "differences from the first, whose table README shows",
    "batch-1b-nvidia-h100-80gb-hbm3-20261126": "bench.step runs of 1b at nine micro batches and cores, "
                                               "quoted in sentences",
    "memory-terms-1b-h100-compiled": "XLA GPU's compiled memory per token and layer, quoted in the memory "
                                     "model's paragraph",
    "pipeline-memory-125m-h100-compiled": "XLA GPU's compiled memory of pipelined steps before and after a "
                                          "change, quoted in the planner's pipeline paragraph",
    "pipeline-memory-125m-h100-cell-groups": "the same before and after the tick's cells ran as one switch per "
                                             "group, quoted in the planner's pipeline paragraph",
    "pipeline-memory-125m-h100-split-map": "the same for zb-h1 before and after its backward split shard_map "
                                           "regions, quoted in the planner's pipeline paragraph",
    "pipeline-memory-125m-h100-zbv": "zbv beside zb-h1, XLA GPU's compiled memory and the estimate, quoted in "
                                     "the planner's pipeline paragraph",
    "pipeline-context-h100-compiled": "XLA GPU's collective census of pipelines beside context parallelism before "
                                      "and after their engine took the batch axes; README's table of it is written "
                                      "by hand",
    "moe-accumulation-expert-h100-compiled": "XLA GPU's collective census of MoE steps with accumulation before and after "
                                             "their region was manual over expert too; README's table of it is "
                                             "written by hand",
    "pipeline-experts-h100-compiled": "XLA GPU's collective census of MoE pipelines before and after their engine "
                                      "took the batch axes; README's table of it is written by hand",
    "census-pipelines-h100-compiled": "XLA GPU's collective census of pipelined steps beside the contract, "
                                      "typed into the census table's pipeline rows and its paragraph",
    "gpipe-memory-125m-h100-compiled": "gpipe's and interleaved's compiled memory beside the estimate before and "
                                       "after its tick scan's residuals counted twice, quoted in the planner's "
                                       "pipeline paragraph",
    "remat-full-1f1b-family": "the 1F1B family's remat full before and after its chunks kept their layers' "
                              "inputs: a CPU step ratio and H100 compiles, quoted in the pipeline paragraphs",
    "remat-unrolled-1b-h100-compiled": "XLA GPU's compiled memory of unrolled layers before and after their "
                                       "checkpoints prevented CSE, quoted in sentences",
    "fsdp-tp-remat-h100-compiled": "ZeRO-3 beside explicit TP under remat, the census and XLA's memory before "
                                   "and after the regions' weights were gathered inside the checkpoint, quoted "
                                   "in the tensor-parallelism paragraph",
    "remat-dots-tensor-h100-compiled": "the tensor census under remat dots and attn before and after dots kept "
                                       "the row-parallel regions' sums, quoted in the census findings",
    "census-sweep-125m-h100-compiled": "every strategy's census over its contract after the census fixes, "
                                       "H100 compiles, quoted in the census section",
    "census-sweep-llama3-h100-compiled": "the same sweep for llama3-8b and mixtral-8x7b after the head and "
                                         "accumulation fixes, quoted in the census section",
    "accumulation-tensor-h100-compiled": "FSDP's by-hand gathers and reductions beside tensor parallelism before "
                                         "and after they ran on each tensor shard, quoted in the pipeline "
                                         "paragraph and sharding/accumulation.py",
    "pipeline-engine-h100-compiled": "gpipe's and interleaved's census and XLA's memory before and after they "
                                     "moved into the schedules' shared region, quoted in the pipeline paragraph",
    "pipelined-all-gather-sp-h100-compiled": "the census and XLA's memory under sequence parallelism with XLA's "
                                             "all-gather pipeliner on and off, quoted in the XLA flags paragraph",
    "fsdp-tp-remat-scan-h100-compiled": "the same in the layer scan, before and after the forward-only "
                                        "constraint was set there too, quoted in the tensor-parallelism "
                                        "paragraph",
    "context-accumulation-h100-compiled": "the gradient all-reduce under context parallelism with accumulation "
                                          "before and after the step's region was manual over sequence, quoted "
                                          "in the context-parallelism paragraph",
    "head-gather-fsdp-tp-h100-compiled": "the head's fsdp gathers beside explicit TP before and after it was "
                                         "gathered before its region, quoted in the tensor-parallelism "
                                         "paragraph",
    "pipeline-layout-h100-compiled": "the stage census before and after the layers were laid out by hand "
                                     "(pipeline/layout.py), H100 compiles and CPU, quoted in the pipeline "
                                     "paragraphs and the census table's interleaved row",
    "embedding-grad-1f1b": "the 1F1B family's embedding backward before and after it scattered into the fp32 "
                           "accumulator in place: CPU step ratios, H100 compiles and an estimate, quoted in the "
                           "pipeline paragraph",
    "layer-gathers-h100-compiled": "the fsdp census of unrolled layers in shard_map regions against the contract before "
                                   "and after it counted one gather: README's table of it is written by hand",
    "region-fsdp-h100-compiled": "the collectives of the regions manual over fsdp before and after they gathered "
                                 "their own weights: README's table of it is written by hand",
    "moe-region-fsdp-h100-compiled": "the collectives of MoE models before and after the MoE region gathered its "
                                     "own weights: README's table of it is written by hand",
    "joint-reduction-h100-compiled": "the census of XLA's joint gradient reductions against the contract before and "
                                     "after it counted them so, quoted in a sentence",
    "hoisted-tables-h100-compiled": "the census of k > 1 steps in the step's own scan against the contract before and "
                                    "after it counted the tables' reductions once: README's table of it is written by "
                                    "hand",
    "estimate-zero3-tables-h100-compiled": "the memory estimate beside XLA's peak under ZeRO-3 with large and small "
                                           "vocabularies, the slope the `gathered` term now counts: quoted in a "
                                           "paragraph",
    "scan-moe-memory-h100-compiled": "XLA's peak over the estimate before and after the scan's streams and the "
                                     "MoE rows' terms, rounded in README's table from the record's ratios",
    "swiglu-recompute-h100-compiled": "XLA's peak before and after the SwiGLU gating's own checkpoint, and the "
                                      "estimate beside it: README's table of it is written by hand",
    "softmax-custom-jvp-memory": "memory ratios before and after the softmax took its custom JVP, quoted in sentences",
    "loss-terms-tied-h100-compiled": "XLA's peak before and after the loss's terms were tied into its backward, "
                                     "and the estimate beside it: README's table of it is written by hand",
}


BEFORE = re.compile(r"^(.+)-([0-9a-f]{7,40})$")  # STEM-COMMIT: STEM's record measured at that commit

# the benchmarks whose table renders one record (bench.step's renders several: step_table)
TABLES = {"bench.pipeline": pipeline_table, "bench.tp": tp_table, "bench.context": context_table,
          "bench.moe": moe_table, "bench.gpu": gpu_table, "tools.gpu_compile": gpu_compile_table,
          "bench.tune_attention": tune_table}


def render(name: str, results: Path) -> str:
    """The table of the marker NAME: its records (one stem, or several by spaces for bench.step)
    rendered by the table of the benchmark that wrote them."""
    paths = [results / f"{stem}.json" for stem in name.split()]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ConfigError(f"<!-- figures: {name} -->: no record {', '.join(missing)}")
    records = [json.loads(path.read_text()) for path in paths]
    for path, record in zip(paths, records):
        check_complete(path, record)
    module = shlex.split(records[0]["command"])[2]
    if module == "bench.step":
        stems = name.split()
        befores = {m.group(1): (m.group(2), record) for stem, record in zip(stems, records) if (m := BEFORE.match(stem))}
        if befores and len(befores) * 2 == len(stems) and all(s in befores for s in stems if not BEFORE.match(s)):
            by_stem = dict(zip(stems, records))
            return step_change_table([(*befores[s], by_stem[s]) for s in stems if s in befores])
        return step_table(records)
    if module not in TABLES or len(records) > 1:
        raise ConfigError(f"<!-- figures: {name} -->: a table renders one record of {', '.join(TABLES)} "
                          f"or several of bench.step")
    return TABLES[module](records[0])


def check_complete(path: Path, record: dict) -> None:
    """A bench.step, pipeline, context or moe record with a failed case
    (bench.common.attempt) or cut short renders no README table: refused, naming the record and
    the first error."""
    cases = [record.get("throughput", {}), *record.get("compile_scaling", {}).get("rows", []),
             *record.get("one_device", []), *record.get("schedules", []), *record.get("rows", [])]
    errors = [c["error"] for c in cases if "error" in c]
    if errors or record.get("interrupted"):
        why = f"{len(errors)} failed case(s), the first: {errors[0]}" if errors else "it was interrupted"
        raise ConfigError(f"{path}: {why}; rerun its command for a complete record")


def blocks(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of every marked block: text[start:end] lies between its two markers."""
    found, opened, offset = [], None, 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        match = OPEN.fullmatch(line.strip())
        if match and opened:
            raise ConfigError(f"line {number}: {match[0]} opens inside <!-- figures: {opened[0]} -->, never closed")
        if match:
            opened = (match[1], offset + len(line))
        elif line.strip() == CLOSE:
            if not opened:
                raise ConfigError(f"line {number}: {CLOSE} closes no <!-- figures: NAME --> block")
            found.append((*opened, offset))
            opened = None
        offset += len(line)
    if opened:
        raise ConfigError(f"<!-- figures: {opened[0]} --> is never closed by {CLOSE}")
    return found


def regenerate(text: str, results: Path) -> tuple[str, list[str]]:
    """README's text with every block rendered afresh, and the names of the blocks that changed."""
    out, stale, last = [], [], 0
    for name, start, end in blocks(text):
        fresh = "\n" + render(name, results) + "\n\n"
        out += [text[last:start], fresh]
        if text[start:end] != fresh:
            stale.append(name)
        last = end
    return "".join(out + [text[last:]]), stale


def main(argv: list[str]) -> int:
    p = Parser(__doc__)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    p.add_argument("--readme", type=Path, default=README,
                   help="the README (default the checkout's); its records in bench/results/ beside it")
    args = p.parse_args(argv)
    if not args.readme.is_file():
        what = "a directory" if args.readme.is_dir() else "no such file"
        raise ConfigError(f"--readme {args.readme}: {what}; name the README file, e.g. --readme "
                          f"{args.readme / 'README.md' if args.readme.is_dir() else 'README.md'}")
    text = args.readme.read_text()
    if not blocks(text):
        raise ConfigError(f"--readme {args.readme}: no <!-- figures: NAME --> ... {CLOSE} block, so no table to "
                          f"{'check' if args.check else 'render'}; pass the README that marks them (default {README})")
    fresh, stale = regenerate(text, args.readme.parent / "bench" / "results")
    fix = "python -m bench.tables" + ("" if args.readme == README else f" --readme {args.readme}")
    if args.check:
        for name in stale:
            print(f"{args.readme}: <!-- figures: {name} --> differs from its record; run: {fix}")
        return 1 if stale else 0
    if stale:
        args.readme.write_text(fresh)
    print(f"{args.readme}: {len(stale)} figure block(s) rewritten")
    return 0


if __name__ == "__main__":
    run_cli(main)
