"""``gspo train | eval | compare | report | summary | probe | upcycle | config``: the command line."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from gspo.errors import UserError

EPILOG = """examples:
  gspo train configs/quickstart.toml
  gspo train configs/quickstart.toml algorithm=grpo train.steps=80 log.run_dir=runs/grpo
  gspo train configs/quickstart.toml --resume            # continue log.run_dir from its last checkpoint
  gspo eval configs/quickstart.toml --model runs/gspo-seed1/checkpoints/step-000160
  gspo compare configs/quickstart.toml --algos gspo,grpo --seeds 1,2 --out runs/compare
  gspo report runs/gspo-seed1 runs/grpo-seed1 --out runs/report
  gspo probe noise configs/quickstart.toml --out runs/gspo-seed1   # then gspo report shows the noise figure
  gspo upcycle --out models/smollm2-moe                 # a Mixtral MoE (8 experts, top-2) from the dense model
  gspo config                                           # every config key with its default and meaning
"""


def _config(path: str | None, overrides: list[str]):
    """The config a command runs with; imported here, not at the top, so that `gspo --help` loads no torch."""
    from gspo.config import load_config

    return load_config(path, overrides)


def _resume_command(args: argparse.Namespace, run_dir, nproc: int = 1) -> str:
    """The command that continues this run from its newest checkpoint."""
    return " ".join(["gspo train", *([shlex.quote(args.config)] if args.config else []), "--resume", "--run-dir",
                     shlex.quote(str(run_dir)), *(["--nproc", str(nproc)] if nproc > 1 else []),
                     *(shlex.quote(o) for o in args.overrides)])


def _launch(args: argparse.Namespace) -> int:
    """``gspo train ... --nproc N``: the same command under torchrun (one host), through the launcher that stops the
    job as a whole and ends it in one line (gspo.parallel.launch)."""
    from gspo.parallel.launch import run_job
    from gspo.parallel.strategy import check_layout

    cfg = _config(args.config, args.overrides)  # a bad config or layout: one line now, before any process starts
    check_layout(cfg, args.nproc)
    run_dir = args.run_dir or cfg.log.run_dir.format(algorithm=cfg.algorithm, seed=cfg.seed)
    worker = [*(["--debug"] if args.debug else []), "train", *([args.config] if args.config else []), *args.overrides,
              *(["--resume"] if args.resume else []), *(["--run-dir", str(args.run_dir)] if args.run_dir else [])]
    return run_job(args.nproc, worker, grace_s=cfg.dist.timeout_s, debug=args.debug, run_dir=Path(run_dir),
                   again=_resume_command(args, run_dir, args.nproc))


def _interrupted(args: argparse.Namespace, run_dir: Path) -> str:
    """What an interrupted `gspo train` left in ``run_dir`` and how to go on."""
    from gspo.checkpoint import what_is_kept

    if not (run_dir / "config_history.jsonl").is_file():  # it had not started: a plain start takes the directory over
        return f"nothing was trained in {run_dir}; run the same command again"
    return f"the run directory {run_dir} {what_is_kept(run_dir)}; continue with: {_resume_command(args, run_dir)}"


def _decode(cfg) -> int:
    """Run this process as a decode process until the trainers stop; its exit code (130 / 143 when a stop signal
    reached it too: the first one is the trainers' to act on, which finish the batch, checkpoint and send stop)."""
    from gspo.collect.decoder import run_decoder
    from gspo.train.guards import StopSignals

    with StopSignals(lambda: "decoding") as stop:
        run_decoder(cfg)
    return 0 if stop.received is None else (130 if stop.received == "SIGINT" else 143)


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch(args)  # imports no model code: only the job's processes train (~3 s of CPU each import)
    from gspo.parallel import comm
    from gspo.parallel.launch import STOP_CODES, report, report_error
    from gspo.collect.decoder import is_decoder
    from gspo.train import Trainer

    cfg = _config(args.config, args.overrides)
    run_dir = args.run_dir or cfg.log.run_dir.format(algorithm=cfg.algorithm, seed=cfg.seed)
    try:
        if is_decoder(cfg):  # rollout.decode_processes: this process only samples, for the trainers
            code = _decode(cfg)
            report(exit=code, stop_signal=STOP_CODES.get(code))
            return code
        trainer = Trainer(cfg, run_dir, resume=args.resume)
        out = trainer.train()
    except KeyboardInterrupt as e:  # a second Ctrl-C, or the first before the loop (start-up has nothing to finish)
        launched = report_error(e)  # under --nproc: the second stop signal, recorded for the launcher
        first = int(os.environ.get("RANK", "0") or 0) == 0 and not launched  # under --nproc the launcher says it
        return _exit_interrupted(f"gspo: interrupted; {_interrupted(args, Path(run_dir))}" if first else "")
    finally:
        comm.close()
    signame = trainer.stop_signal
    code = 0 if signame is None else (130 if signame == "SIGINT" else 143)
    launched = report(exit=code, stop_signal=signame, step=trainer.state.step)
    if not trainer.runtime.is_main:
        return code
    if signame is not None:
        if launched:  # the launcher prints the job's line, with --nproc in its command
            return code
        print(f"stopped by {signame} after {trainer.state.step} optimizer steps; checkpoint in {out / 'checkpoints'}; "
              f"continue with: {_resume_command(args, out)}", file=sys.stderr)
        return code
    from gspo.checkpoint import complete_checkpoints

    kept = f"checkpoints in {out / 'checkpoints'}" if complete_checkpoints(out / "checkpoints") else \
        "no checkpoint (log.final_checkpoint = false)"
    print(f"done: {trainer.state.step} optimizer steps; metrics in {out / 'metrics.jsonl'}, {kept}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from gspo.commands.evaluate import evaluate
    from gspo.commands.tables import eval_table

    cfg = _config(args.config, args.overrides)
    result = evaluate(cfg, model_name=args.model, n=args.n, samples=args.samples, batch_size=args.batch_size)
    shown = json.dumps(result, indent=1) if args.json else eval_table(result)
    if args.out:  # written before printing: a reader that closes the pipe early must not cost the file
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        except OSError as e:
            print(shown)
            raise UserError(f"gspo eval --out {args.out!r} could not be written ({e.strerror or e}); the result is "
                            "printed above; pick another path.") from None
    print(shown)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Train the same config under each algorithm and seed, then write the report and the key-metrics table."""
    from gspo.commands.compare import compare

    return compare(args.config, args.overrides, args.algos, args.seeds, Path(args.out), jobs=args.jobs)


def cmd_report(args: argparse.Namespace) -> int:
    from gspo.commands.report import write_report

    page = write_report(args.run_dirs, args.out, title=args.title)
    print(f"report: {page}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from gspo.commands.probe import noise_table, probe_noise
    from gspo.commands.report import noise_figure

    cfg = _config(args.config, args.overrides)
    out = Path(args.out)
    if out.is_dir() or not out.suffix:
        out = out / "probe_noise.json"
    result = probe_noise(cfg, out, rows=args.rows, n_bins=args.bins)
    figure = noise_figure(result, out.with_suffix(".png"))
    print(noise_table(result))
    print(f"probe: {out}, figure: {figure}")
    return 0


# Every flag's value is checked where it enters, by the parser: each option below has one of these as its ``type`` (or
# ``choices``), so a bad value ends in one line before any work, whatever the subcommand. Values checked later, at the
# one place they are used, are listed in CHECKED_DOWNSTREAM. tests/test_cli_contract.py enforces both.
def _number(accept, what: str, kind: type = float):
    """A numeric flag (``kind``: float or int) that ``accept(value)`` must hold for; ``what`` says what it must be."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return value

    parse.__name__ = what
    return parse


def _count(least: int):
    return _number(lambda v: v >= least, f"at least {least}", int)


def _entries(text: str, what: str) -> list[str]:
    """The entries of a comma-separated list, none of them empty: ``gspo,,grpo`` or ``1,`` most likely lost an entry
    to a typo, which would silently train less than was asked for."""
    entries = [t.strip() for t in text.split(",")]
    if not any(entries):
        raise argparse.ArgumentTypeError(f"{text!r} names no {what}")
    if "" in entries:
        raise argparse.ArgumentTypeError(f"{text!r} has an empty entry (entry {entries.index('') + 1}); write one "
                                         f"{what} between each pair of commas")
    return entries


def _no_repeats(text: str, keys: list) -> None:
    """Each entry once: two equal ones would train into one run directory (``<arm>-seed<seed>``) twice."""
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise argparse.ArgumentTypeError(f"{text!r} gives {twice} twice; name each once")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in _entries(text, "integer")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2)") from None
    _no_repeats(text, values)
    return values


def _presets(text: str) -> list[tuple[str, str, dict]]:
    """Comparison arms: presets, each optionally with "+"-suffixes (``grpo+r2``: GRPO with Routing Replay R2), as
    ``(arm, preset, overrides)``."""
    from gspo.commands.arms import ARM_SUFFIX_NAMES, parse_arm
    from gspo.config import PRESETS

    try:
        # an arm's name is its run directory's: the parts as parse_arm reads them ("gspo + r2" is "gspo+r2")
        algos = ["+".join(part.strip() for part in a.split("+")) for a in _entries(text, "arm")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; use a comma-separated list of {', '.join(PRESETS)}, each optionally "
                                         f"with {', '.join(ARM_SUFFIX_NAMES)}") from None
    _no_repeats(text, algos)
    arms, reasons = [], []
    for a in algos:
        try:
            arms.append((a, *parse_arm(a)))
        except UserError as e:
            reasons.append(str(e).rstrip("."))
    if reasons:
        raise argparse.ArgumentTypeError("; ".join(reasons))
    seen: dict[str, str] = {}
    for arm, preset, extra in arms:  # one arm spelled twice (suffixes in another order) would train twice
        key = repr((preset, sorted(extra.items())))
        if key in seen:
            raise argparse.ArgumentTypeError(f"{seen[key]!r} and {arm!r} are the same settings; keep one of them")
        seen[key] = arm
    return arms


def _path_text(text: str) -> None:
    """What every path argument must be as text: a NUL fails in the first system call (after the work), and gspo
    writes its paths into UTF-8 files (config.json, reports), which a name with a non-UTF-8 byte cannot go into."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path names nothing")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid UTF-8; rename the file or directory") from None
    if not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r} has a control character (a NUL, a newline); name the path without it")


def _path(kind: str):
    """A path argument's validator: the checks of every path (:func:`_path_text`), then its own; ``kind`` (``in
    file``, ``run dir``, ``checkpoint``, ``out dir``, ``out file``, ``new dir``) says what the path must be, which
    tests/test_cli_contract.py reads to give each one the paths it must refuse."""
    def wrap(check):
        @functools.wraps(check)
        def parse(text: str) -> str:
            _path_text(text)
            return check(text)

        parse.path = kind
        return parse

    return wrap


def _writable_ancestor(path: Path) -> None:
    """The nearest existing ancestor of ``path`` must be a directory this process can write into."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{str(path)!r} lies under {str(parent)!r}, which is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{str(path)!r} cannot be created: {str(parent)!r} is not writable")


@_path("out dir")
def _out_dir(text: str) -> str:
    """A directory to write into: it may exist (as a directory) or be creatable."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; name a directory (it is created if missing)")
    if not path.exists():
        _writable_ancestor(path)
    elif not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    return text


@_path("out file")
def _out_file(text: str) -> str:
    """A file to write (its directory is created): not an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; name a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    if not path.exists():
        _writable_ancestor(path)
    return text


@_path("out dir")
def _probe_out(text: str) -> str:
    """A run directory (probe_noise.json goes in it) or a path ending in .json."""
    return _out_file(text) if Path(text).suffix == ".json" else _out_dir(text)


@_path("run dir")
def _run_dir(text: str) -> str:
    """The directory of a `gspo train` run: it holds metrics.jsonl."""
    if not (Path(text) / "metrics.jsonl").is_file():
        what = "does not exist" if not Path(text).exists() else "has no metrics.jsonl"
        raise argparse.ArgumentTypeError(f"{text!r} {what}; pass the run directory of a `gspo train` run")
    return text


_fraction = _number(lambda v: 0.0 <= v <= 1.0, "a fraction in [0, 1]")
_positive = _number(lambda v: 0 < v < float("inf"), "a finite number > 0")


def _text(text: str) -> str:
    """Free text (a title): anything printable on one line."""
    if not text.isprintable():
        raise argparse.ArgumentTypeError(f"{text!r} has control characters; write it on one line")
    return text


def _config_file(text: str) -> str:
    """A TOML config file that exists and is not empty (an empty one would train every default, most likely not what
    was meant); its contents are checked where it is read (gspo.config.load_toml). Text with "=" that names no file is
    an override in the config's place (``gspo train algorithm=grpo``), which parse_args moves to the overrides."""
    if "=" in text and not os.path.lexists(text):
        return text
    _path_text(text)
    path = Path(text)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise argparse.ArgumentTypeError(f"config file {text!r} {what}; pass the path of a TOML file (see configs/)")
    try:
        empty = not path.read_bytes().strip()
    except OSError:  # unreadable: load_toml names the reason
        empty = False
    if empty:
        raise argparse.ArgumentTypeError(f"config file {text!r} is empty; write the settings into it, or leave it out "
                                         "to train the defaults")
    return text


_config_file.path = "in file"


def _model_ref(text: str) -> str:
    """A model: a path, a hub id or an alias, which gspo.models.load_model tells apart and checks; as text, what every
    path must be (a hub id has no NUL either)."""
    _path_text(text)
    return text


# Values checked at their one point of use (each raises a UserError naming the value there).
CHECKED_DOWNSTREAM = {
    "overrides": "gspo.config.build_config (dotted key=value, every value validated)",
    "--model": "gspo.models.load_model (a checkpoint, HF directory or id, GGUF or alias)",
}


def cmd_upcycle(args: argparse.Namespace) -> int:
    from gspo.commands.upcycle import run_upcycle

    cfg = _config(args.config, args.overrides)
    result = run_upcycle(cfg, args.out, experts=args.experts, top_k=args.top_k, drop=args.drop,
                         steps=args.distill_steps, lr=args.distill_lr, batch=args.distill_batch, eval_n=args.eval_n)
    summary = {k: result[k] for k in ("experts", "top_k", "drop", "kl_first", "kl_last", "parameters", "wall_s")}
    for name in ("dense_eval", "moe_eval"):
        if name in result:
            summary[name.replace("_eval", "_accuracy")] = result[name]["greedy_accuracy"]
    summary["pairwise_distance"] = result["experts_after_distill"]["pairwise_distance"]
    summary["routing_entropy"] = result["experts_after_distill"]["routing_entropy"]
    print(json.dumps(summary, indent=1))
    print(f"upcycled model: {args.out} (report: {Path(args.out) / 'upcycle.json'})")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from gspo.config import PRESETS, field_docs

    if args.markdown:
        print("| key | default | meaning |\n|---|---|---|")
        for key, default, doc in field_docs():
            print(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    else:
        for key, default, doc in field_docs():
            print(f"{key} = {default}\n    {doc}")
        print("\npresets:", ", ".join(PRESETS))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gspo.commands.export import export, export_critic

    if args.critic:
        if args.merge_lora or args.gguf:
            raise UserError("--critic exports the value model as a transformers directory; drop --merge-lora and "
                            "--gguf (they are for the policy).")
        ckpt = export_critic(Path(args.checkpoint), Path(args.out), dtype=args.dtype)
        print(f"exported the value model of {ckpt} to {args.out}")
        return 0
    ckpt = export(Path(args.checkpoint), Path(args.out), dtype=args.dtype, merge_lora=args.merge_lora, gguf=args.gguf)
    print(f"exported {ckpt} to {args.out}")
    return 0


@_path("checkpoint")
def _checkpoint_or_run(text: str) -> str:
    """A checkpoint directory (holding COMPLETE) or a run directory with checkpoints."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory; pass runs/NAME or runs/NAME/checkpoints/step-N")
    return text


@_path("new dir")
def _new_dir(text: str) -> str:
    """A directory that does not exist yet and can be created."""
    if Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} exists; name a new directory (nothing is overwritten)")
    _writable_ancestor(Path(text))
    return text


def cmd_summary(args: argparse.Namespace) -> int:
    from gspo.runlog.metrics import summarize
    from gspo.commands.tables import summary_table

    summaries = [summarize(run) for run in args.run_dirs]
    for s in summaries:
        if not s["steps"]:
            raise UserError(f"{s['run_dir']!r} has no metrics.jsonl lines yet; pass a run directory that has trained.")
    print("\n".join(json.dumps(s, indent=1) for s in summaries) if args.json else summary_table(summaries))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as a UserError: one line ``gspo: error: ...``, exit 2, like every other bad input."""

    def error(self, message: str):  # noqa: D102
        raise UserError(f"{self.prog}: {message}; see `{self.prog} --help`.")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="gspo", description="RL fine-tuning of language models with GSPO, GSPO-token, GRPO, DAPO.",
                epilog=EPILOG, formatter_class=fmt)
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy from a TOML config", epilog=EPILOG, formatter_class=fmt)
    t.add_argument("config", type=_config_file, help="TOML config file (see configs/ and `gspo config`)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. loss.eps_high=5e-4 rollout.group_size=16")
    t.add_argument("--resume", action="store_true", help="continue the run directory from its newest complete checkpoint")
    t.add_argument("--run-dir", type=_out_dir, help="run directory (default: log.run_dir of the config)")
    t.add_argument("--nproc", type=_count(1), default=1,
                   help="processes (GPUs) on this host: the same as launching with torchrun --standalone "
                        "--nproc_per_node N -m gspo.cli train ... (default 1)")
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("eval", help="greedy accuracy and pass@1 over k samples on the config's data")
    e.add_argument("config", nargs="?", type=_config_file, help="TOML config whose model / data / rollout / rewards sections are used")
    e.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    e.add_argument("--model", type=_model_ref, help="model to evaluate (a checkpoint directory, HF id, GGUF or alias); default model.name")
    e.add_argument("--n", type=_count(1), default=200, help="number of examples (default 200)")
    e.add_argument("--samples", type=_count(0), default=4, help="samples per example for pass@1 (0 = greedy only; default 4)")
    e.add_argument("--batch-size", type=_count(1), default=64, help="prompts per generation batch")
    e.add_argument("--out", type=_out_file, help="also write the result JSON here")
    e.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    e.set_defaults(func=cmd_eval)
    s = sub.add_parser("summary", help="headline numbers of finished runs (reward first/last, clipping, entropy)")
    s.add_argument("run_dirs", nargs="+", type=_run_dir, help="run directories")
    s.add_argument("--json", action="store_true", help="print each run's numbers as a JSON object instead of a table")
    s.set_defaults(func=cmd_summary)
    m = sub.add_parser("compare", help="train one config under several algorithms and seeds, then report")
    m.add_argument("config", nargs="?", type=_config_file, help="TOML config shared by every run (default: the built-in defaults)")
    m.add_argument("overrides", nargs="*", help="dotted key=value overrides for every run")
    m.add_argument("--algos", type=_presets, default="gspo,grpo",
                   help="comma-separated arms (default gspo,grpo): a preset, each optionally with suffixes: +r2 / +r3 "
                        "(Routing Replay R2 / R3), +enginelp (the engine's log-probs as the old policy's), +int8 (the "
                        "engine samples from int8-rounded weights), +credit (the task's per-token step credit), +envcredit (per-turn credit from the environment's step rewards), "
                        "+mb<N> (N minibatches per rollout batch), +lr<X> (learning rate X); e.g. grpo+mb8,gspo+enginelp")
    m.add_argument("--seeds", type=_int_list, default="1", help="comma-separated seeds (default 1)")
    m.add_argument("--out", type=_out_dir, required=True, help="directory for the runs (<arm>-seed<seed>) and report/")
    m.add_argument("--jobs", type=_count(1), default=1,
                   help="runs trained at the same time, each in its own process, each started on the visible GPU "
                        "running the fewest of them (default 1: one after another in this process)")
    m.set_defaults(func=cmd_compare)
    r = sub.add_parser("report", help="figures and an HTML page from run directories")
    r.add_argument("run_dirs", nargs="+", type=_run_dir, help="run directories")
    r.add_argument("--out", type=_out_dir, required=True, help="directory for index.html and the PNGs")
    r.add_argument("--title", type=_text, default="gspo report")
    r.set_defaults(func=cmd_report)
    q = sub.add_parser("probe", help="measurements on one rollout batch (noise: GRPO vs GSPO gradient noise by length)")
    q.add_argument("what", choices=["noise"], help="what to probe")
    q.add_argument("config", nargs="?", type=_config_file, help="TOML config (model, data, rollout, train settings)")
    q.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    q.add_argument("--out", type=_probe_out, required=True, help="run directory (probe_noise.json is written in it) or a .json path")
    q.add_argument("--rows", type=_count(2), default=48, help="responses probed (default 48)")
    q.add_argument("--bins", type=_count(1), default=5, help="length bins (default 5)")
    q.set_defaults(func=cmd_probe)
    u = sub.add_parser("upcycle", help="a Mixtral MoE from the dense model.name: upcycle, Drop-Upcycling, self-distillation")
    u.add_argument("config", nargs="?", type=_config_file, help="TOML config (model.name = the dense model; data = the task's prompts)")
    u.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    u.add_argument("--out", type=_new_dir, required=True, help="the new directory for the MoE model and upcycle.json")
    u.add_argument("--experts", type=_count(2), default=8, help="experts per layer (default 8)")
    u.add_argument("--top-k", type=_count(1), default=2, help="experts per token (default 2)")
    u.add_argument("--drop", type=_fraction, default=0.5,
                   help="Drop-Upcycling: fraction of each expert's intermediate channels re-initialised (default 0.5)")
    u.add_argument("--distill-steps", type=_count(0), default=200, help="self-distillation steps (default 200)")
    u.add_argument("--distill-lr", type=_positive, default=1e-4, help="self-distillation learning rate (default 1e-4)")
    u.add_argument("--distill-batch", type=_count(1), default=32, help="completions per distillation step (default 32)")
    u.add_argument("--eval-n", type=_count(0), default=200,
                   help="examples for the greedy accuracy of the dense and the MoE model (0 = skip; default 200)")
    u.set_defaults(func=cmd_upcycle)
    x = sub.add_parser("export", help="a checkpoint as a Hugging Face model directory (transformers, vLLM, peft load it)")
    x.add_argument("checkpoint", type=_checkpoint_or_run, help="a checkpoint, or a run directory (its newest one)")
    x.add_argument("--out", type=_new_dir, required=True, help="the new model directory")
    x.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="weights' dtype (default bf16)")
    x.add_argument("--merge-lora", action="store_true",
                   help="a LoRA checkpoint: the base model with the adapter merged in (default: the peft adapter)")
    x.add_argument("--gguf", action="store_true",
                   help="also write DIR/model.gguf (Llama-family models; llama.cpp's names and metadata)")
    x.add_argument("--critic", action="store_true",
                   help="a PPO run's value model instead, as <Arch>ForTokenClassification with one label")
    x.set_defaults(func=cmd_export)
    c = sub.add_parser("config", help="print every config key with its default and meaning")
    c.add_argument("--markdown", action="store_true", help="as a Markdown table")
    c.set_defaults(func=cmd_config)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as a namespace; a bad flag or value raises a UserError naming it."""
    parser = build_parser()
    # key=value overrides may come after options (argparse stops collecting positionals at the first option).
    args, rest = parser.parse_known_args(argv)
    extra = [r for r in rest if "=" in r and not r.startswith("-")]
    if len(extra) != len(rest) or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    config = getattr(args, "config", None)
    if config and "=" in config and not Path(config).exists():  # no config file given: the first override took its place
        args.overrides, args.config = [config, *args.overrides], None
    return args


def _exit_interrupted(line: str) -> int:
    """Ctrl-C: ``line`` is the last thing said (torch, when its import was interrupted, logs its cache statistics at
    exit, below the line); exit 130. (Now and then the interpreter, seeing the interrupt again at exit, ends by the
    signal itself, which a shell reports as 130 too.)"""
    if line:
        print(line, file=sys.stderr)
    logging.disable(logging.WARNING)
    return 130


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what the shell reports for `yes | head`, as 130 / 143 are SIGINT / SIGTERM here


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (`gspo config | head`), as opposed to a pipe of gspo's own
    (the reward workers') that broke, which is a real error."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() (Windows), or stdout is no file: assume it was stdout
        return True


def main(argv: list[str] | None = None) -> int:
    """``gspo ...``: the exit code of the subcommand; 2 for a user error, 141 when the reader of stdout went away."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a closed pipe raises now, where it is caught
    except BrokenPipeError:
        if not _reader_gone():
            raise
        # The standard way (Python's signal docs): the rest of the output goes nowhere, so the flush at exit is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    except KeyboardInterrupt:  # outside a subcommand's own handling: while the parser or transformers is imported
        return _exit_interrupted("gspo: interrupted")


def _main(argv: list[str] | None) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except UserError as e:
        if debug:
            raise
        print(f"gspo: error: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0") or 0)  # under torchrun only the first process logs what all of them do
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[gspo] %(message)s" if rank == 0 else f"[gspo rank {rank}] %(message)s", stream=sys.stderr)
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor loading bars would bury gspo's own progress line
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        from gspo.parallel.launch import report_error

        launched = report_error(e)  # a process of `gspo train --nproc`: the launcher prints one line for the job
        if isinstance(e, UserError) and not args.debug:
            if not launched:
                print(f"gspo: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, KeyboardInterrupt):
            return _exit_interrupted("" if launched else "gspo: interrupted")
        raise


if __name__ == "__main__":
    sys.exit(main())
